"""The wrapper serving an engine, over real HTTP: uvicorn on loopback, the STAND-IN engine as its child."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from server.app import create_app
from server.proxy import WEIGHT_PATH_HEADER
from server.supervisor.processes import group_members
from server.supervisor.supervisor import EngineSupervisor
from tests.server.conftest import engine_request, fast_settings, smollm2_plan, standin, uvicorn_on_loopback

TOKEN = {"Authorization": "Bearer s3cret"}
MODEL_DIR = "/models/SmolLM2-135M-Instruct"
SHORT_NAME = smollm2_plan().model.name  # the model's source directory: SmolLM2-135M-Instruct-bf16


def serving(*flags: str, **settings):
    """uvicorn + the app + a supervisor running the stand-in with these flags; yields (url, supervisor)."""
    plan = smollm2_plan()
    settings = fast_settings(api_token="s3cret", **settings)
    supervisor = EngineSupervisor.for_plan(
        plan, MODEL_DIR, settings=settings, executable=standin(*flags)
    )
    return uvicorn_on_loopback(create_app(settings, supervisor=supervisor, plan=plan, model_dir=MODEL_DIR)), supervisor


def wait_until(predicate, timeout: float = 30.0) -> None:
    """Hang guard only, not a speed requirement."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached before the hang guard"
        time.sleep(0.02)


def ready(url: str) -> bool:
    return httpx.get(f"{url}/readyz").status_code == 200


def test_engine_not_ready_means_readyz_503_and_v1_503_with_a_json_message():
    """With no wait for the engine (restart_wait_s 0), a request that meets it starting is refused at once."""
    server, supervisor = serving("--ready-after", "600", restart_wait_s=0)
    with server as url:
        wait_until(lambda: supervisor.pid is not None)
        readyz = httpx.get(f"{url}/readyz")
        assert readyz.status_code == 503 and readyz.json()["state"] == "starting"
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=TOKEN)
        metrics = httpx.get(f"{url}/metrics", headers=TOKEN).text
    assert response.status_code == 503 and int(response.headers["Retry-After"]) >= 1
    assert response.json()["error"]["message"].startswith("engine is not ready (state: starting)")
    assert response.headers[WEIGHT_PATH_HEADER] == "bf16"
    assert 'edge_engine_requests_refused_total{reason="deadline"} 1.0' in metrics


def metric(url: str, series: str) -> float:
    """One series' value from the wrapper's /metrics."""
    for line in httpx.get(f"{url}/metrics", headers=TOKEN).text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in /metrics")


def test_a_request_sent_while_the_engine_starts_waits_for_it_and_is_served():
    server, supervisor = serving("--ready-after", "1.5")
    with server as url:
        wait_until(lambda: supervisor.pid is not None)
        assert not supervisor.is_ready
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=TOKEN,
                              timeout=30)  # fmt: skip
        served = metric(url, "edge_engine_requests_served_after_wait_total")
        waited = metric(url, "edge_engine_requests_waited_total")
    assert response.status_code == 200 and response.json()["choices"][0]["text"]
    assert waited == 1 and served == 1


def test_a_wait_ends_at_the_clients_own_bound_with_503_and_retry_after_and_a_bad_bound_is_named():
    server, supervisor = serving("--ready-after", "600")
    with server as url:
        wait_until(lambda: supervisor.pid is not None)
        started = time.monotonic()
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=30,
                              headers={**TOKEN, "X-Edge-Max-Wait": "0.3"})  # fmt: skip
        waited_s = time.monotonic() - started
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers={**TOKEN, "X-Edge-Max-Wait": "soon"})
        refused = metric(url, 'edge_engine_requests_refused_total{reason="deadline"}')
    assert response.status_code == 503 and int(response.headers["Retry-After"]) >= 1
    assert "did not become ready while the request waited" in response.json()["error"]["message"]
    assert waited_s >= 0.3 and refused == 1
    assert bad.status_code == 400 and "X-Edge-Max-Wait: 'soon'" in bad.json()["error"]["message"]


def test_requests_past_the_waiting_bound_are_refused_at_once_and_a_client_that_leaves_stops_waiting():
    server, supervisor = serving("--ready-after", "600", restart_queue=1)
    with server as url:
        wait_until(lambda: supervisor.pid is not None)
        body = {"prompt": "hi"}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # it waits, and gives up after 1 s of its own
            first = pool.submit(httpx.post, f"{url}/v1/completions", json=body, headers=TOKEN, timeout=1.0)
            wait_until(lambda: metric(url, "edge_engine_requests_waiting") == 1)
            second = httpx.post(f"{url}/v1/completions", json=body, headers=TOKEN)
            with pytest.raises(httpx.ReadTimeout):
                first.result()
        wait_until(lambda: metric(url, "edge_engine_requests_abandoned_total") == 1)
        waiting = metric(url, "edge_engine_requests_waiting")
        refused = metric(url, 'edge_engine_requests_refused_total{reason="queue_full"}')
    assert second.status_code == 503 and "1 requests already wait for it" in second.json()["error"]["message"]
    assert refused == 1 and waiting == 0


@pytest.mark.parametrize("killed", ["engine_pid", "pid"], ids=["engine", "its-watchdog"])
def test_requests_sent_after_the_engine_is_killed_wait_for_its_restart_and_are_all_served(killed):
    """The restart takes longer than RESEND_UNSENT_S: a request the dying engine refused keeps waiting. The watchdog
    killed takes the engine down with it (its parent-death signal): the same."""
    server, supervisor = serving("--ready-after", "2.5")
    body = {"prompt": "after the crash", "max_tokens": 1}
    with server as url:
        wait_until(lambda: ready(url))
        os.kill(getattr(supervisor, killed), signal.SIGKILL)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(
                lambda _: httpx.post(f"{url}/v1/completions", json=body, headers=TOKEN, timeout=30), range(6)))
        waited = metric(url, "edge_engine_requests_waited_total")
        served = metric(url, "edge_engine_requests_served_after_wait_total")
    assert [answer.status_code for answer in answers] == [200] * 6
    assert supervisor.restarts == 1 and waited >= 1 and served == waited


def test_a_request_in_flight_when_the_engine_dies_gets_a_502_naming_it_and_is_not_sent_again():
    """SIGUSR2: the stand-in takes completions and never answers them; killed then, the request it held ends
    with 502, and the restarted engine never sees it."""
    server, supervisor = serving()
    with server as url:
        wait_until(lambda: ready(url))
        os.kill(supervisor.engine_pid, signal.SIGUSR2)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, f"{url}/v1/completions", json={"prompt": "held", "max_tokens": 1},
                               headers=TOKEN, timeout=30)  # fmt: skip
            time.sleep(0.5)
            os.kill(supervisor.engine_pid, signal.SIGKILL)
            answer = held.result()
        wait_until(lambda: ready(url))
        seen = engine_request(supervisor, "GET", "/health")  # the new engine's log is what it saw
    assert answer.status_code == 502 and answer.json()["error"]["type"] == "engine_error"
    assert "the engine stopped before it answered" in answer.json()["error"]["message"]
    assert "not sent again" in answer.json()["error"]["message"]
    assert seen.status_code == 200
    assert not any("POST /v1/completions" in line for line in list(supervisor.log_tail)[-5:] if "held" in line)


def test_completion_through_the_wrapper_carries_the_weight_path_header():
    server, supervisor = serving()
    with server as url:
        wait_until(lambda: ready(url))
        body = {"model": MODEL_DIR, "prompt": "The capital of France is", "max_tokens": 4}
        response = httpx.post(f"{url}/v1/completions", json=body, headers=TOKEN)
        direct = engine_request(supervisor, "POST", "/v1/completions", json=body, headers=supervisor.engine_headers)
    assert response.status_code == 200
    assert response.headers[WEIGHT_PATH_HEADER] == "bf16"
    assert response.json() == direct.json()


def test_query_string_and_engine_errors_pass_through_unchanged():
    server, supervisor = serving()
    with server as url:
        wait_until(lambda: ready(url))
        models = httpx.get(f"{url}/v1/models?limit=1", headers=TOKEN)
        missing = httpx.get(f"{url}/v1/no-such-route", headers=TOKEN)
    assert [card["id"] for card in models.json()["data"]] == [SHORT_NAME, MODEL_DIR]
    assert missing.status_code == 404 and missing.headers[WEIGHT_PATH_HEADER] == "bf16"


def test_the_engine_gets_its_own_key_never_the_wrappers_token():
    server, _ = serving()
    with server as url:
        wait_until(lambda: ready(url))
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=TOKEN)
    assert response.status_code == 200
    assert response.headers["X-Standin-Saw-Authorization"] == "engine-key"


def test_v1_needs_the_token():
    server, _ = serving()
    with server as url:
        wait_until(lambda: ready(url))
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}).status_code == 401


def test_streamed_completion_arrives_event_by_event_not_buffered():
    """The stand-in holds its stream after the first event until released: a buffering proxy would hang."""
    server, supervisor = serving("--hold-stream")
    body = {"prompt": "stream me", "max_tokens": 3, "stream": True}
    with server as url:
        wait_until(lambda: ready(url))
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=TOKEN, timeout=30) as response:
            assert response.headers[WEIGHT_PATH_HEADER] == "bf16"
            assert response.headers["content-type"].startswith("text/event-stream")
            names = header_names(response)
            assert names.count("date") == 1 and names.count("server") == 1 and names.count("transfer-encoding") == 1
            lines = response.iter_lines()
            first = next(lines)  # arrives while the engine is still holding the rest
            assert first.startswith("data: ") and json.loads(first[6:])["choices"][0]["text"]
            engine_request(supervisor, "POST", "/standin/release")
            events = [line for line in lines if line.startswith("data: ")]
    assert len(events) == 3 and events[-1] == "data: [DONE]"


def test_status_names_the_plan_engine_and_openai_url():
    server, supervisor = serving()
    with server as url:
        wait_until(lambda: ready(url))
        status = httpx.get(f"{url}/status", headers=TOKEN).json()
        assert supervisor.socket_path.is_socket()
    assert status["weight_path"] == "bf16" and status["plan"]["path"] == "bf16"
    assert status["engine"]["state"] == "ready" and status["engine"]["restarts"] == 0
    assert status["engine"]["pid"] > 0 and status["engine"]["uptime_s"] >= 0
    assert status["openai_base_url"].endswith("/v1") and status["model_dir"] == MODEL_DIR
    assert status["engine"]["served_model_name"] == SHORT_NAME == "SmolLM2-135M-Instruct-bf16"
    assert status["engine"]["engine_pid"] > 0 and status["engine"]["engine_pid"] != status["engine"]["pid"]
    # Where the engine listens: its socket in the run directory, and the URL requests to it name
    assert status["engine"]["engine_socket"] == str(supervisor.socket_path)
    assert status["engine"]["engine_url"] == "http://localhost"


def test_clients_name_the_model_by_its_short_name_or_by_its_path():
    server, _ = serving()
    with server as url:
        wait_until(lambda: ready(url))
        answers = {
            model: httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1},
                              headers=TOKEN)  # fmt: skip
            for model in (SHORT_NAME, MODEL_DIR, "no-such-model")
        }
    assert answers[SHORT_NAME].status_code == 200 and answers[SHORT_NAME].json()["model"] == SHORT_NAME
    assert answers[MODEL_DIR].status_code == 200
    assert answers["no-such-model"].status_code == 404


def test_the_served_model_name_can_be_set():
    server, supervisor = serving(served_model_name="smollm2")
    with server as url:
        wait_until(lambda: ready(url))
        models = httpx.get(f"{url}/v1/models", headers=TOKEN).json()
    assert [card["id"] for card in models["data"]] == ["smollm2", MODEL_DIR]
    assert supervisor.status().served_model_name == "smollm2"


def header_names(response: httpx.Response) -> list[str]:
    return [name.lower() for name, _ in response.headers.multi_items()]


def test_proxied_responses_have_one_date_one_server_and_no_hop_by_hop_headers():
    """The stand-in sends its own Date and Server (http.server does), Keep-Alive, and a header its Connection
    header names: RFC 9110 7.6.1 says the last three stop at the proxy; uvicorn writes Date and Server."""
    server, supervisor = serving()
    with server as url:
        wait_until(lambda: ready(url))
        direct = engine_request(supervisor, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                                headers=supervisor.engine_headers)  # fmt: skip
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=TOKEN)
    assert {"date", "server", "keep-alive", "x-standin-hop"} <= set(header_names(direct))  # what the engine sent
    names = header_names(response)
    assert names.count("date") == 1 and names.count("server") == 1
    assert "keep-alive" not in names and "x-standin-hop" not in names
    assert response.headers.get("connection", "keep-alive") == "keep-alive"  # uvicorn's own, not the engine's
    assert names.count(WEIGHT_PATH_HEADER.lower()) == 1 and response.headers[WEIGHT_PATH_HEADER] == "bf16"
    assert response.headers["content-type"] == "application/json"


def test_killed_engine_shows_in_status_and_comes_back():
    server, supervisor = serving()
    with server as url:
        wait_until(lambda: ready(url))
        os.kill(supervisor.pid, signal.SIGKILL)
        wait_until(lambda: httpx.get(f"{url}/status", headers=TOKEN).json()["engine"]["restarts"] == 1)
        wait_until(lambda: ready(url))
        engine = httpx.get(f"{url}/status", headers=TOKEN).json()["engine"]
        completion = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=TOKEN)
    assert engine["state"] == "ready" and "SIGKILL" in engine["last_error"]
    assert completion.status_code == 200


def test_chunked_body_over_the_limit_is_413():
    server, _ = serving(max_body_bytes=1000)

    def chunks():
        for _ in range(10):
            yield b"x" * 200

    with server as url:
        response = httpx.post(f"{url}/plan", content=chunks(), headers={**TOKEN, "Content-Type": "application/json"})
    assert response.status_code == 413


def test_shutting_the_server_down_stops_the_engine_group():
    server, supervisor = serving("--spawn-worker")
    with server as url:
        wait_until(lambda: ready(url))
        leader = supervisor.pid
    assert supervisor.state == "stopped"
    assert group_members(leader) == []


def test_planning_other_devices_does_not_change_the_plan_in_force():
    server, _ = serving()
    with server as url:
        wait_until(lambda: ready(url))
        before = httpx.get(f"{url}/status", headers=TOKEN).json()["plan"]
        other = {"device": {"profile": {"arch": "aarch64", "isa": ["asimd"], "memory": "4GiB"}}}
        assert httpx.post(f"{url}/plan", json=other, headers=TOKEN).status_code == 200
        assert httpx.post(f"{url}/plan", json={"device": {"cpuinfo": "x"}}, headers=TOKEN).status_code == 422
        assert httpx.get(f"{url}/plan", headers=TOKEN).json() == before
        assert httpx.get(f"{url}/status", headers=TOKEN).json()["plan"] == before


def test_an_engine_that_dies_mid_stream_ends_the_stream_with_an_error_event():
    """The stand-in holds its stream after the first event; killed then, it never finishes: the client reads an
    error event, not an answer that merely looks short."""
    server, supervisor = serving("--hold-stream")
    body = {"prompt": "stream me", "max_tokens": 3, "stream": True}
    with server as url:
        wait_until(lambda: ready(url))
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=TOKEN, timeout=30) as response:
            lines = response.iter_lines()
            assert json.loads(next(lines)[6:])["choices"][0]["text"]
            os.kill(supervisor.engine_pid, signal.SIGKILL)
            events = [line for line in lines if line.startswith("data: ")]
    assert events and "data: [DONE]" not in events
    error = json.loads(events[-1][6:])["error"]
    assert error["type"] == "engine_error" and "broke off" in error["message"]


def test_a_flood_of_held_streams_takes_no_more_engine_connections_than_the_pool_and_metrics_still_answer():
    """Two streams the engine holds fill a pool of two: a third request waits for a connection, then gets 503
    (the wrapper's load, not a failed probe of the engine); /metrics reads the engine's series on its own client."""
    server, supervisor = serving("--hold-stream", proxy_max_connections=2, proxy_pool_timeout_s=0.2)
    body = {"prompt": "stream me", "max_tokens": 2, "stream": True}
    with server as url:
        wait_until(lambda: ready(url))
        with httpx.Client(headers=TOKEN, timeout=30) as client:
            held = [client.stream("POST", f"{url}/v1/completions", json=body) for _ in range(2)]
            streams = [hold.__enter__() for hold in held]
            try:
                lines = [stream.iter_lines() for stream in streams]  # kept: a dropped iterator closes its stream
                for line in lines:
                    assert next(line).startswith("data: ")  # each holds a connection to the engine
                third = httpx.post(f"{url}/v1/models", headers=TOKEN, timeout=30)
                metrics = httpx.get(f"{url}/metrics", headers=TOKEN, timeout=30).text
            finally:
                engine_request(supervisor, "POST", "/standin/release")
                for hold in held:
                    hold.__exit__(None, None, None)
        after = httpx.get(f"{url}/v1/models", headers=TOKEN)
    assert third.status_code == 503 and third.json()["error"]["message"] == "engine did not answer: PoolTimeout"
    assert "vllm:num_requests_running" in metrics and "edge_engine_metrics_up 1.0" in metrics
    assert supervisor.probes_failed["traffic"] == 0 and after.status_code == 200


def test_vllms_500_for_a_dead_engine_core_is_a_502_naming_it_and_other_500s_pass_through_unchanged():
    dead_server, _ = serving("--dead-completions")
    with dead_server as url:
        wait_until(lambda: ready(url))
        dead = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=TOKEN)
    failing_server, _ = serving("--fail-completions")
    with failing_server as url:
        wait_until(lambda: ready(url))
        failing = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=TOKEN)
    assert dead.status_code == 502 and dead.json()["error"]["type"] == "engine_error"
    assert "the engine stopped before it answered (it answered 500: EngineCore encountered" in dead.text
    assert failing.status_code == 500
    assert failing.json() == {"error": {"message": "stand-in: --fail-completions", "type": "InternalServerError"}}
    assert failing.headers[WEIGHT_PATH_HEADER] == "bf16"
    assert int(failing.headers["content-length"]) == len(failing.content)


def test_a_request_that_meets_the_engine_stopped_waits_for_its_restart_instead_of_hanging_in_it():
    server, supervisor = serving()
    with server as url:
        wait_until(lambda: ready(url))
        stopped = supervisor.engine_pid
        os.kill(stopped, signal.SIGSTOP)
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=TOKEN, timeout=30)
        engine = httpx.get(f"{url}/status", headers=TOKEN).json()["engine"]
    assert answer.status_code == 200
    assert engine["restart_reasons"] == {"unresponsive": 1} and engine["engine_pid"] != stopped
