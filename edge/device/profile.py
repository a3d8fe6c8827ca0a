"""DeviceProfile: what a device is, each fact with where it came from.

The probe (this host), the JSON reader, the /proc/cpuinfo reader and the node-feature-discovery reader all
produce this one model; the selector reads nothing else about a device.
"""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")

Source = Literal[
    "cpuinfo",  # /proc/cpuinfo text (this host's or a saved one)
    "auxv",  # the ELF aux vector (AT_HWCAP/AT_HWCAP2)
    "sysfs",  # /sys/devices/system/...
    "cgroup",  # cgroup v1 or v2 limits
    "meminfo",  # /proc/meminfo text
    "os",  # os/platform calls (affinity, uname)
    "torch",  # measured or read through an installed torch
    "vllm",  # read from an installed vLLM
    "description",  # a device description given by the user (JSON)
    "nfd",  # Kubernetes node-feature-discovery labels
    "lscpu",  # util-linux `lscpu -J` output
    "derived",  # computed from other facts by a stated rule
    "unknown",  # nobody could tell
]

# The ISA vocabulary, in /proc/cpuinfo's spelling (x86 `flags`, ARM `Features`).
X86_FEATURES = (
    "amx_tile", "amx_bf16", "amx_int8",
    "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "avx_vnni", "avx2", "fma", "f16c",
)  # fmt: skip
# fphp/asimdhp: FP16 arithmetic (ARMv8.2), which vLLM's aarch64 build needs and a float16 plan runs on
ARM_FEATURES = ("asimd", "asimddp", "asimdhp", "fphp", "sve", "sve2", "i8mm", "bf16", "sme")
ISA_FEATURES = X86_FEATURES + ARM_FEATURES
# SVE vector length of the Arm cores that have SVE, by the core names Linux's cputype.h gives them
# (edge.device.cpuinfo.ARM_PARTS): Arm's technical reference manuals; Neoverse V1 (Graviton3) is the one 256-bit
# Arm core, Fujitsu's A64FX implements 512, every other SVE core 128. A device that states its length (the probe
# reads it from the kernel, a description's `sve_vector_bits`) overrides this.
ARM_SVE_BITS = {
    "Neoverse-V1": 256, "A64FX": 512, "Neoverse-V2": 128, "Neoverse-N2": 128, "Cortex-A510": 128,
    "Cortex-A710": 128, "Cortex-X2": 128,
}  # fmt: skip

DeviceClass = Literal["cpu", "phone"]


class Fact(BaseModel, Generic[T]):
    """One fact about a device: its value (None when unknown) and its source."""

    model_config = ConfigDict(frozen=True)

    value: T | None = None
    source: Source = "unknown"
    detail: str | None = Field(default=None, description="How it was read or derived, in words.")

    @property
    def known(self) -> bool:
        return self.value is not None


class RuntimeFacts(BaseModel):
    """Facts about the installed engine stack; all unknown on a remote device unless described."""

    torch_version: Fact[str] = Fact()
    torch_cpu_capability: Fact[str] = Fact()  # torch.backends.cpu.get_cpu_capability(): "AVX2", "AVX512", ...
    vllm_version: Fact[str] = Fact()
    vllm_native_library: Fact[str] = Fact()  # "_C", "_C_AVX512" or "_C_AVX2" (vLLM 0.28 x86, docs/FACTS.md)
    tinygemm_block: Fact[int] = Fact()  # output channels per tinygemm block: 32 on AVX2, 64 on AVX-512


class DeviceProfile(BaseModel):
    """Everything the planner knows about one device."""

    described_by: Literal["probe", "json", "cpuinfo", "nfd", "lscpu"]
    name: str | None = Field(default=None, description="Hostname or the description's own name.")
    os: Fact[str] = Fact()  # "linux", "android", ...
    device_class: Fact[DeviceClass] = Fact()  # "phone" means export-only (no vLLM backend for NPUs)
    arch: Fact[str] = Fact()  # "x86_64" or "aarch64"
    vendor: Fact[str] = Fact()
    cpu_model: Fact[str] = Fact()
    isa: Fact[list[str]] = Fact()  # the features of ISA_FEATURES that are present
    # ARM with SVE: the vector length in bits (torch dispatches SVE256 kernels only at 256; tinygemm's block follows)
    sve_vector_bits: Fact[int] = Fact()
    hypervisor: Fact[bool] = Fact()
    logical_cpus: Fact[int] = Fact()
    physical_cores: Fact[int] = Fact()
    usable_cpus: Fact[list[int]] = Fact()  # the affinity mask this process may run on
    cpu_quota: Fact[float] = Fact()  # cgroup quota in cores, None when unlimited
    numa_nodes: Fact[int] = Fact()
    memory_total_bytes: Fact[int] = Fact()
    memory_available_bytes: Fact[int] = Fact()
    memory_limit_bytes: Fact[int] = Fact()  # cgroup limit when lower than total, else None
    runtime: RuntimeFacts = RuntimeFacts()
    notes: list[str] = Field(
        default=[], description="What the description said that the planner did not read (unknown keys); "
        "a plan repeats them as warnings."
    )

    def has(self, feature: str) -> bool:
        assert feature in ISA_FEATURES, f"unknown ISA feature {feature!r}"
        return feature in (self.isa.value or [])

    @property
    def has_amx(self) -> bool:
        return self.has("amx_tile") and self.has("amx_bf16")

    @property
    def has_avx512(self) -> bool:
        return self.has("avx512f") and self.has("avx512bw")

    @property
    def is_phone(self) -> bool:
        return self.device_class.value == "phone" or self.os.value == "android"

    @property
    def compute_cores(self) -> int | None:
        """Cores the engine can use: the smallest of affinity, cgroup quota and physical cores."""
        candidates: list[float] = []
        if self.usable_cpus.value:
            candidates.append(len(self.usable_cpus.value))
        if self.cpu_quota.value:
            candidates.append(self.cpu_quota.value)
        if self.physical_cores.value:
            candidates.append(self.physical_cores.value)
        elif self.logical_cpus.value:
            candidates.append(self.logical_cpus.value)
        return max(1, int(min(candidates))) if candidates else None

    @property
    def usable_memory_bytes(self) -> int | None:
        """Memory the engine may take: available, capped by a cgroup limit."""
        values = [v for v in (self.memory_available_bytes.value, self.memory_limit_bytes.value) if v]
        if not values and self.memory_total_bytes.value:
            values = [self.memory_total_bytes.value]
        return min(values) if values else None

    @property
    def is_arm(self) -> bool:
        return self.arch.value == "aarch64" or self.isa_class == "arm"

    @property
    def arch_name(self) -> str | None:
        """The architecture, "aarch64" for any ARM device (a description may give only ARM features)."""
        return "aarch64" if self.is_arm else self.arch.value

    @property
    def sve_bits(self) -> Fact[int]:
        """The SVE vector length: as the device states it, else from its cores' names (ARM_SVE_BITS)."""
        if self.sve_vector_bits.known or not self.has("sve"):
            return self.sve_vector_bits
        model = self.cpu_model.value or ""
        lengths = {bits for core, bits in ARM_SVE_BITS.items() if core in model}
        if len(lengths) == 1:
            bits = lengths.pop()
            return Fact(value=bits, source="derived", detail=f"{model} implements {bits}-bit SVE (Arm's TRMs)")
        return Fact(detail=f"SVE of unknown length: no core of known length named in the CPU model ({model or 'none'})")

    @property
    def isa_class(self) -> str:
        """The class that measured facts are keyed by: amx, avx512, avx2, arm, or unknown."""
        if self.has_amx:
            return "amx"
        if self.has_avx512:
            return "avx512"
        if self.has("avx2"):
            return "avx2"
        if self.arch.value == "aarch64" or self.has("asimd"):
            return "arm"
        return "unknown"
