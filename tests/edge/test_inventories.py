"""Device descriptions as inventories keep them: more keys than the planner reads, under their own names.

Unknown keys become plan warnings, never errors; a wrong value of a key that is read stays an error naming the
key as the inventory wrote it. Samples in tests/edge/data:
- inventory_host_epyc_zen5.json: this project's AVX-512 machine as a fleet inventory records it (hostname,
  architecture, model_name, all of /proc/cpuinfo's flags as cpu_flags, memory_total_bytes from /proc/meminfo,
  and keys the planner has no use for: os_release, kernel, serial_number, rack, tags, last_seen).
- inventory_phone_tensor_g2.json: a phone as a device farm lists it (soc, npu, mem_total, abi, ...).
The lscpu samples are specified in test_lscpu.py; here they go through the CLI and HTTP like any description.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edge.device.describe import load_device, parse_device_json
from edge.errors import InputError
from edge.model.reader import default_model
from edge.plan.planner import make_plan
from tests.edge.conftest import DATA

HOST = "inventory_host_epyc_zen5.json"
PHONE = "inventory_phone_tensor_g2.json"


def inventory(name: str, **changes) -> dict:
    return {**json.loads((DATA / name).read_text()), **changes}


@pytest.mark.parametrize("name", [HOST, PHONE, "device_gw17.json", "device_phone.json"])
def test_every_inventory_sample_plans_without_error(name):
    device = load_device((DATA / name).read_text())
    assert make_plan(device, default_model()).reasons


def test_unknown_keys_are_plan_warnings_naming_them():
    device = parse_device_json(inventory(HOST))
    plan = make_plan(device, default_model())
    [warning] = [w for w in plan.warnings if "does not read" in w]
    for key in ("os_release", "kernel", "serial_number", "rack", "tags", "last_seen", "virtualization"):
        assert key in warning
    assert "cpu_flags" not in warning and "hostname" not in warning  # read, under their aliases


def test_a_long_list_of_unknown_keys_is_named_in_part_and_counted():
    device = parse_device_json({"arch": "x86_64", **{f"extra_{i:02d}": i for i in range(20)}})
    [note] = device.notes
    assert note.startswith("device description: 20 keys") and "extra_11" in note and "and 8 more" in note


def test_a_description_with_only_known_keys_has_no_notes():
    assert parse_device_json(json.loads((DATA / "device_gw17.json").read_text())).notes == []


def test_inventory_aliases_are_read_as_the_keys_they_stand_for():
    device = parse_device_json(inventory(HOST))
    assert device.name == "edge-vm-01" and device.arch.value == "x86_64" and device.cpu_model.value == "AMD EPYC"
    assert device.isa_class == "avx512" and device.has("avx512_bf16") and not device.has_amx
    assert device.isa.detail == "`cpu_flags` in the description"
    assert device.memory_total_bytes.value == inventory(HOST)["memory_total_bytes"]
    assert device.memory_total_bytes.detail == "`memory_total_bytes` in the description"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("fpu sse avx2 fma f16c hypervisor", ["avx2", "fma", "f16c"]),
        (["AVX2", "FMA3", "AVX512F", "AVX512BW"], ["avx512f", "avx512bw", "avx2", "fma"]),
        ([], []),
    ],
    ids=["cpuinfo-string", "nfd-spelling-list", "none"],
)
def test_flags_keep_the_isa_features_among_all_a_cpu_lists(flags, expected):
    assert parse_device_json({"arch": "x86_64", "flags": flags}).isa.value == expected


def test_a_phone_soc_makes_a_phone_and_names_its_cpu():
    device = parse_device_json(inventory(PHONE))
    assert device.is_phone and device.device_class.detail == "`soc` in the description"
    assert device.cpu_model.value == "Google Tensor G2" and device.memory_total_bytes.value == 8 * 2**30
    plan = make_plan(device, default_model())
    assert plan.path == "export-only"
    assert any("npu 'Edge TPU'" in w and "no NPU backend" in w for w in plan.warnings)
    assert any("abi" in w and "android_version" in w for w in plan.warnings)


def test_a_board_soc_is_only_the_cpu_model():
    device = parse_device_json({"arch": "aarch64", "soc": "Rockchip RK3588", "flags": "fp asimd asimddp"})
    assert not device.is_phone and device.cpu_model.value == "Rockchip RK3588"


def test_a_given_device_class_wins_over_the_soc():
    device = parse_device_json({"soc": "Qualcomm QCS6490", "device_class": "cpu", "arch": "aarch64"})
    assert not device.is_phone


@pytest.mark.parametrize(
    ("changes", "field", "shown"),
    [
        ({"mem_total": "lots"}, "mem_total", "'lots'"),
        ({"memory_total_bytes": "16GiB"}, "memory_total_bytes", "'16GiB'"),
        ({"cpu_flags": 42}, "cpu_flags", "42"),
        ({"cpu_flags": ["avx2", 7]}, "cpu_flags", "7"),
        ({"architecture": "riscv64"}, "architecture", "'riscv64'"),
        ({"hostname": ""}, "hostname", "''"),
        ({"soc": 8550}, "soc", "8550"),
        ({"cores": "two"}, "cores", "'two'"),
    ],
)
def test_a_wrong_value_of_a_read_key_is_an_error_naming_it_as_written(changes, field, shown):
    with pytest.raises(InputError) as error:
        parse_device_json(inventory(HOST, **changes))
    assert error.value.field == field
    assert shown in str(error.value)


@pytest.mark.parametrize(
    ("description", "named"),
    [
        ({"flags": "avx2", "cpu_flags": "avx2"}, ("flags", "cpu_flags")),
        ({"isa": ["avx2"], "cpu_flags": "avx2"}, ("isa", "cpu_flags")),
        ({"memory": "8GiB", "mem_total": "8GiB"}, ("memory", "mem_total")),
        ({"memory_bytes": 8, "memory_total_bytes": 8}, ("memory_bytes", "memory_total_bytes")),
        ({"mem_total": "8GiB", "memory_total_bytes": 8}, ("mem_total", "memory_total_bytes")),
        ({"name": "a", "hostname": "b"}, ("name", "hostname")),
    ],
)
def test_two_keys_for_one_fact_are_an_error_naming_both(description, named):
    with pytest.raises(InputError) as error:
        parse_device_json(description)
    assert all(f"`{key}`" in str(error.value) for key in named)


def _cli(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("edge-select", path=str(Path(sys.executable).parent))
    assert exe, "the edge-select console script is installed with the project"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", [HOST, "lscpu_host_epyc_zen5_tty.json"])
def test_edge_select_plans_an_inventory_or_lscpu_file_and_shows_the_warnings(name, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(tmp_path))
    result = _cli("--device", str(DATA / name))
    assert result.returncode == 0, result.stderr
    assert "avx512" in result.stdout
    if name == HOST:
        assert "warning   device description: 7 keys the planner does not read" in result.stdout


def test_post_plan_reads_lscpu_and_repeats_a_descriptions_notes_as_warnings():
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    lscpu = json.loads((DATA / "lscpu_host_epyc_zen5.json").read_text())["lscpu"]
    meminfo = (DATA / "meminfo_host.txt").read_text()
    with TestClient(create_app(Settings())) as client:
        answer = client.post("/plan", json={"device": {"lscpu": lscpu, "meminfo": meminfo, "name": "vm-7"}})
        assert answer.status_code == 200, answer.text
        plan = answer.json()
        assert plan["device"]["described_by"] == "lscpu" and plan["device"]["name"] == "vm-7"
        assert plan["device"]["memory_total_bytes"]["source"] == "meminfo"
        described = client.post("/plan", json={"device": {"profile": inventory(HOST)}}).json()
        assert any("serial_number" in w for w in described["warnings"])
        broken = client.post("/plan", json={"device": {"lscpu": [{"field": "CPU(s):", "data": {"n": 2}}]}})
        assert broken.status_code == 422
        [error] = broken.json()["detail"]
        assert error["loc"] == ["body", "device", "lscpu"] and error["field"] == "lscpu[0].data"
