"""Node-feature-discovery reader. Fixtures: nfd_spr_node.json (a Node object of a 2-socket Sapphire Rapids
bare-metal node, labels as NFD names them) and nfd_graviton3.json ({"labels", "capacity"} of a
c7g.2xlarge).
"""

import json
from pathlib import Path

import pytest

from edge.device.nfd import NFD_PREFIX, parse_nfd_labels
from edge.errors import InputError

DATA = Path(__file__).parent / "data"


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def spr_labels() -> dict[str, str]:
    return load("nfd_spr_node.json")["metadata"]["labels"]


def test_amx_node_object_has_amx_and_is_class_amx():
    node = parse_nfd_labels(load("nfd_spr_node.json"))
    assert node.has_amx and node.has("amx_int8")
    assert node.isa_class == "amx"
    assert node.described_by == "nfd"
    assert node.isa.source == "nfd"


def test_amx_node_maps_nfd_spellings_to_cpuinfo_spellings():
    node = parse_nfd_labels(load("nfd_spr_node.json"))
    for feature in ("avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni", "fma", "avx512bw"):
        assert node.has(feature), feature


def test_f16c_is_unknown_not_absent_because_nfd_does_not_label_it_by_default():
    node = parse_nfd_labels(load("nfd_spr_node.json"))
    assert not node.has("f16c")
    assert "F16C" in node.isa.detail


def test_node_capacity_gives_cpus_and_memory_and_allocatable_gives_available():
    node = parse_nfd_labels(load("nfd_spr_node.json"))
    assert node.logical_cpus.value == 224
    assert node.memory_total_bytes.value == 2113389196 * 1024
    assert node.memory_available_bytes.value == 2113286796 * 1024


def test_multithreaded_node_derives_half_its_cpus_as_physical_cores():
    node = parse_nfd_labels(load("nfd_spr_node.json"))
    assert node.physical_cores.value == 112
    assert node.physical_cores.source == "derived"


def test_node_name_arch_os_and_vendor_come_from_the_node_object():
    node = parse_nfd_labels(load("nfd_spr_node.json"))
    assert node.name == "spr-node-3"
    assert node.arch.value == "x86_64"
    assert node.os.value == "linux"
    assert node.vendor.value == "Intel"
    assert node.hypervisor.value is False  # no cpu-cpuid.HYPERVISOR label on bare metal


def test_numa_true_leaves_the_node_count_unknown():
    node = parse_nfd_labels(load("nfd_spr_node.json"))
    assert not node.numa_nodes.known
    assert "memory-numa=true" in node.numa_nodes.detail


def test_graviton_labels_with_capacity_are_arm_with_sve_but_no_sve2():
    g3 = parse_nfd_labels(load("nfd_graviton3.json"))
    assert g3.isa_class == "arm"
    assert g3.arch.value == "aarch64"
    assert g3.isa.value == ["asimd", "asimddp", "asimdhp", "fphp", "sve", "i8mm", "bf16"]
    assert (g3.logical_cpus.value, g3.physical_cores.value, g3.numa_nodes.value) == (8, 8, 1)


def test_a_bare_label_map_is_accepted_and_named_by_argument():
    node = parse_nfd_labels(spr_labels(), name="rack4-n3")
    assert node.isa_class == "amx"
    assert node.name == "rack4-n3"
    assert not node.memory_total_bytes.known


def test_keys_outside_nfd_are_ignored():
    labels = spr_labels() | {"team": "inference", "topology.kubernetes.io/zone": "eu-1a"}
    assert parse_nfd_labels(labels).isa_class == "amx"


def test_a_cpuid_flag_label_that_is_not_true_is_an_input_error_naming_the_label():
    key = NFD_PREFIX + "cpu-cpuid.AMXTILE"
    with pytest.raises(InputError) as error:
        parse_nfd_labels(spr_labels() | {key: "false"})
    assert error.value.field == key
    assert "'false'" in str(error.value)


def test_a_boolean_label_with_another_value_is_an_input_error():
    key = NFD_PREFIX + "memory-numa"
    with pytest.raises(InputError) as error:
        parse_nfd_labels(spr_labels() | {key: "yes"})
    assert error.value.field == key


def test_string_valued_nfd_labels_are_accepted():
    labels = spr_labels() | {
        NFD_PREFIX + "cpu-cpuid.AVX10_VERSION": "1",
        NFD_PREFIX + "kernel-version.full": "6.8.0",
    }
    assert parse_nfd_labels(labels).isa_class == "amx"


def test_labels_without_any_nfd_key_are_an_input_error():
    with pytest.raises(InputError) as error:
        parse_nfd_labels({"kubernetes.io/arch": "amd64"})
    assert error.value.field == "labels"


def test_a_bad_capacity_memory_names_its_field():
    with pytest.raises(InputError) as error:
        parse_nfd_labels({"labels": spr_labels(), "capacity": {"cpu": "8", "memory": "lots"}})
    assert error.value.field == "capacity.memory"


def test_millicpu_capacity_rounds_down_to_whole_cpus():
    node = parse_nfd_labels({"labels": spr_labels(), "capacity": {"cpu": "7910m"}})
    assert node.logical_cpus.value == 7
