"""Hand-written device descriptions, sizes, and telling the three device formats apart."""

import json
from pathlib import Path

import pytest

from edge.device.describe import load_device, parse_device_json, parse_size
from edge.device.profile import DeviceProfile
from edge.errors import InputError

DATA = Path(__file__).parent / "data"


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def gw17(**changes) -> dict:
    return load("device_gw17.json") | changes


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        (8589934592, 8 * 2**30),
        ("3GiB", 3 * 2**30),
        ("512MiB", 512 * 2**20),
        ("8G", 8 * 10**9),
        ("32Gi", 32 * 2**30),
        ("16110268Ki", 16110268 * 1024),
        ("1.5GiB", 3 * 2**29),
        ("100", 100),
    ],
)
def test_parse_size_reads_binary_and_decimal_units(written, expected):
    assert parse_size(written, "memory") == expected


@pytest.mark.parametrize("bad", [-1, "-1GiB", "8 gigs", "GiB", "8i", True, None, [8]])
def test_parse_size_rejects_what_is_not_a_size_naming_the_field(bad):
    with pytest.raises(InputError) as error:
        parse_size(bad, "budget")
    assert error.value.field == "budget"
    assert str(error.value).startswith("budget: expected a non-negative size")


def test_description_fills_facts_from_the_description():
    device = parse_device_json(gw17())
    assert device.described_by == "json"
    assert device.name == "gw-17"
    assert device.isa_class == "avx2"
    assert device.compute_cores == 4
    assert device.memory_total_bytes.value == 8 * 2**30
    assert device.isa.source == "description"


def test_description_carries_runtime_facts_it_names_and_leaves_the_rest_unknown():
    device = parse_device_json(gw17())
    assert device.runtime.torch_version.value == "2.13.0+cpu"
    assert device.runtime.tinygemm_block.value == 32
    assert not device.runtime.vllm_version.known
    assert not device.runtime.vllm_native_library.known


def test_android_description_is_a_phone_and_arm64_means_aarch64():
    phone = parse_device_json(load("device_phone.json"))
    assert phone.is_phone
    assert phone.arch.value == "aarch64"
    assert phone.memory_total_bytes.value == 12 * 2**30


def test_nfd_spelling_of_isa_names_is_accepted():
    device = parse_device_json(gw17(isa=["AVX512F", "AVX512BW", "AVX512BF16", "FMA3"]))
    assert device.isa.value == ["avx512f", "avx512bw", "avx512_bf16", "fma"]
    assert device.isa_class == "avx512"


def test_memory_bytes_is_accepted_as_an_integer():
    description = {k: v for k, v in gw17().items() if k != "memory"} | {"memory_bytes": 4 * 2**30}
    assert parse_device_json(description).memory_total_bytes.value == 4 * 2**30


def test_a_minimal_description_leaves_everything_else_unknown():
    device = parse_device_json({"arch": "x86_64"})
    assert device.arch.value == "x86_64"
    assert device.compute_cores is None
    assert device.usable_memory_bytes is None
    assert device.isa_class == "unknown"


@pytest.mark.parametrize(
    ("changes", "field", "shown"),
    [
        ({"isa": ["avx2", "avx9000"]}, "isa", "'avx9000'"),
        ({"isa": "avx2"}, "isa", "'avx2'"),
        ({"memory": "-8GiB"}, "memory", "'-8GiB'"),
        ({"memory": "plenty"}, "memory", "'plenty'"),
        ({"memory_available": -5}, "memory_available", "-5"),
        ({"cores": 0}, "cores", "0"),
        ({"cores": True}, "cores", "True"),
        ({"cores": "4"}, "cores", "'4'"),
        ({"arch": "riscv64"}, "arch", "'riscv64'"),
        ({"device_class": "gpu"}, "device_class", "'gpu'"),
        ({"tinygemm_block": 48}, "tinygemm_block", "48"),
        ({"torch_version": 2.13}, "torch_version", "2.13"),
        ({"memory_bytes": 1}, "memory", "'8GiB'"),
    ],
)
def test_a_bad_description_names_the_field_and_the_value(changes, field, shown):
    with pytest.raises(InputError) as error:
        parse_device_json(gw17(**changes))
    assert error.value.field == field
    assert shown in str(error.value)


def test_a_full_device_profile_is_taken_as_it_is():
    written = load("device_profile_probe.json")
    device = parse_device_json(written)
    assert device == DeviceProfile.model_validate(written)
    assert device.described_by == "probe"


def test_a_full_profile_with_an_unknown_isa_name_is_an_input_error():
    written = load("device_profile_probe.json")
    written["isa"]["value"] = ["avx2", "avx1024"]
    with pytest.raises(InputError) as error:
        parse_device_json(written)
    assert error.value.field == "isa.value"


def test_a_full_profile_with_a_wrong_type_names_the_path():
    written = load("device_profile_probe.json")
    written["logical_cpus"]["value"] = "many"
    with pytest.raises(InputError) as error:
        parse_device_json(written)
    assert error.value.field == "logical_cpus.value"


@pytest.mark.parametrize(
    ("name", "described_by"),
    [
        ("cpuinfo_spr_8480c.txt", "cpuinfo"),
        ("cpuinfo_rpi4.txt", "cpuinfo"),
        ("cpuinfo_android_sm8150.txt", "cpuinfo"),
        ("nfd_spr_node.json", "nfd"),
        ("nfd_graviton3.json", "nfd"),
        ("device_gw17.json", "json"),
        ("device_profile_probe.json", "probe"),
    ],
)
def test_load_device_tells_the_format_from_the_content(name, described_by):
    assert load_device((DATA / name).read_bytes()).described_by == described_by
    assert load_device((DATA / name).read_text()).described_by == described_by


def test_load_device_reads_a_bare_nfd_label_map():
    labels = load("nfd_spr_node.json")["metadata"]["labels"]
    assert load_device(json.dumps(labels)).isa_class == "amx"


@pytest.mark.parametrize(
    "garbage",
    ["", "just some words", b"\xff\xfe\x00\x01", "[1, 2, 3]", "MemTotal: 1024 kB"],
    ids=["empty", "prose", "binary", "json-array", "meminfo"],
)
def test_load_device_rejects_other_text_saying_which_formats_it_accepts(garbage):
    with pytest.raises(InputError) as error:
        load_device(garbage)
    assert error.value.field == "device"
    assert "/proc/cpuinfo" in str(error.value) and "JSON object" in str(error.value)


def test_load_device_reports_broken_json_with_its_position():
    with pytest.raises(InputError) as error:
        load_device('{"arch": "x86_64",')
    assert error.value.field == "device"
    assert "valid JSON" in str(error.value)
