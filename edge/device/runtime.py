"""Facts about the installed engine stack, read without importing torch or vLLM (importing torch alone takes
1.5-2.6 s here; `edge-select` must answer in well under a second).

Versions come from package metadata. What torch and vLLM would pick at import is derived from the CPU flags
by the rules they apply, each rule stated in the fact's detail.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Mapping

from edge.device.profile import Fact
from edge.facts import fact
from edge.formats import tinygemm

# x86 flags torch.cpu._is_avx512_supported() and ATen's AVX512 dispatch require (cpuinfo's avx512 checks).
TORCH_AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"})
TORCH_AVX2_FLAGS = frozenset({"avx2", "fma"})
TORCH_CAPABILITIES = {"default": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512", "sve256": "SVE256"}


def installed_version(*distributions: str) -> tuple[str, str] | None:
    """(distribution, version) of the first installed distribution, from its metadata (nothing imported)."""
    for name in distributions:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_fact(source: str, *distributions: str) -> Fact[str]:
    found = installed_version(*distributions)
    if found is None:
        return Fact(detail=f"not installed (no {' or '.join(distributions)} package metadata)")
    return Fact(value=found[1], source=source, detail=f"package metadata of {found[0]} (not imported)")


def torch_cpu_capability(
    flags: Iterable[str],
    arch: str | None,
    sve_vector_bits: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Fact[str]:
    """What torch.backends.cpu.get_cpu_capability() would return on this CPU, by ATen's DispatchStub rule."""
    flags = frozenset(flags)
    override = (env or {}).get("ATEN_CPU_CAPABILITY", "").lower()
    if override in TORCH_CAPABILITIES:
        return Fact(
            value=TORCH_CAPABILITIES[override],
            source="derived",
            detail=f"ATEN_CPU_CAPABILITY={override} overrides ATen's choice",
        )
    if arch == "x86_64":
        if flags >= TORCH_AVX512_FLAGS:
            return Fact(
                value="AVX512", source="derived", detail="ATen rule: avx512f/bw/dq/vl and fma -> AVX512"
            )
        if flags >= TORCH_AVX2_FLAGS:
            return Fact(
                value="AVX2", source="derived", detail="ATen rule: avx2 and fma, no full AVX-512 -> AVX2"
            )
        return Fact(value="DEFAULT", source="derived", detail="ATen rule: no avx2+fma -> DEFAULT")
    if arch == "aarch64":
        if "sve" in flags and sve_vector_bits == 256:
            return Fact(
                value="SVE256", source="derived", detail="ATen rule: SVE with 256-bit vectors -> SVE256"
            )
        bits = f"{sve_vector_bits}-bit SVE" if sve_vector_bits else "SVE length unknown"
        return Fact(value="DEFAULT", source="derived", detail=f"ATen rule: SVE256 needs 256-bit SVE ({bits})")
    return Fact(detail=f"no ATen dispatch rule known for arch {arch}")


def vllm_native_library(flags: Iterable[str], arch: str | None) -> Fact[str]:
    """The native library vLLM 0.28 CPU loads at import (vllm/platforms/cpu.py import_kernels, docs/FACTS.md)."""
    flags = frozenset(flags)
    if arch == "x86_64":
        if flags >= TORCH_AVX512_FLAGS:
            if "avx512_bf16" in flags:
                return Fact(
                    value="_C", source="derived", detail="vLLM 0.28 rule: AVX-512 with avx512_bf16 -> _C"
                )
            return Fact(
                value="_C_AVX512",
                source="derived",
                detail="vLLM 0.28 rule: AVX-512 without avx512_bf16 -> _C_AVX512",
            )
        return Fact(value="_C_AVX2", source="derived", detail="vLLM 0.28 rule: no AVX-512 -> _C_AVX2")
    if arch == "aarch64":
        return Fact(value="_C", source="derived", detail="vLLM 0.28 rule: every non-x86 CPU loads _C")
    return Fact(detail=f"no vLLM rule known for arch {arch}")


def derived_tinygemm_block(capability: str | None, arch: str | None = None) -> Fact[int]:
    """Tinygemm's output-channel block from torch's CPU capability and the architecture (edge.measure.kernel_params),
    as a Fact."""
    key = tinygemm.block_fact_key(capability, arch)
    block = tinygemm.derived_block(capability, arch)
    if key is None or block is None:
        return Fact(detail=f"no measured or derived tinygemm block for torch capability {capability}")
    measured = fact(key)
    return Fact(
        value=block,
        source="derived",
        detail=f"facts[{key}] = {block} ({measured.source}): {measured.note}",
    )
