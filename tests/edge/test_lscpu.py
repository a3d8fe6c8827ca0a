"""`lscpu -J` as a device description: util-linux's JSON, flat or nested, read into a DeviceProfile.

Samples in tests/edge/data:
- lscpu_host_epyc_zen5.json: this project's AVX-512 machine (2 cores of an AMD EPYC Zen 5 under KVM), util-linux
  2.38.1, `lscpu -J` piped (flat entries); lscpu_host_epyc_zen5_tty.json: the same command on a terminal, where
  2.38 nests entries under "children" (`Vendor ID` > `Model name` > `Flags`, `Caches (sum of all)` > `L1d`).
- lscpu_spr_8480c_util_linux_2_34.json: util-linux 2.34's flat format (topology before `Model name`, `CPU MHz`,
  `Vulnerability ...` fields), written out for the reference study's Xeon Platinum 8480C from its saved cpuinfo.
- lscpu_graviton3_util_linux_2_38_tty.json: 2.38's nested format for a Graviton3 (Neoverse-V1), from its saved
  cpuinfo; sections with null `data`.
- lscpu_rk3588_util_linux_2_38.json: 2.38's flat format for a big.LITTLE SoC (Rockchip RK3588): one `Model name`
  per core type with its own topology, `Socket(s): -` and `Cluster(s)`.
The last three are written in util-linux's format by hand (field names and order as those releases print them),
not captured on such machines.
"""

from __future__ import annotations

import json

import pytest

from edge.device.describe import load_device
from edge.device.lscpu import looks_like_lscpu, parse_lscpu
from edge.errors import InputError
from edge.model.reader import default_model
from edge.plan.planner import make_plan
from tests.edge.conftest import DATA

SAMPLES = [
    "lscpu_host_epyc_zen5.json",
    "lscpu_host_epyc_zen5_tty.json",
    "lscpu_spr_8480c_util_linux_2_34.json",
    "lscpu_graviton3_util_linux_2_38_tty.json",
    "lscpu_rk3588_util_linux_2_38.json",
]


def sample(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@pytest.mark.parametrize("name", SAMPLES)
def test_every_lscpu_sample_is_told_apart_by_its_content_and_plans(name):
    device = load_device((DATA / name).read_bytes())
    assert device.described_by == "lscpu"
    plan = make_plan(device, default_model())
    assert plan.memory.fits and plan.reasons


def test_the_flat_and_the_nested_output_of_one_machine_read_the_same():
    flat, nested = parse_lscpu(sample(SAMPLES[0])), parse_lscpu(sample(SAMPLES[1]))
    assert flat == nested
    assert flat.isa_class == "avx512" and flat.has("avx512_bf16") and not flat.has_amx
    assert (flat.vendor.value, flat.cpu_model.value) == ("AMD", "AMD EPYC")
    assert (flat.logical_cpus.value, flat.physical_cores.value, flat.numa_nodes.value) == (2, 2, 1)
    assert flat.hypervisor.value is True and flat.arch.value == "x86_64"


def test_the_old_flat_format_with_topology_before_the_model_name_reads_cores_and_amx():
    device = parse_lscpu(sample("lscpu_spr_8480c_util_linux_2_34.json"))
    assert device.cpu_model.value == "Intel(R) Xeon(R) Platinum 8480C" and device.vendor.value == "Intel"
    assert device.isa_class == "amx"
    assert (device.logical_cpus.value, device.physical_cores.value) == (16, 8)  # 2 threads per core


def test_arm_features_under_flags_make_an_arm_device():
    device = parse_lscpu(sample("lscpu_graviton3_util_linux_2_38_tty.json"))
    assert device.arch.value == "aarch64" and device.isa_class == "arm"
    assert {"asimd", "asimddp", "sve", "i8mm", "bf16"} <= set(device.isa.value)
    assert device.physical_cores.value == 8 and device.cpu_model.value == "Neoverse-V1"


def test_a_big_little_cpu_sums_its_core_types_over_their_clusters():
    device = parse_lscpu(sample("lscpu_rk3588_util_linux_2_38.json"))
    assert device.cpu_model.value == "Cortex-A55 + Cortex-A76"
    assert device.physical_cores.value == 4 * 1 + 2 * 2
    assert "2 core types" in device.physical_cores.detail
    assert device.isa.value == ["asimd", "asimddp", "asimdhp", "fphp"]


def test_flags_only_some_core_types_list_are_not_the_devices():
    entries = [
        {"field": "Architecture:", "data": "aarch64"},
        {"field": "Model name:", "data": "Cortex-A55"},
        {"field": "Flags:", "data": "fp asimd"},
        {"field": "Model name:", "data": "Cortex-A76"},
        {"field": "Flags:", "data": "fp asimd asimddp"},
    ]
    assert parse_lscpu({"lscpu": entries}).isa.value == ["asimd"]


def test_lscpu_says_nothing_of_memory_unless_meminfo_is_given():
    bare = parse_lscpu(sample(SAMPLES[0]))
    assert bare.usable_memory_bytes is None
    with_memory = parse_lscpu(sample(SAMPLES[0]), meminfo=(DATA / "meminfo_host.txt").read_text(), name="vm")
    assert with_memory.memory_total_bytes.source == "meminfo" and with_memory.usable_memory_bytes
    assert with_memory.name == "vm"


def test_numbers_as_json_numbers_read_like_strings():
    entries = [{"field": "Architecture:", "data": "x86_64"}, {"field": "CPU(s):", "data": 16},
               {"field": "Model name:", "data": "Xeon"}, {"field": "Core(s) per socket:", "data": 8},
               {"field": "Socket(s):", "data": 1}, {"field": "Flags:", "data": "avx2 fma"}]  # fmt: skip
    device = parse_lscpu({"lscpu": entries})
    assert (device.logical_cpus.value, device.physical_cores.value, device.isa_class) == (16, 8, "avx2")


def test_keys_beside_lscpu_are_noted_not_refused():
    obj = {**sample(SAMPLES[0]), "collected_by": "ansible"}
    assert looks_like_lscpu(obj)
    assert parse_lscpu(obj).notes == ["lscpu description: key 'collected_by' beside `lscpu` ignored"]


@pytest.mark.parametrize(
    ("lscpu", "field"),
    [
        ("Architecture: x86_64", "lscpu"),
        ([["Architecture:", "x86_64"]], "lscpu[0]"),
        ([{"field": "CPU(s):", "data": {"n": 2}}], "lscpu[0].data"),
        ([{"field": "NUMA:", "data": None, "children": {"field": "NUMA node(s):"}}], "lscpu[0].children"),
        ([], "lscpu"),
    ],
    ids=["text", "pair", "object-data", "children-object", "empty"],
)
def test_a_malformed_lscpu_document_names_where(lscpu, field):
    with pytest.raises(InputError) as error:
        parse_lscpu({"lscpu": lscpu})
    assert error.value.field == field


def test_children_nested_deeper_than_lscpu_ever_does_are_refused_not_recursed():
    entry: dict = {"field": "Architecture:", "data": "x86_64"}
    for _ in range(50):
        entry = {"field": "Deeper:", "data": None, "children": [entry]}
    with pytest.raises(InputError) as error:
        parse_lscpu({"lscpu": [entry]})
    assert "nested at most" in str(error.value)
