"""Read a device from the text of /proc/cpuinfo (and optionally /proc/meminfo).

x86 lists its ISA on `flags` lines, ARM on `Features` lines; both spell features the way edge.device.profile's
vocabulary does, so the ISA is the intersection of that vocabulary with the features every processor lists
(big.LITTLE phones can list different features per core; a kernel may run on any of them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from edge.bounds import MAX_BYTES, MAX_LINE_CHARS, MAX_TEXT_CHARS, small_int
from edge.device.profile import ARM_FEATURES, ISA_FEATURES, X86_FEATURES, DeviceProfile, Fact
from edge.errors import InputError

CPUINFO_EXPECTED = "text of /proc/cpuinfo with at least one processor entry"
MEMINFO_EXPECTED = "text of /proc/meminfo with a MemTotal line"

X86_VENDORS = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD", "HygonGenuine": "Hygon"}
# MIDR implementer codes, from Linux arch/arm64/include/asm/cputype.h.
ARM_IMPLEMENTERS = {
    "0x41": "ARM", "0x42": "Broadcom", "0x43": "Cavium", "0x48": "HiSilicon", "0x4e": "NVIDIA",
    "0x46": "Fujitsu", "0x51": "Qualcomm", "0x53": "Samsung", "0x61": "Apple", "0xc0": "Ampere",
}  # fmt: skip
# (implementer, part) -> core name, from the same header; only the cores a planner is likely to meet.
ARM_PARTS = {
    ("0x41", "0xd03"): "Cortex-A53", ("0x41", "0xd05"): "Cortex-A55", ("0x41", "0xd07"): "Cortex-A57",
    ("0x41", "0xd08"): "Cortex-A72", ("0x41", "0xd09"): "Cortex-A73", ("0x41", "0xd0a"): "Cortex-A75",
    ("0x41", "0xd0b"): "Cortex-A76", ("0x41", "0xd0c"): "Neoverse-N1", ("0x41", "0xd0d"): "Cortex-A77",
    ("0x41", "0xd40"): "Neoverse-V1", ("0x41", "0xd41"): "Cortex-A78", ("0x41", "0xd44"): "Cortex-X1",
    ("0x41", "0xd46"): "Cortex-A510", ("0x41", "0xd47"): "Cortex-A710", ("0x41", "0xd48"): "Cortex-X2",
    ("0x41", "0xd49"): "Neoverse-N2", ("0x41", "0xd4f"): "Neoverse-V2",
    ("0x46", "0x001"): "A64FX", ("0x51", "0x804"): "Kryo 4XX Gold", ("0x51", "0x805"): "Kryo 4XX Silver",
}  # fmt: skip
# A `Hardware` line naming one of these is a phone/tablet SoC, not a board or a server.
PHONE_SOC_WORDS = ("qualcomm", "snapdragon", "mediatek", "exynos", "kirin", "tensor", "unisoc", "dimensity")

# "MemTotal:       32594904 kB": no two adjacent runs over the same characters, so a failed match is linear.
_MEMINFO_LINE = re.compile(r"(\w+):\s+(\d{1,20})\s*kB")


@dataclass
class CpuinfoText:
    """/proc/cpuinfo split into per-processor blocks plus the lines outside any block (ARM's `Hardware`)."""

    processors: list[dict[str, str]] = field(default_factory=list)
    trailer: dict[str, str] = field(default_factory=dict)

    def first(self, key: str) -> str | None:
        for block in self.processors:
            if block.get(key):
                return block[key]
        return self.trailer.get(key) or None

    def distinct(self, key: str) -> list[str]:
        return sorted({b[key] for b in self.processors if key in b})

    def common_features(self) -> set[str]:
        """Features every processor lists (x86 `flags`, ARM `Features`)."""
        sets = [set((b.get("flags") or b.get("Features") or "").split()) for b in self.processors]
        return set.intersection(*sets) if sets else set()


def split_cpuinfo(text: str) -> CpuinfoText:
    """Split the text into processor blocks; raise InputError when there is none."""
    if not isinstance(text, str) or "\x00" in text:
        raise InputError("cpuinfo", text, CPUINFO_EXPECTED)
    check_lines("cpuinfo", text)
    parsed = CpuinfoText()
    current: dict[str, str] | None = None
    for line in text.splitlines():
        # "key<TAB>: value", split at the first colon. A regex with a lazy key and \s* before the colon (both
        # take spaces) backtracked quadratically: a 32,000-character line without a colon took 1.6 s.
        key, colon, value = line.strip().partition(":")
        key, value = key.strip(), value.strip()
        if not colon or not key:
            if not line.strip():
                current = None  # a blank line ends a processor block
            continue
        # "processor : 0" opens a block; old ARM kernels also print "Processor : AArch64 Processor rev 4".
        if key == "processor" and value.isdigit():
            current = {"processor": value}
            parsed.processors.append(current)
        elif current is not None:
            current[key] = value
        else:
            parsed.trailer[key] = value
    if not parsed.processors:
        raise InputError("cpuinfo", text, CPUINFO_EXPECTED)
    return parsed


def check_lines(field: str, text: str) -> None:
    """InputError naming `field` for text over MAX_TEXT_CHARS or with a line over MAX_LINE_CHARS."""
    if len(text) > MAX_TEXT_CHARS:
        raise InputError(field, text, f"text of at most {MAX_TEXT_CHARS} characters")
    longest = max(map(len, text.splitlines()), default=0)
    if longest > MAX_LINE_CHARS:
        raise InputError(field, text, f"lines of at most {MAX_LINE_CHARS} characters, got one of {longest}")


def cpu_flags(text: str) -> frozenset[str]:
    """All features every processor lists, vocabulary or not (the layout cache keys on these)."""
    return frozenset(split_cpuinfo(text).common_features())


@dataclass(frozen=True)
class MemInfo:
    total_bytes: int
    available_bytes: int | None


def parse_meminfo(text: str) -> MemInfo:
    """MemTotal and MemAvailable (kB in the file) in bytes."""
    if not isinstance(text, str):
        raise InputError("meminfo", text, MEMINFO_EXPECTED)
    check_lines("meminfo", text)
    values: dict[str, int] = {}
    for line in text.splitlines():
        match = _MEMINFO_LINE.fullmatch(line.strip())
        if match:
            values[match.group(1)] = int(match.group(2)) * 1024
    if not values.get("MemTotal"):
        raise InputError("meminfo", text, MEMINFO_EXPECTED)
    for key in ("MemTotal", "MemAvailable"):
        if values.get(key, 0) > MAX_BYTES:
            raise InputError(f"meminfo: {key}", values[key], f"at most {MAX_BYTES} bytes (1 EiB)")
    return MemInfo(values["MemTotal"], values.get("MemAvailable"))


def _arch(info: CpuinfoText, features: set[str]) -> Fact[str]:
    if info.first("flags") is not None or info.first("vendor_id") is not None:
        return Fact(
            value="x86_64" if "lm" in features else "i686",
            source="cpuinfo",
            detail="x86 `flags` line" + (" with lm (long mode)" if "lm" in features else ""),
        )
    arch = info.first("CPU architecture")
    if arch == "8" or "asimd" in features:
        return Fact(value="aarch64", source="cpuinfo", detail=f"ARM `Features`, CPU architecture {arch}")
    if arch == "7":
        return Fact(value="armv7l", source="cpuinfo", detail="ARM `Features`, CPU architecture 7 (32-bit)")
    return Fact(detail="neither x86 `flags` nor ARM `CPU architecture` lines")


def _vendor(info: CpuinfoText) -> Fact[str]:
    vendor_id = info.first("vendor_id")
    if vendor_id:
        return Fact(
            value=X86_VENDORS.get(vendor_id, vendor_id), source="cpuinfo", detail=f"vendor_id {vendor_id}"
        )
    implementers = info.distinct("CPU implementer")
    if implementers:
        names = [ARM_IMPLEMENTERS.get(i.lower(), i) for i in implementers]
        return Fact(
            value=" + ".join(names), source="cpuinfo", detail=f"CPU implementer {', '.join(implementers)}"
        )
    return Fact(detail="no vendor_id or CPU implementer line")


def _cpu_model(info: CpuinfoText) -> Fact[str]:
    for key in ("model name", "Model", "Hardware"):
        value = info.first(key)
        # "ARMv8 Processor rev 1 (v8l)" names no core; prefer the SoC or the board then.
        if value and not value.startswith("ARMv"):
            return Fact(value=value, source="cpuinfo", detail=f"`{key}` line")
    parts = []
    for block in info.processors:
        key = (block.get("CPU implementer", "").lower(), block.get("CPU part", "").lower())
        name = ARM_PARTS.get(key, f"part {key[1]}" if key[1] else None)
        if name and name not in parts:
            parts.append(name)
    if parts:
        return Fact(
            value=" + ".join(parts), source="cpuinfo", detail="`CPU part` lines (Linux cputype.h names)"
        )
    return Fact(detail="no model name, Hardware, Model or CPU part line")


def _physical_cores(info: CpuinfoText) -> Fact[int]:
    if all("physical id" in b and "core id" in b for b in info.processors):
        pairs = {(b["physical id"], b["core id"]) for b in info.processors}
        return Fact(value=len(pairs), source="cpuinfo", detail="distinct (physical id, core id) pairs")
    per_package = {
        b["physical id"]: b["cpu cores"] for b in info.processors if "physical id" in b and "cpu cores" in b
    }
    counts = [small_int(v) for v in per_package.values()]
    if per_package and all(counts):
        total = sum(c for c in counts if c)
        return Fact(value=total, source="cpuinfo", detail="`cpu cores` summed over physical ids")
    return Fact(detail="no core id / physical id / cpu cores lines (ARM cpuinfo has no core topology)")


def _isa(info: CpuinfoText, features: set[str], arch: str | None) -> Fact[list[str]]:
    vocabulary = X86_FEATURES if arch in ("x86_64", "i686") else ARM_FEATURES if arch == "aarch64" else ()
    present = [f for f in ISA_FEATURES if f in vocabulary and f in features]
    key = "flags" if arch in ("x86_64", "i686") else "Features"
    mixed = len({b.get(key, "") for b in info.processors}) > 1
    detail = f"`{key}` of all {len(info.processors)} processors" + (
        " (intersection: processors list different features)" if mixed else ""
    )
    if not vocabulary:
        return Fact(value=[], source="cpuinfo", detail=f"{detail}; no vocabulary for this architecture")
    return Fact(value=present, source="cpuinfo", detail=detail)


def host_model_name(path: str = "/proc/cpuinfo") -> str | None:
    """This host's CPU name as the probe reads it (`model name`, or an ARM board's), for benchmark and report
    headers; None where /proc/cpuinfo cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return _cpu_model(split_cpuinfo(f.read())).value
    except (OSError, InputError):
        return None


def _phone(info: CpuinfoText) -> str | None:
    hardware = info.first("Hardware") or ""
    return hardware if any(word in hardware.lower() for word in PHONE_SOC_WORDS) else None


def parse_cpuinfo(text: str, meminfo: str | None = None, name: str | None = None) -> DeviceProfile:
    """A DeviceProfile from /proc/cpuinfo text (and /proc/meminfo text when given); described_by="cpuinfo"."""
    info = split_cpuinfo(text)
    features = info.common_features()
    arch = _arch(info, features)
    phone_soc = _phone(info)
    if phone_soc:
        os_fact = Fact(value="android", source="derived", detail=f"`Hardware` names a phone SoC: {phone_soc}")
        device_class = Fact(
            value="phone", source="derived", detail=f"`Hardware` names a phone SoC: {phone_soc}"
        )
    else:
        os_fact = Fact(value="linux", source="derived", detail="/proc/cpuinfo is Linux's format")
        device_class = Fact(value="cpu", source="derived", detail="no phone SoC in `Hardware`")
    hypervisor: Fact[bool] = Fact(detail="ARM cpuinfo does not say")
    if arch.value in ("x86_64", "i686"):
        hypervisor = Fact(value="hypervisor" in features, source="cpuinfo", detail="x86 `hypervisor` flag")
    profile = DeviceProfile(
        described_by="cpuinfo",
        name=name,
        os=os_fact,
        device_class=device_class,
        arch=arch,
        vendor=_vendor(info),
        cpu_model=_cpu_model(info),
        isa=_isa(info, features, arch.value),
        hypervisor=hypervisor,
        logical_cpus=Fact(value=len(info.processors), source="cpuinfo", detail="processor entries"),
        physical_cores=_physical_cores(info),
    )
    if meminfo is not None:
        mem = parse_meminfo(meminfo)
        profile = profile.model_copy(
            update={
                "memory_total_bytes": Fact(value=mem.total_bytes, source="meminfo", detail="MemTotal"),
                "memory_available_bytes": Fact(
                    value=mem.available_bytes, source="meminfo", detail="MemAvailable"
                )
                if mem.available_bytes is not None
                else Fact(detail="no MemAvailable line (kernel before 3.14)"),
            }
        )
    return profile
