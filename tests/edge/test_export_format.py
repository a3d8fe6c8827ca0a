"""The export section of an export-only plan: what edge-export builds for a phone, and how."""

from __future__ import annotations

import json

from edge.cli import main as edge_select
from edge.device.describe import parse_device_json
from edge.formats.export import BUNDLE_OVERHEAD_BYTES, ExportSection, export_section
from edge.model.reader import default_model
from edge.plan.planner import make_plan
from edge.plan.schema import SCHEMA_VERSION, Plan

from .conftest import DATA


def test_a_phone_plan_carries_an_onnxruntime_w8_export(phone, smollm2):
    plan = make_plan(phone, smollm2)
    export = plan.export
    assert plan.path == "export-only" and plan.vllm is None
    assert (export.runtime, export.format) == ("onnxruntime", "onnx-qdq")
    assert (export.weight_bits, export.weight_block) == (8, 64)
    assert export.activations == "float16"
    assert export.alternative == "executorch"


def test_the_export_command_names_the_model_and_the_plan(phone, smollm2):
    export = make_plan(phone, smollm2).export
    assert export.command == ["edge-export", smollm2.name, f"{smollm2.name}-onnx-qdq", "--plan", "PLAN.json"]
    assert export.command_line("/models/smol").startswith("edge-export /models/smol ")


def test_the_expected_bundle_size_is_the_ledgers_export_weights(phone, smollm2):
    plan = make_plan(phone, smollm2)
    assert plan.export.bundle_bytes == plan.memory.resident_bytes + BUNDLE_OVERHEAD_BYTES
    # SmolLM2-135M: 162.8 M weights at 1 byte + 5 bytes per 64 (scale, zero point); the bundle edge-export built
    # here was 181,727,310 bytes (173.3 MiB) in all
    assert abs(plan.export.bundle_bytes - 181_727_310) < 0.02 * 181_727_310


def test_a_cpu_plan_has_no_export_section(avx2_host, smollm2):
    assert make_plan(avx2_host, smollm2).export is None


def test_an_android_description_round_trips_its_export_through_json():
    device = parse_device_json(json.loads((DATA / "inventory_phone_tensor_g2.json").read_text()))
    plan = make_plan(device, default_model())
    again = Plan.model_validate_json(plan.model_dump_json())
    assert isinstance(again.export, ExportSection) and again.export == plan.export


def test_edge_select_on_an_android_description_prints_the_export_command(capsys):
    assert edge_select(["--device", str(DATA / "inventory_phone_tensor_g2.json")]) == 0
    assert "edge-export " in capsys.readouterr().out


def test_export_section_defaults_to_the_measured_format():
    section = export_section("m", 1000)
    assert section.bundle_bytes == 1000 + BUNDLE_OVERHEAD_BYTES and section.runtime == "onnxruntime"


def test_edge_serve_on_a_phone_prints_the_export_command_instead_of_a_refusal(capsys):
    from server.cli import main as edge_serve

    device = str(DATA / "inventory_phone_tensor_g2.json")
    model = DATA / "configs" / "smollm2-135m-instruct.json"
    assert edge_serve(["--device", device, "--model", str(model), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"edge-select --device {device} --json > PLAN.json" in out
    assert f"edge-export {model} " in out and "--plan PLAN.json" in out


def test_post_plan_for_an_android_description_returns_the_export_section():
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    device = json.loads((DATA / "inventory_phone_tensor_g2.json").read_text())
    with TestClient(create_app(Settings())) as client:
        response = client.post("/plan", json={"device": {"profile": device}, "model": {"name": "default"}})
    assert response.status_code == 200
    body = response.json()
    assert body["path"] == "export-only" and body["schema_version"] == SCHEMA_VERSION
    assert body["export"]["runtime"] == "onnxruntime" and body["export"]["command"][0] == "edge-export"
