"""/metrics: the wrapper's series in Prometheus text format, the engine's (the STAND-IN's, like vLLM's) appended."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import schemathesis
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from server.app import create_app
from server.metrics import CONTENT_TYPE
from server.settings import Settings
from server.supervisor.supervisor import EngineSupervisor
from tests.server.conftest import fast_settings, smollm2_plan, standin, uvicorn_on_loopback

DATA = Path(__file__).parents[1] / "edge" / "data"
GW17 = json.loads((DATA / "device_gw17.json").read_text())
MODEL_DIR = "/models/SmolLM2-135M-Instruct"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of an exposition, parsed by prometheus-client's own parser."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def declared_types(text: str) -> list[str]:
    return [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]


@pytest.fixture
def client() -> TestClient:
    with TestClient(create_app(Settings())) as client:
        yield client


def test_plans_served_and_their_latency_are_counted_by_endpoint(client):
    for _ in range(2):
        assert client.post("/plan", json={"device": {"profile": GW17}}).status_code == 200
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"] == CONTENT_TYPE
    found = samples(response.text)
    assert found[("edge_plans_served_total", (("endpoint", "POST /plan"),))] == 2
    assert found[("edge_plan_request_duration_seconds_count", (("endpoint", "POST /plan"),))] == 2
    assert found[("edge_plan_request_duration_seconds_sum", (("endpoint", "POST /plan"),))] > 0
    assert found[("edge_plan_request_duration_seconds_bucket", (("endpoint", "POST /plan"), ("le", "+Inf")))] == 2


def test_planning_errors_are_counted_by_kind(client):
    assert client.post("/plan", json={"device": {"cpuinfo": "x"}}).status_code == 422  # the planner refused it
    assert client.post("/plan", json={"device": {"nonsense": 1}}).status_code == 422  # the schema refused it
    assert client.post("/plan", content=b"{", headers={"Content-Type": "application/json"}).status_code == 422
    found = samples(client.get("/metrics").text)
    kinds = {labels[0][1]: value for (name, labels), value in found.items() if name == "edge_planning_errors_total"}
    assert kinds == {"input": 1, "request": 2, "store": 0, "internal": 0}
    assert ("edge_plans_served_total", (("endpoint", "POST /plan"),)) not in found


def test_a_batch_counts_each_device_planned_and_each_refused(client):
    devices = [{"profile": GW17}, {"cpuinfo": "x"}, {"profile": GW17}]
    assert client.post("/plan/batch", json={"devices": devices}).json()["planned"] == 2
    found = samples(client.get("/metrics").text)
    assert found[("edge_plans_served_total", (("endpoint", "POST /plan/batch"),))] == 2
    assert found[("edge_plan_request_duration_seconds_count", (("endpoint", "POST /plan/batch"),))] == 1
    assert found[("edge_planning_errors_total", (("kind", "input"),))] == 1


def test_errors_outside_planning_are_not_planning_errors(client):
    assert client.post("/calibrations", json={"nonsense": 1}).status_code == 422
    found = samples(client.get("/metrics").text)
    assert sum(value for (name, _), value in found.items() if name == "edge_planning_errors_total") == 0


def test_a_planning_only_server_has_no_engine_series(client):
    text = client.get("/metrics").text
    assert "edge_engine" not in text and "vllm:" not in text


def test_metrics_need_the_token_when_one_is_set():
    with TestClient(create_app(Settings(api_token="s3cret"))) as guarded:
        assert guarded.get("/metrics").status_code == 401
        assert guarded.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_metrics_are_in_the_openapi_schema_as_text_and_conform_to_it():
    app = create_app(Settings())
    with TestClient(app) as client:
        operation = client.get("/openapi.json").json()["paths"]["/metrics"]["get"]
    assert "text/plain" in operation["responses"]["200"]["content"]
    schema = schemathesis.openapi.from_asgi("/openapi.json", app).include(path_regex="^/metrics$")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert [(op.method.upper(), op.path) for op in operations] == [("GET", "/metrics")]
    case = operations[0].Case()
    case.call_and_validate()  # status, content type and schema as documented


def test_engine_state_restarts_and_readiness_with_the_engines_own_metrics_appended():
    plan = smollm2_plan()
    settings = fast_settings()
    supervisor = EngineSupervisor.for_plan(plan, MODEL_DIR, settings=settings,
                                           executable=standin())  # fmt: skip
    with uvicorn_on_loopback(create_app(settings, supervisor=supervisor, plan=plan, model_dir=MODEL_DIR)) as url:
        _wait(lambda: httpx.get(f"{url}/readyz").status_code == 200)
        before = time.time()
        os.kill(supervisor.engine_pid, signal.SIGKILL)
        _wait(lambda: supervisor.restarts == 1 and supervisor.is_ready)
        text = httpx.get(f"{url}/metrics").text
    found = samples(text)
    assert found[("edge_engine_state", (("state", "ready"),))] == 1
    assert sum(value for (name, _), value in found.items() if name == "edge_engine_state") == 1
    assert found[("edge_engine_restarts_total", (("reason", "exited"),))] == 1
    assert found[("edge_engine_restarts_total", (("reason", "unresponsive"),))] == 0
    assert found[("edge_engine_last_ready_timestamp_seconds", ())] >= before
    info = (("served_model_name", "SmolLM2-135M-Instruct-bf16"), ("weight_path", "bf16"))
    assert found[("edge_engine_info", info)] == 1
    assert found[("edge_engine_metrics_up", ())] == 1
    assert found[("vllm:num_requests_running", (("model_name", "SmolLM2-135M-Instruct-bf16"),))] == 0
    types = declared_types(text)
    assert len(types) == len(set(types)), "a metric family declared twice: the two expositions collide"
    assert text.index("edge_engine_state") < text.index("vllm:num_requests_running")


def test_engine_metrics_are_left_out_while_the_engine_is_not_ready():
    plan = smollm2_plan()
    settings = fast_settings()
    supervisor = EngineSupervisor.for_plan(plan, MODEL_DIR, settings=settings,
                                           executable=standin("--ready-after", "600"))  # fmt: skip
    with uvicorn_on_loopback(create_app(settings, supervisor=supervisor, plan=plan, model_dir=MODEL_DIR)) as url:
        _wait(lambda: supervisor.pid is not None)
        found = samples(httpx.get(f"{url}/metrics").text)
    assert found[("edge_engine_state", (("state", "starting"),))] == 1
    assert found[("edge_engine_metrics_up", ())] == 0
    assert ("edge_engine_last_ready_timestamp_seconds", ()) not in found
    assert not any(name.startswith("vllm:") for name, _ in found)


def _wait(predicate, guard_s: float = 30.0) -> None:
    """Hang guard only, not a speed requirement."""
    deadline = time.monotonic() + guard_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached before the hang guard"
        time.sleep(0.02)
