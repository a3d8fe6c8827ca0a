"""Only the wrapper talks to the engine: `/v1/*` alone is forwarded, with the engine's own key (fresh for each
start, in its environment, never its argv), over a Unix socket made afresh for each start in a directory only this
user may enter, and checked to be the engine's (SO_PEERCRED); the engine holds no TCP port; the API process's
secrets stay out of the engine's environment. Run against the STAND-IN engine, which guards /v1 with VLLM_API_KEY
and binds --uds as vLLM does."""

from __future__ import annotations

import http.client
import os
import signal
import time
from urllib.parse import urlsplit

import httpx
import pytest

from server.app import create_app
from server.proxy import UnsafePath, engine_path
from server.supervisor import EngineSupervisor
from tests.server.conftest import (
    engine_request,
    eventually,
    fast_settings,
    smollm2_plan,
    standin,
    uvicorn_on_loopback,
)

MODEL_DIR = "/models/SmolLM2-135M-Instruct"
TOKEN = "s3cret"


def raw_get(url: str, target: str) -> tuple[int, bytes]:
    """GET with the request target sent exactly as written (httpx would resolve its dot segments first)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("GET", target, headers={"Authorization": f"Bearer {TOKEN}"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def wait_until(predicate, guard_s: float = 30.0) -> None:
    """Hang guard only, not a speed requirement."""
    deadline = time.monotonic() + guard_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached before the hang guard"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def served():
    """uvicorn + the app + the stand-in; yields (url, supervisor)."""
    plan = smollm2_plan()
    settings = fast_settings(api_token=TOKEN, log_tail_lines=100_000)  # every line the engine logs, for sent_to_engine
    supervisor = EngineSupervisor.for_plan(plan, MODEL_DIR, settings=settings, executable=standin())
    with uvicorn_on_loopback(create_app(settings, supervisor=supervisor, plan=plan, model_dir=MODEL_DIR)) as url:
        wait_until(lambda: httpx.get(f"{url}/readyz").status_code == 200)
        yield url, supervisor


def sent_to_engine(supervisor: EngineSupervisor, request) -> list[str]:
    """The engine's log lines for the requests it received while `request()` ran, its liveness probes aside."""
    before = len(supervisor.log_tail)
    request()
    return [line for line in list(supervisor.log_tail)[before:] if "GET /health auth=none" not in line]


@pytest.mark.parametrize(
    ("target", "why"),
    [(t, b"dot segment") for t in ("/v1/../metrics", "/v1/%2e%2e/metrics", "/v1/%2E%2e/tokenize", "/v1/..%2fdocs",
                                   "/v1/models/../../health", "/v1/./models", "/v1/.%2E/.%2e/metrics")]
    + [(t, b"control character") for t in ("/v1/models%0d%0aX-Injected:%20yes", "/v1/%00", "/v1/models%7f")],
)  # fmt: skip
def test_a_dot_segment_or_a_control_character_never_reaches_the_engine_and_is_a_400(served, target, why):
    url, supervisor = served
    answers = []
    assert sent_to_engine(supervisor, lambda: answers.append(raw_get(url, target))) == []
    status, body = answers[0]
    assert status == 400 and why in body


def test_a_forwarded_path_reaches_the_engine_as_sent(served):
    url, supervisor = served
    answers = []
    seen = sent_to_engine(supervisor, lambda: answers.append(raw_get(url, "/v1/models?limit=1")))
    assert answers[0][0] == 200 and len(seen) == 1 and "GET /v1/models?limit=1 auth=engine-key" in seen[0]


def test_an_encoded_question_mark_stays_part_of_the_path():
    assert engine_path("models%3F?x") == "models%253F%3Fx"  # a literal % and ? the client encoded stay encoded


def test_a_dot_segment_is_refused_however_it_ends():
    for path in ("..", "a/..", "a/./b", "."):
        with pytest.raises(UnsafePath, match="dot segment"):
            engine_path(path)
    assert engine_path("a/...b/c.d") == "a/...b/c.d"  # dots inside a segment are a name, not a dot segment


def test_the_engine_refuses_v1_without_its_key_and_the_wrapper_adds_it(served):
    url, supervisor = served
    assert engine_request(supervisor, "GET", "/v1/models").status_code == 401
    assert engine_request(supervisor, "GET", "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}
                          ).status_code == 401  # fmt: skip
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


@pytest.mark.anyio
async def test_each_start_gets_a_fresh_socket_and_a_fresh_key_kept_out_of_its_argv():
    supervisor = EngineSupervisor.for_plan(smollm2_plan(), MODEL_DIR, settings=fast_settings(), executable=standin())
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        first = (supervisor.socket_path, supervisor.api_key, supervisor.engine_pid)
        with open(f"/proc/{first[2]}/cmdline", "rb") as f:
            assert first[1].encode() not in f.read()
        os.kill(supervisor.pid, signal.SIGKILL)
        await eventually(lambda: supervisor.restarts == 1 and supervisor.is_ready)
        assert supervisor.socket_path != first[0] and supervisor.api_key != first[1]
        assert not first[0].exists()  # the dead engine's socket is gone with it
        assert engine_request(supervisor, "GET", "/v1/models", headers={"Authorization": f"Bearer {first[1]}"}
                              ).status_code == 401  # fmt: skip
    finally:
        await supervisor.stop()
    assert not supervisor.socket_path.exists()  # and so is the last one's, once stopped


@pytest.mark.anyio
async def test_the_api_processes_secrets_never_reach_the_engines_environment(monkeypatch):
    secrets = {
        "EDGE_API_TOKEN": "api-secret",
        "EDGE_REPORT_TOKEN": "report-secret",
        "EDGE_CALIBRATION_DB": "postgresql://edge:db-secret@db:5432/edge",
        "VLLM_API_KEY": "inherited",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    supervisor = EngineSupervisor.for_plan(smollm2_plan(), MODEL_DIR, settings=fast_settings(), executable=standin())
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        with open(f"/proc/{supervisor.engine_pid}/environ", "rb") as f:
            environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if item)
    finally:
        await supervisor.stop()
    assert not {b"EDGE_API_TOKEN", b"EDGE_REPORT_TOKEN", b"EDGE_CALIBRATION_DB"} & set(environ)
    assert environ[b"VLLM_API_KEY"] == supervisor.api_key.encode() != b"inherited"
    assert environ[b"EDGE_TEST_MARKER"] == b"from-plan"  # the plan's environment does reach it
