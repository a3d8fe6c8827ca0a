"""Liveness after readiness: an engine that stops answering is marked unresponsive, taken out of /readyz, and
restarted, with the reason recorded. Run against the STAND-IN engine's hangs (tests/server/standin_engine.py):
SIGSTOP (a stopped process), SIGUSR1 (nothing answered), SIGUSR2 (completions not answered, /health still is)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from server.app import create_app
from server.supervisor.supervisor import EngineSupervisor
from tests.server.conftest import eventually, fast_settings, smollm2_plan, standin, uvicorn_on_loopback

MODEL_DIR = "/models/SmolLM2-135M-Instruct"
# Probes every 0.1 s, 0.3 s to answer, 3 in a row: an unresponsive stand-in is found within about a second.
FAST_LIVENESS = dict(liveness_interval_s=0.1, liveness_timeout_s=0.3, liveness_failures=3)
NO_GENERATION_PROBE = dict(liveness_generation_interval_s=0)


def supervisor_for(*flags: str, **settings) -> EngineSupervisor:
    return EngineSupervisor.for_plan(
        smollm2_plan(), MODEL_DIR, settings=fast_settings(**settings), executable=standin(*flags)
    )


@pytest.mark.anyio
async def test_engine_that_stops_answering_health_is_unresponsive_then_restarted():
    """SIGUSR1: the stand-in answers nothing more and computes nothing (a deadlock): its probes fail."""
    supervisor = supervisor_for(**FAST_LIVENESS, **NO_GENERATION_PROBE)
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        hung = supervisor.engine_pid
        os.kill(hung, signal.SIGUSR1)
        await eventually(lambda: supervisor.state == "unresponsive")
        assert not supervisor.is_ready
        await eventually(lambda: supervisor.restarts == 1 and supervisor.state == "ready")
        status = supervisor.status()
        assert status.engine_pid != hung and status.restart_reasons == {"unresponsive": 1}
        assert status.last_error.startswith("unresponsive: 3 liveness probes failed in a row")
        assert "GET /health did not answer within 0.3 s" in status.last_error
        assert supervisor.probes_failed["health"] >= 3 and status.probe_failures == 0
    finally:
        await supervisor.stop()


@pytest.mark.anyio
async def test_a_stopped_engine_is_seen_stopped_in_proc_and_restarted_without_waiting_for_probes_to_time_out():
    supervisor = supervisor_for(**FAST_LIVENESS, **NO_GENERATION_PROBE)
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        hung = supervisor.engine_pid
        os.kill(hung, signal.SIGSTOP)
        await eventually(lambda: supervisor.state == "unresponsive")
        await eventually(lambda: supervisor.restarts == 1 and supervisor.state == "ready")
        status = supervisor.status()
        assert status.engine_pid != hung and status.restart_reasons == {"unresponsive": 1}
        assert status.last_error.startswith(f"unresponsive: engine process {hung} is stopped (state T) at 2 probes")
        assert supervisor.probes_failed["stopped"] == 2 and supervisor.probes_failed["health"] == 0
    finally:
        await supervisor.stop()


@pytest.mark.anyio
async def test_a_busy_engine_slow_to_answer_is_not_taken_for_a_wedged_one_until_liveness_busy_s():
    """/health takes 0.6 s of computing to answer, the probes wait 0.3 s: they time out, but the engine used
    CPU meanwhile, so none is a failure; only after liveness_busy_s of that is it unresponsive all the same."""
    supervisor = supervisor_for("--busy-health", "0.6", **FAST_LIVENESS, **NO_GENERATION_PROBE, liveness_busy_s=4.0)
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        await eventually(lambda: supervisor.probes_busy >= 3)
        assert supervisor.state == "ready" and supervisor.probe_failures == 0 and not supervisor.probes_failed
        await eventually(lambda: supervisor.restarts == 1)
        assert supervisor.restart_reasons == {"unresponsive": 1} and supervisor.probes_failed["health"] == 3
        assert "did not answer within 0.3 s" in supervisor.status().last_error
    finally:
        await supervisor.stop()


@pytest.mark.anyio
async def test_wedged_generation_behind_a_live_health_is_found_by_the_idle_generation_probe():
    supervisor = supervisor_for(
        **FAST_LIVENESS,
        liveness_idle_s=0,
        liveness_generation_interval_s=0.1,
        liveness_generation_timeout_s=0.3,
    )
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        os.kill(supervisor.engine_pid, signal.SIGUSR2)  # completions hang; /health still answers 200
        await eventually(lambda: supervisor.restarts == 1)
        assert supervisor.restart_reasons == {"unresponsive": 1}
        assert "a one-token generation did not finish within 0.3 s" in supervisor.last_error
        assert supervisor.probes_failed["generation"] >= 3
    finally:
        await supervisor.stop()


@pytest.mark.anyio
async def test_idle_engine_gets_a_one_token_generation_probe_and_stays_ready():
    supervisor = supervisor_for(**FAST_LIVENESS, liveness_idle_s=0, liveness_generation_interval_s=0.1)
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        await eventually(lambda: any("POST /v1/completions" in line for line in supervisor.log_tail))
        assert supervisor.state == "ready" and supervisor.restarts == 0 and not supervisor.probes_failed
    finally:
        await supervisor.stop()


@pytest.mark.anyio
async def test_no_generation_probe_while_requests_are_being_answered():
    """Answered traffic proves the engine generates: no generation probe while it is not idle."""
    supervisor = supervisor_for(**FAST_LIVENESS, liveness_idle_s=3600, liveness_generation_interval_s=0.1)
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        os.kill(supervisor.engine_pid, signal.SIGUSR2)
        deadline = time.monotonic() + 1.0  # ten probe intervals
        while time.monotonic() < deadline:
            supervisor.note_traffic()
            await asyncio.sleep(0.05)
            assert supervisor.state == "ready"
        assert not supervisor.probes_failed
    finally:
        await supervisor.stop()


@pytest.mark.anyio
async def test_probe_failures_must_come_in_a_row():
    """An engine seen stopped at one probe and continued before the next is not a hung one: the count starts
    again (probes every 0.5 s, so the test continues it well before the next)."""
    supervisor = supervisor_for(liveness_interval_s=0.5, liveness_timeout_s=0.3, liveness_failures=2,
                                **NO_GENERATION_PROBE)  # fmt: skip
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        for seen in range(1, 4):  # seen stopped at one probe each time, then continued before the next
            os.kill(supervisor.engine_pid, signal.SIGSTOP)
            await eventually(lambda: supervisor.probes_failed["stopped"] == seen)  # noqa: B023
            os.kill(supervisor.engine_pid, signal.SIGCONT)
            answered = supervisor.probes_answered
            await eventually(lambda: supervisor.probes_answered > answered)  # noqa: B023
        assert supervisor.state == "ready" and supervisor.restarts == 0
    finally:
        await supervisor.stop()


def test_readyz_is_503_while_unresponsive_and_200_once_restarted_and_serving():
    plan = smollm2_plan()
    settings = fast_settings(**FAST_LIVENESS, **NO_GENERATION_PROBE)
    supervisor = EngineSupervisor.for_plan(plan, MODEL_DIR, settings=settings,
                                           executable=standin())  # fmt: skip
    app = create_app(settings, supervisor=supervisor, plan=plan, model_dir=MODEL_DIR)
    seen_states = set()

    def readyz(url: str) -> int:
        response = httpx.get(f"{url}/readyz")
        seen_states.add((response.status_code, response.json()["state"]))
        return response.status_code

    with uvicorn_on_loopback(app) as url:
        _wait(lambda: readyz(url) == 200)
        os.kill(supervisor.engine_pid, signal.SIGSTOP)
        _wait(lambda: readyz(url) == 503)
        _wait(lambda: readyz(url) == 200)
        engine = httpx.get(f"{url}/status").json()["engine"]
        completion = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        metrics = httpx.get(f"{url}/metrics").text
    assert (503, "unresponsive") in seen_states or (503, "crashed") in seen_states
    assert engine["restarts"] == 1 and engine["restart_reasons"] == {"unresponsive": 1}
    assert engine["last_error"].startswith("unresponsive:")
    assert completion.status_code == 200
    assert 'edge_engine_restarts_total{reason="unresponsive"} 1.0' in metrics


def _wait(predicate, guard_s: float = 30.0) -> None:
    """Hang guard only, not a speed requirement."""
    deadline = time.monotonic() + guard_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached before the hang guard"
        time.sleep(0.02)


def serving_app(*flags: str, **settings):
    """uvicorn + the app + a supervisor of the stand-in; returns (the server's context, the supervisor)."""
    plan = smollm2_plan()
    settings = fast_settings(**settings)
    supervisor = EngineSupervisor.for_plan(plan, MODEL_DIR, settings=settings, executable=standin(*flags))
    app = create_app(settings, supervisor=supervisor, plan=plan, model_dir=MODEL_DIR)
    return uvicorn_on_loopback(app), supervisor


# Never idle (an hour): only what the forwarded requests show can bring on the generation probe.
BUSY = dict(liveness_idle_s=3600, liveness_generation_interval_s=0.1, liveness_generation_timeout_s=0.3)


@pytest.mark.parametrize(
    "flags, wedge",
    [((), signal.SIGUSR2), (("--fail-completions",), None)],
    ids=["timeouts", "server-errors"],
)
def test_failing_requests_cannot_hide_a_wedged_engine_from_its_liveness_probes(flags, wedge):
    """Requests keep arriving, and every one fails (a wedged engine core: it takes them and never answers; or it
    answers 500): they are failed probes, not traffic that proves the engine generates, and it is restarted."""
    server, supervisor = serving_app(*flags, **FAST_LIVENESS, **BUSY, proxy_timeout_s=0.3)
    with server as url:
        _wait(lambda: supervisor.is_ready)
        if wedge:
            os.kill(supervisor.engine_pid, wedge)
        answers = set()

        def failing_requests_restart_it() -> bool:
            status = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code
            answers.add((status, supervisor.restarts))
            return supervisor.restarts >= 1

        _wait(failing_requests_restart_it)
        assert supervisor.restart_reasons["unresponsive"] >= 1 and supervisor.probes_failed["traffic"] >= 1
        # No request was answered by the wedged engine (none counted as traffic); one sent as it was found
        # unresponsive waited for the restart and was answered by the next engine.
        assert {status for status, restarts in answers if status < 500} <= {200}
        assert all(restarts >= 1 for status, restarts in answers if status == 200)
        assert {status for status, _ in answers if status >= 500} <= {500, 502, 504}


def test_a_wedged_engine_core_behind_a_live_health_is_found_by_the_requests_waiting_on_it():
    """SIGUSR2: completions are taken and never answered, /health still is (a deadlocked engine core behind vLLM's
    live API server, as in two-process mode), and the generation probe is off: a request waiting with no byte for
    liveness_stall_s while the engine uses no CPU is a failed probe, two in a row and it is restarted, long before
    the proxy's read timeout."""
    server, supervisor = serving_app(**NO_GENERATION_PROBE, proxy_timeout_s=600)
    with server as url:
        _wait(lambda: supervisor.is_ready)
        os.kill(supervisor.engine_pid, signal.SIGUSR2)
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=120)
        _wait(lambda: supervisor.restarts == 1 and supervisor.is_ready)
        status = supervisor.status()
    assert answer.status_code == 502 and "not sent again" in answer.json()["error"]["message"]
    assert status.restart_reasons == {"unresponsive": 1} and supervisor.probes_failed["stall"] == 2
    assert "forwarded requests waited" in status.last_error and supervisor.probes_failed["health"] == 0


@pytest.mark.anyio
async def test_failed_probes_of_an_engine_whose_process_is_gone_are_an_exit_even_when_its_watchdog_is_slow():
    """Killed, the engine fails its probes and requests at once, and its watchdog may take seconds (freeing a dead
    engine core's memory on a busy box) to end the rest and exit: that is reported as an exit, not a wedge. An
    engine process still there is unresponsive at once. (A stand-in `exited` task; real processes for the engine.)"""
    supervisor = supervisor_for(**FAST_LIVENESS, **NO_GENERATION_PROBE)
    supervisor.probe_failures = 3
    gone = await asyncio.create_subprocess_exec("true")
    await gone.wait()  # reaped: no such process now
    slow_exit = asyncio.create_task(asyncio.sleep(1.5))  # the watchdog's exit, later than EXIT_GRACE_S
    started = time.monotonic()
    assert await supervisor._unless_gone(slow_exit, gone.pid, "GET /health failed: ReadError") is None
    assert slow_exit.done() and 1.0 < time.monotonic() - started < 5.0

    alive = await asyncio.create_subprocess_exec("sleep", "30")
    try:
        never = asyncio.create_task(asyncio.sleep(30))
        started = time.monotonic()
        last = "GET /health did not answer within 0.3 s"
        why = await supervisor._unless_gone(never, alive.pid, last)
        assert why == f"unresponsive: 3 liveness probes failed in a row, the last: {last}"
        assert time.monotonic() - started < 1.0
        never.cancel()
    finally:
        alive.kill()
        await alive.wait()
