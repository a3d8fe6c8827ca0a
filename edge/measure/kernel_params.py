"""The w4a16 kernel's parameters for a host: the one owner the planner, the ledger and the kernels all ask.

Each is a pure function of what the asker knows about the host: the planner and the ledger pass facts from a
DeviceProfile (edge.device.probe, or a device description), the kernels pass what the running torch reports
(kernels.vllm_plugin.cpu_int4.host_params). The plan writes the values into the checkpoint's `quantization_config`, and
the vLLM method reads them from there, so the engine runs what the plan accounted for; a checkpoint without them
(written by hand) gets the kernel side's answer from the same functions.

    tinygemm_block      output channels per tinygemm block: 4 x the float vector width torch dispatched to
    dequant_threshold   rows from which a batch dequantizes and runs a GEMM instead of tinygemm
    prefill_dtype       the dtype of that GEMM
    repack_chunk_rows   output channels repacked at a time at load (bounds the int32 transient)
    decode_kernel       what runs the decode rows (edge.catalog.kernel_registry.DECODE_KERNELS): tinygemm, or a kernel
                        that is the default at the device's torch capability (the AVX2 int4 kernel under AVX2
                        dispatch, where torch's tinygemm is 2-4x slower, docs/reports) or that a calibration record
                        timed faster than tinygemm at 1 row on the model's shapes; a lossy one (int8 activations)
                        only for the speed priority, where it is faster still and an edge-eval record of the model
                        shows the quality floor holds (edge.plan.planner)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from edge.catalog.kernel_registry import (
    DECODE_KERNELS,
    DEFAULT_DECODE_KERNEL,
    PREFILL_KERNELS,
    default_decode_kernel,
    offered_lossy_decode_kernel,
)
from edge.device.calibration import CalibrationRecord
from edge.device.profile import DeviceProfile, Fact
from edge.device.runtime import derived_tinygemm_block, torch_cpu_capability
from edge.facts import fact

PrefillDtype = Literal["bfloat16", "float32"]
PREFILL_DTYPES: tuple[PrefillDtype, ...] = ("bfloat16", "float32")
FloatDtype = Literal["bfloat16", "float16"]


def float_dtype(device: DeviceProfile) -> FloatDtype:
    """The dtype the engine computes in (vLLM's --dtype; the plugin's scales follow it at load).

    bf16 on x86, where every vLLM build converts it in software when the CPU has no bf16 instructions (served on the
    project's AVX2 and AVX-512 hosts), and on ARM cores with BF16 (Graviton3, Neoverse V2). vLLM's aarch64 build runs
    bf16 through BFCVT/BFDOT/BFMMLA (disassembly, docs/FACTS.md), which an ARM core without BF16 (Cortex-A76 of a Pi 5
    or an RK3588, Neoverse N1) does not have: float16 there, which every core vLLM's aarch64 build runs on has (it
    is compiled for armv8.2-a+dotprod+fp16; edge.plan.gates refuses a core without FP16 arithmetic). The checkpoint
    keeps bf16 storage: vLLM casts it at load, exactly for values within float16's range."""
    if device.is_arm and not device.has("bf16"):
        return "float16"
    return "bfloat16"


def dequant_threshold(*, amx: bool, prefill_dtype: PrefillDtype) -> int:
    """AMX: 2 — tinygemm on a multi-row batch followed by vLLM's CPU attention dies with SIGILL (reference study).

    Elsewhere the hazard does not exist and the measured crossover of the GEMM the prefill runs is used: bf16
    (AVX-512 with AVX512-BF16: 128 rows at SmolLM2 shapes, 256 at 4096x4096, 2026-11-30) or fp32 (AVX2: 128 at
    SmolLM2 shapes, 256 at 4096x4096, 2026-11-29), both from benchmarks/dequant_paths.py.
    """
    if amx:
        return int(fact("amx.dequant_threshold").value)
    key = "avx512.dequant_threshold" if prefill_dtype == "bfloat16" else "avx2.dequant_threshold"
    return int(fact(key).value)


def prefill_dtype(*, capability: str | None, native_bf16: bool) -> PrefillDtype:
    """bf16 where torch dispatches AVX-512 kernels on a CPU with a native bf16 dot product (AVX512-BF16 or AMX);
    fp32 elsewhere: without it a bf16 GEMM is slow at batch (AVX2 host, 2 threads, 4096x4096: M=64 bf16 57.7 ms
    vs fp32 19.6 ms, M=512 471 vs 121 ms, docs/FACTS.md), and so is an AVX-512 CPU told to run AVX2 kernels."""
    return "bfloat16" if native_bf16 and capability == "AVX512" else "float32"


def repack_chunk_rows(*, amx: bool, block: int) -> int:
    """AMX (24-32 threads): 2048 rows were fastest (reference study); here (1 thread, as vLLM serves) time is flat
    in the chunk and 512 rows keep the transient small (kernels/ops/tinygemm.py's table). Always whole blocks."""
    rows = int(fact("any.repack_chunk_rows" if amx else "avx2.repack_chunk_rows").value)
    return max(block, rows - rows % block)


@dataclass(frozen=True)
class KernelParams:
    """The values for one host, as the plan writes them into quantization_config."""

    block: int
    dequant_threshold: int
    prefill_dtype: PrefillDtype
    repack_chunk_rows: int
    measured: str | None = None  # how the threshold and dtype were measured, when a calibration record set them
    decode_kernel: str = DEFAULT_DECODE_KERNEL
    # A lossy decode kernel (int8 activations) faster than decode_kernel here: the speed priority takes it where the
    # model's measured quality allows (edge.plan.planner); and why, for the plan's reasons.
    lossy_decode: str | None = None
    lossy_decode_why: str | None = None


def params(*, capability: str | None, amx: bool, native_bf16: bool, block: int) -> KernelParams:
    dtype = prefill_dtype(capability=capability, native_bf16=native_bf16)
    return KernelParams(
        block=block,
        dequant_threshold=dequant_threshold(amx=amx, prefill_dtype=dtype),
        prefill_dtype=dtype,
        repack_chunk_rows=repack_chunk_rows(amx=amx, block=block),
    )


def device_capability(device: DeviceProfile) -> str | None:
    """The torch CPU capability the device runs at: probed (it honours ATEN_CPU_CAPABILITY), else by ATen's rule on
    ARM (SVE256 needs 256-bit SVE: edge.device.runtime) and by ISA class on x86."""
    if device.runtime.torch_cpu_capability.value:
        return device.runtime.torch_cpu_capability.value
    if device.is_arm:
        return torch_cpu_capability(device.isa.value or [], "aarch64", device.sve_bits.value).value
    return {"amx": "AVX512", "avx512": "AVX512", "avx2": "AVX2"}.get(device.isa_class)


def block_fact(device: DeviceProfile) -> Fact[int]:
    """Tinygemm's block on the device: measured where the device says it (the probe measures it), else the block its
    capability implies on its architecture, else AVX2's (the smaller x86 block is the conservative ledger)."""
    if device.runtime.tinygemm_block.known:
        return device.runtime.tinygemm_block
    derived = derived_tinygemm_block(device_capability(device), device.arch_name)
    if derived.known:
        if device.is_arm and device.has("sve") and not device.sve_bits.known:
            return derived.model_copy(update={"detail": f"{derived.detail}; {device.sve_bits.detail}"})
        return derived
    return Fact(value=int(fact("avx2.tinygemm_block").value), source="derived",
                detail=f"{derived.detail}: AVX2's block, the smaller x86 one")  # fmt: skip


def for_device(device: DeviceProfile, record: CalibrationRecord | None = None,
               shapes: list[tuple[int, int]] | None = None) -> KernelParams:  # fmt: skip
    """The plan's values: the block from block_fact.

    With a calibration record of the device and the model's GEMM shapes, the prefill dtype is the one the record
    measured faster at a prompt's rows and the threshold the measured crossover with tinygemm (edge.measure.cost); AMX
    keeps its threshold of 2 whatever the times say (the SIGILL hazard is not a speed question)."""
    capability = device_capability(device)
    base = params(
        capability=capability,
        amx=device.has_amx,
        native_bf16=device.has_amx or device.has("avx512_bf16"),
        block=int(block_fact(device).value or 0),
    )
    if record is None or not shapes:
        # torch's AVX2 tinygemm: the AVX2 kernels measured 3.5x (int16) and 5.2x (int8 activations) faster at 1
        # row, 4096x4096 (facts avx2.1t.gemm.m1.*); without a compiler cpu_int4 logs why and keeps tinygemm.
        decode = default_decode_kernel(capability, device.isa_class)
        lossy = offered_lossy_decode_kernel(capability, device.isa_class)
        why = (f"{DECODE_KERNELS[lossy].decode.label}, faster than {DECODE_KERNELS[decode].decode.label} at 1 row "
               f"under {capability} dispatch (facts table; no calibration record)") if lossy else None  # fmt: skip
        return replace(base, decode_kernel=decode, lossy_decode=lossy, lossy_decode_why=why)
    return measured(base, record, shapes, amx=device.has_amx)


def measured(base: KernelParams, record: CalibrationRecord, shapes: list[tuple[int, int]], *,
             amx: bool) -> KernelParams:  # fmt: skip
    """`base` with the record's measured prefill dtype and crossover (when it measured them)."""
    from edge.measure.cost import faster_decode, faster_prefill, measured_threshold

    dtype = faster_prefill(record, shapes) or base.prefill_dtype
    crossover = measured_threshold(record, shapes, PREFILL_KERNELS[dtype])
    threshold = base.dequant_threshold if amx or crossover is None else crossover
    how = (f"prefill in {dtype}, measured faster; dequantize from {threshold} rows, "
           + ("the AMX hazard's value" if amx else "the measured crossover with tinygemm" if crossover
              else "the facts table's value (dequantize never beat tinygemm up to the rows timed)")
           + f" ({record.describe()})")  # fmt: skip
    decode, lossy = faster_decode(record, shapes)
    if decode != DEFAULT_DECODE_KERNEL:
        how += f"; decode rows on {DECODE_KERNELS[decode].decode.label}, measured faster than tinygemm at 1 row"
    why = (f"{DECODE_KERNELS[lossy].decode.label}, measured faster than {decode} at 1 row ({record.describe()})"
           if lossy else None)  # fmt: skip
    return replace(base, prefill_dtype=dtype, dequant_threshold=threshold, measured=how, decode_kernel=decode,
                   lossy_decode=lossy, lossy_decode_why=why)  # fmt: skip
