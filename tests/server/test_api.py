"""The HTTP API of a planning-only server (no engine): /plan, /plan/batch, /probe, /status, health, errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from edge.device.cpuinfo import parse_cpuinfo
from edge.device.describe import parse_device_json
from edge.device.nfd import parse_nfd_labels
from edge.measure.quality import cached_records
from edge.model.reader import default_model, read_model_config
from edge.plan.planner import make_plan
from server.app import create_app, weight_path
from server.settings import Settings
from tests.server.conftest import smollm2_plan

DATA = Path(__file__).parents[1] / "edge" / "data"  # device fixtures of the edge tests (real cpuinfo excerpts)
SPR_CPUINFO = (DATA / "cpuinfo_spr_8480c.txt").read_text()
HOST_CPUINFO = (DATA / "cpuinfo_host_epyc_avx2.txt").read_text()
HOST_MEMINFO = (DATA / "meminfo_host.txt").read_text()
GW17 = json.loads((DATA / "device_gw17.json").read_text())
SPR_NODE = json.loads((DATA / "nfd_spr_node.json").read_text())
QWEN3_CONFIG = json.loads((DATA / "configs" / "qwen3-0.6b.json").read_text())


@pytest.fixture
def client() -> TestClient:
    with TestClient(create_app(Settings())) as client:
        yield client


def plan_json(**kwargs) -> dict:
    """The planner's own plan, with the quality records /plan reads too (the cache's edge-eval records)."""
    return json.loads(make_plan(**kwargs, quality=cached_records()).model_dump_json())


def test_plan_from_cpuinfo_text_is_the_planners_plan_for_that_device(client):
    response = client.post("/plan", json={"device": {"cpuinfo": SPR_CPUINFO}})
    assert response.status_code == 200
    assert response.json() == plan_json(device=parse_cpuinfo(SPR_CPUINFO), model=default_model())
    assert "amx_tile" in response.json()["device"]["isa"]["value"]


def test_plan_from_cpuinfo_uses_meminfo_and_name(client):
    body = {"device": {"cpuinfo": HOST_CPUINFO, "meminfo": HOST_MEMINFO, "name": "edge-7"}}
    plan = client.post("/plan", json=body).json()
    expected = parse_cpuinfo(HOST_CPUINFO, meminfo=HOST_MEMINFO, name="edge-7")
    assert plan["device"]["name"] == "edge-7"
    assert plan["device"]["memory_total_bytes"]["value"] == expected.memory_total_bytes.value


def test_plan_from_nfd_labels(client):
    response = client.post("/plan", json={"device": {"nfd_labels": SPR_NODE}})
    assert response.status_code == 200
    assert response.json() == plan_json(device=parse_nfd_labels(SPR_NODE), model=default_model())


def test_plan_from_a_hand_written_device_description(client):
    response = client.post("/plan", json={"device": {"profile": GW17}, "priority": "fidelity"})
    assert response.status_code == 200
    expected = plan_json(device=parse_device_json(GW17), model=default_model(), priority="fidelity")
    assert response.json() == expected


def test_plan_from_a_probed_profile_round_trips(client):
    profile = json.loads(parse_cpuinfo(HOST_CPUINFO).model_dump_json())
    response = client.post("/plan", json={"device": {"profile": profile}})
    assert response.status_code == 200
    assert response.json()["device"] == profile


def test_plan_for_a_config_json_model(client):
    body = {"device": {"profile": GW17}, "model": {"config": QWEN3_CONFIG, "name": "Qwen3-0.6B"}}
    plan = client.post("/plan", json=body).json()
    assert plan["model"]["name"] == "Qwen3-0.6B"
    assert plan["model"] == read_model_config(QWEN3_CONFIG, "Qwen3-0.6B").model_dump()


def test_plan_for_a_gguf_header_equals_the_plan_for_the_file_itself(client):
    """POST /plan with the default model's GGUF header as JSON (what a fleet tool reads from the file with
    gguf-py, no tensor data) gives the plan `edge-select --model FILE.gguf` makes for that device."""
    pytest.importorskip("gguf")
    from edge.model.gguf_metadata import read_header
    from edge.model.reader import read_model
    from kernels.source.default_model import source_gguf

    gguf = source_gguf()
    header = read_header(gguf)
    tensors = [{"name": t.name, "type": t.type, "shape": list(t.shape)} for t in header.tensors]
    body = {"device": {"profile": GW17}, "model": {"gguf": {"metadata": header.metadata, "tensors": tensors},
                                                   "name": gguf.stem}}  # fmt: skip
    response = client.post("/plan", json=body)
    assert response.status_code == 200, response.text
    plan = response.json()
    assert plan["model"] == read_model(gguf).model_dump()
    expected = make_plan(parse_device_json(GW17), read_model(gguf), quality=cached_records())
    assert (plan["path"], plan["quantization_config"]) == (expected.path, expected.quantization_config)


def test_plan_for_a_mixed_grid_gguf_header_decides_each_tensor_as_the_file_does(client, tmp_path):
    """A file whose kinds are not on one grid (tests/kernels/test_mixed_grid.py: attn_v at Q6_K on some layers,
    ffn_gate at Q8_0 but on one): its header as JSON gives the file's per-layer types and the plan's per-tensor 8-bit
    set, the ones `edge-select --model FILE.gguf` gives."""
    pytest.importorskip("gguf")
    from edge.model.gguf_metadata import read_header
    from edge.model.reader import read_model
    from tests.kernels.test_mixed_grid import expected_int8, mixed_gguf

    path = mixed_gguf(tmp_path)
    header = read_header(path)
    tensors = [{"name": t.name, "type": t.type, "shape": list(t.shape)} for t in header.tensors]
    body = {"device": {"profile": GW17}, "model": {"gguf": {"metadata": header.metadata, "tensors": tensors},
                                                   "name": path.stem}, "path": "w4a16-tinygemm"}  # fmt: skip
    response = client.post("/plan", json=body)
    assert response.status_code == 200, response.text
    plan = response.json()
    assert plan["model"] == read_model(path).model_dump()
    assert plan["model"]["source_layers"]["v_proj"] == {"Q4_K": [1, 2, 3], "Q6_K": [0, 4, 5]}
    expected = make_plan(parse_device_json(GW17), read_model(path), path="w4a16-tinygemm", quality=cached_records())
    assert plan["quantization_config"] == expected.quantization_config
    assert plan["layers"] == [layer.model_dump() for layer in expected.layers]
    named = {entry + ".weight" for entry in plan["quantization_config"]["int8"]}
    assert named - {"embed_tokens.weight", "lm_head.weight"} == expected_int8()


def test_a_gguf_header_of_an_unknown_architecture_is_422_naming_it(client):
    body = {"device": {"profile": GW17}, "model": {"gguf": {"metadata": {"general.architecture": "rwkv7"}}}}
    response = client.post("/plan", json=body)
    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "model", "gguf"] and "rwkv7" in error["msg"]


def test_memory_budget_as_a_size_string_equals_the_same_bytes(client):
    by_text = client.post("/plan", json={"device": {"profile": GW17}, "memory_budget": "3GiB"}).json()
    by_int = client.post("/plan", json={"device": {"profile": GW17}, "memory_budget": 3 << 30}).json()
    assert by_text["memory"]["budget_bytes"] == 3 << 30
    assert by_text == by_int


def test_max_model_len_and_max_num_seqs_reach_the_plan(client):
    body = {"device": {"profile": GW17}, "max_model_len": 1024, "max_num_seqs": 2}
    plan = client.post("/plan", json=body).json()
    assert (plan["max_model_len"], plan["max_num_seqs"]) == (1024, 2)


def test_pinned_path_reaches_the_plan(client):
    plan = client.post("/plan", json={"device": {"profile": GW17}, "path": "bf16"}).json()
    assert plan["path"] == "bf16" and plan["pinned"] is True


def test_bad_cpuinfo_is_422_naming_the_field(client):
    response = client.post("/plan", json={"device": {"cpuinfo": "this is not /proc/cpuinfo"}})
    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "device", "cpuinfo"]
    assert error["field"] == "cpuinfo" and "cpuinfo" in error["msg"]


def test_unknown_isa_in_a_description_is_422_naming_the_field(client):
    response = client.post("/plan", json={"device": {"profile": {**GW17, "isa": ["avx2", "avx9000"]}}})
    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "device", "profile"] and error["field"] == "isa"
    assert "avx9000" in error["msg"]


def test_config_json_missing_a_field_is_422_naming_it(client):
    config = {k: v for k, v in QWEN3_CONFIG.items() if k != "hidden_size"}
    response = client.post("/plan", json={"device": {"profile": GW17}, "model": {"config": config}})
    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "model", "config"] and "hidden_size" in error["msg"]


def test_a_validation_422_names_the_value_without_echoing_the_body(client):
    """FastAPI's own handler returns each error's whole input; a 100 kB value must not come back whole."""
    response = client.post("/plan", json={"device": {"profile": GW17}, "priority": "s" * 100_000,
                                          "devices_note": ["x" * 1000] * 50})  # fmt: skip
    assert response.status_code == 422
    assert len(response.content) < 4096
    [error] = [e for e in response.json()["detail"] if e["loc"] == ["body", "priority"]]
    assert error["msg"].endswith(f"... ({100_000 + 2} characters)") and "'ssss" in error["msg"]


def test_unreadable_memory_budget_is_422_naming_it(client):
    response = client.post("/plan", json={"device": {"profile": GW17}, "memory_budget": "three gigs"})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "memory_budget"]


def test_zero_memory_budget_is_422(client):
    response = client.post("/plan", json={"device": {"profile": GW17}, "memory_budget": 0})
    assert response.status_code == 422
    assert response.json()["detail"][0]["field"] == "memory_budget"


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({}, ["body", "device"]),
        ({"device": {"profile": GW17}, "priority": "fastest"}, ["body", "priority"]),
        ({"device": {"profile": GW17}, "max_model_len": 0}, ["body", "max_model_len"]),
        ({"device": {"profile": GW17}, "path": "w2a2"}, ["body", "path"]),
        ({"device": {"profile": GW17}, "model": {"name": "gpt-5"}}, ["body", "model"]),
    ],
)
def test_request_validation_errors_are_422_naming_the_field(client, body, loc):
    response = client.post("/plan", json=body)
    assert response.status_code == 422
    assert any(error["loc"][: len(loc)] == loc for error in response.json()["detail"])


def test_device_with_two_formats_at_once_is_422(client):
    response = client.post("/plan", json={"device": {"cpuinfo": SPR_CPUINFO, "nfd_labels": SPR_NODE}})
    assert response.status_code == 422


def test_body_that_is_not_json_is_422(client):
    response = client.post("/plan", content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 422


def test_deeply_nested_json_is_a_client_error_not_a_crash(client):
    response = client.post("/plan", content=b"[" * 200_000, headers={"Content-Type": "application/json"})
    assert 400 <= response.status_code < 500
    assert client.get("/healthz").status_code == 200


def test_batch_plans_each_device_and_reports_each_error_in_place(client):
    devices = [{"cpuinfo": SPR_CPUINFO}, {"cpuinfo": "garbage"}, {"nfd_labels": SPR_NODE}]
    response = client.post("/plan/batch", json={"devices": devices, "priority": "fidelity"})
    assert response.status_code == 200
    batch = response.json()
    assert (batch["planned"], batch["failed"]) == (2, 1)
    first, bad, third = batch["results"]
    assert first["plan"] == plan_json(device=parse_cpuinfo(SPR_CPUINFO), model=default_model(), priority="fidelity")
    assert bad["plan"] is None and bad["error"]["loc"] == ["body", "devices", 1]
    assert bad["error"]["field"] == "cpuinfo"
    assert third["plan"]["device"]["described_by"] == "nfd"


def test_batch_over_the_schema_limit_of_256_is_422(client):
    response = client.post("/plan/batch", json={"devices": [{"profile": GW17}] * 257})
    assert response.status_code == 422


def test_batch_over_the_configured_limit_is_422_naming_devices():
    with TestClient(create_app(Settings(max_batch_devices=2))) as client:
        response = client.post("/plan/batch", json={"devices": [{"profile": GW17}] * 3})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "devices"]


def test_batch_with_a_bad_model_is_422_for_the_whole_request(client):
    body = {"devices": [{"profile": GW17}], "model": {"config": {"architectures": ["LlamaForCausalLM"]}}}
    response = client.post("/plan/batch", json=body)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "model", "config"]


SPR_BODY = json.dumps({"device": {"cpuinfo": SPR_CPUINFO}}).encode()
JSON = {"Content-Type": "application/json"}


def test_body_one_byte_over_the_limit_is_413():
    with TestClient(create_app(Settings(max_body_bytes=len(SPR_BODY) - 1))) as client:
        response = client.post("/plan", content=SPR_BODY, headers=JSON)
    assert response.status_code == 413


def test_body_exactly_at_the_limit_is_planned():
    with TestClient(create_app(Settings(max_body_bytes=len(SPR_BODY)))) as client:
        response = client.post("/plan", content=SPR_BODY, headers=JSON)
    assert response.status_code == 200


@pytest.fixture
def guarded() -> TestClient:
    with TestClient(create_app(Settings(api_token="s3cret"))) as client:
        yield client


@pytest.mark.parametrize("path", ["/status", "/openapi.json", "/docs", "/v1/models"])
def test_missing_token_is_401(guarded, path):
    response = guarded.get(path)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"


def test_wrong_token_is_401(guarded):
    response = guarded.post("/plan", json={"device": {"profile": GW17}}, headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401


def test_right_token_is_let_through(guarded):
    headers = {"Authorization": "Bearer s3cret"}
    assert guarded.post("/plan", json={"device": {"profile": GW17}}, headers=headers).status_code == 200


def test_openapi_says_which_operations_need_the_token(guarded):
    schema = guarded.get("/openapi.json", headers={"Authorization": "Bearer s3cret"}).json()
    assert schema["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert schema["paths"]["/plan"]["post"]["security"] == [{"bearer": []}]
    assert schema["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]  # Prometheus sends the token
    assert "security" not in schema["paths"]["/healthz"]["get"]


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_health_needs_no_token(guarded, path):
    assert guarded.get(path).status_code == 200


def test_planning_only_server_is_healthy_and_ready(client):
    assert client.get("/healthz").json() == {"status": "ok", "state": None}
    assert client.get("/readyz").status_code == 200


def test_planning_only_status_has_no_engine_and_no_plan(client):
    status = client.get("/status").json()
    assert status["engine"] is None and status["plan"] is None and status["openai_base_url"] is None


def test_planning_only_v1_is_503_with_a_json_message(client):
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 503
    assert "only plans" in response.json()["error"]["message"]


def test_probe_describes_this_host(client):
    profile = client.get("/probe").json()
    assert profile["described_by"] == "probe"
    assert profile["arch"]["value"] in ("x86_64", "aarch64")


def test_get_plan_without_a_plan_in_force_plans_this_host_for_the_default_model(client):
    plan = client.get("/plan", params={"priority": "fidelity"}).json()
    assert plan["device"]["described_by"] == "probe"
    assert plan["model"]["hidden_size"] == 576 and plan["priority"] == "fidelity"


def test_get_plan_returns_the_plan_in_force():
    plan = smollm2_plan()
    with TestClient(create_app(Settings(), plan=plan)) as client:
        assert client.get("/plan").json() == json.loads(plan.model_dump_json())


def test_weight_path_names_the_layout_when_there_is_one():
    plan = smollm2_plan()
    assert weight_path(plan) == "bf16"
    assert weight_path(plan.model_copy(update={"path": "w4a16-tinygemm", "layout": "direct"})) == (
        "w4a16-tinygemm/direct"
    )


def test_openapi_documents_every_request_field(client):
    schema = client.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    for name in ("PlanRequest", "BatchRequest", "CpuinfoDevice", "NfdDevice", "ProfileDevice", "ConfigModel"):
        for field, spec in components[name]["properties"].items():
            assert spec.get("description"), f"{name}.{field} has no description"


def test_the_api_process_never_imports_torch_or_vllm():
    code = "import sys, server.cli, server.app; print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# --- hostile numbers and sizes: 422 naming the field, never 500 --------------------------------------------------


def post_raw(client: TestClient, path: str, body) -> httpx.Response:
    """A body as Python's json writes it, NaN and Infinity included (httpx refuses to send them)."""
    return client.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


SMOLLM2_CONFIG = json.loads((DATA / "configs" / "smollm2-135m-instruct.json").read_text())


@pytest.mark.parametrize(
    ("body", "loc", "field"),
    [
        ({"device": {"profile": {**GW17, "memory_bytes": math.nan}}}, ["body", "device", "profile"],
         "profile.memory_bytes"),
        ({"device": {"profile": {**GW17, "cores": math.inf}}}, ["body", "device", "profile"], "profile.cores"),
        ({"device": {"profile": {**GW17, "memory_bytes": 10**400}}}, ["body", "device", "profile"],
         "profile.memory_bytes"),
        ({"device": {"profile": GW17}, "model": {"config": {**SMOLLM2_CONFIG, "rope_theta": math.inf}}},
         ["body", "model", "config"], "config.rope_theta"),
        ({"device": {"profile": GW17}, "memory_budget": 10**30}, ["body", "memory_budget"], "memory_budget"),
        ({"device": {"lscpu": [{"field": "CPU(s):", "data": math.nan}]}}, ["body", "device", "lscpu"], "lscpu[0].data"),
    ],
    ids=["profile-nan", "profile-inf", "profile-10**400", "config-inf", "budget-10**30", "lscpu-nan"],
)  # fmt: skip
def test_a_non_finite_or_overflowing_number_is_422_naming_the_field(client, body, loc, field):
    response = post_raw(client, "/plan", body)
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert (error["loc"], error["field"]) == (loc, field)


@pytest.mark.parametrize("key", ["max_model_len", "max_num_seqs", "memory_budget"])
@pytest.mark.parametrize("number", [math.nan, math.inf, 1e400], ids=["nan", "inf", "1e400"])
def test_a_non_finite_option_is_422_naming_it_not_a_500(client, key, number):
    response = post_raw(client, "/plan", {"device": {"profile": GW17}, key: number})
    assert response.status_code == 422, response.text
    assert all(error["loc"][:2] == ["body", key] for error in response.json()["detail"])


def test_a_nan_inside_a_union_member_is_422_not_a_500(client):
    """A union's errors carry the whole object each member was offered: with a NaN in it, not printable as JSON."""
    body = {"device": {"profile": GW17}, "model": {"gguf": {"metadata": {}, "tensors": [
        {"name": "output.weight", "type": "Q6_K", "shape": [math.nan, 576]}]}}}  # fmt: skip
    assert post_raw(client, "/plan", body).status_code == 422


def test_a_million_layers_is_422_naming_num_hidden_layers(client):
    body = {"device": {"profile": GW17}, "model": {"config": {**SMOLLM2_CONFIG, "num_hidden_layers": 10**6}}}
    response = client.post("/plan", json=body)
    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert error["field"] == "config.json: num_hidden_layers" and "at most 1024" in error["msg"]


def test_a_gguf_header_of_a_million_blocks_is_422_naming_num_hidden_layers(client):
    metadata = {"general.architecture": "llama", "llama.block_count": 10**6, "llama.context_length": 8192,
                "llama.embedding_length": 576, "llama.feed_forward_length": 1536, "llama.attention.head_count": 9,
                "llama.vocab_size": 49152}  # fmt: skip
    response = client.post("/plan", json={"device": {"profile": GW17}, "model": {"gguf": {"metadata": metadata}}})
    assert response.status_code == 422
    assert response.json()["detail"][0]["field"] == "config.json: num_hidden_layers"


def test_a_batch_plans_the_good_devices_when_one_has_a_nan(client):
    devices = [{"profile": GW17}, {"profile": {**GW17, "memory_bytes": math.nan}}, {"cpuinfo": SPR_CPUINFO}]
    response = post_raw(client, "/plan/batch", {"devices": devices})
    assert response.status_code == 200, response.text
    batch = response.json()
    assert (batch["planned"], batch["failed"]) == (2, 1)
    assert batch["results"][1]["error"]["loc"] == ["body", "devices", 1]
    assert batch["results"][1]["error"]["field"] == "profile.memory_bytes"


def test_a_batch_device_of_no_known_shape_is_its_own_error_not_the_whole_batchs(client):
    devices = [{"profile": GW17}, {"cpuinfo": 3}, {"cpuinfo": SPR_CPUINFO, "nfd_labels": SPR_NODE}]
    response = client.post("/plan/batch", json={"devices": devices})
    assert response.status_code == 200, response.text
    batch = response.json()
    assert (batch["planned"], batch["failed"]) == (1, 2)
    assert batch["results"][1]["error"]["loc"][:3] == ["body", "devices", 1]
    assert batch["results"][2]["error"]["loc"][:3] == ["body", "devices", 2]
    assert batch["results"][0]["plan"]["device"]["name"] == GW17["name"]


def test_a_batch_device_with_too_many_nfd_labels_is_its_own_error(client):
    labels = {f"feature.node.kubernetes.io/custom-{i}": "true" for i in range(1100)}
    response = client.post("/plan/batch", json={"devices": [{"profile": GW17}, {"nfd_labels": {"labels": labels}}]})
    assert response.status_code == 200, response.text
    assert response.json()["results"][1]["error"]["field"] == "labels"


def test_post_plan_takes_the_serving_mode_and_the_plan_names_it(client):
    body = {"device": {"cpuinfo": SPR_CPUINFO}}
    assert client.post("/plan", json=body).json()["vllm"]["mode"] == "two-process"
    three = client.post("/plan", json={**body, "serving_mode": "three-process"}).json()
    assert three["vllm"]["mode"] == "three-process" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in three["vllm"]["env"]
    one = client.post("/plan", json={**body, "serving_mode": "one-process"}).json()
    assert one["vllm"]["mode"] == "one-process" and one["vllm"]["env"]["EDGE_ENGINE_CORE_START"] == "thread"
    bad = client.post("/plan", json={**body, "serving_mode": "four-process"})
    assert bad.status_code == 422 and "serving_mode" in bad.text


def test_post_plan_takes_the_engines_threads_and_refuses_what_it_cannot_take(client):
    body = {"device": {"cpuinfo": SPR_CPUINFO}}
    assert client.post("/plan", json={**body, "threads": 2}).json()["vllm"]["env"]["OMP_NUM_THREADS"] == "2"
    for bad in ({"threads": 0}, {"threads": 4096}, {"threads": 2, "serving_mode": "three-process"}):
        response = client.post("/plan", json={**body, **bad})
        assert response.status_code == 422 and "threads" in response.text, bad
