"""kernels/vllm_plugin/engine_thread.py: one-process serving's engine-core client.

The client's own logic (the queue into the engine thread, outputs back to the event loop, a dead engine, utilities,
shutdown) runs here against a stand-in for vLLM's EngineCore, named as such. The real EngineCore in a thread, behind
vLLM's real OpenAI server, is served by the slow tests (tests/server), whose plan is one-process on a 1-2 core box.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.engine import core as vllm_core  # noqa: E402
from vllm.v1.engine.exceptions import EngineDeadError  # noqa: E402

from kernels.vllm_plugin import engine_thread  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


class StandInCore:
    """A stand-in for vLLM's EngineCore: each request yields one output per step, `steps` steps long."""

    def __init__(self, vllm_config, executor_class, log_stats) -> None:
        if vllm_config.fail_init:
            raise RuntimeError("the model did not load")
        self.config = vllm_config
        self.left: dict[str, int] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.stepped_on: set[str] = set()
        self.shut = False
        self.scheduler = SimpleNamespace(has_requests=lambda: bool(self.left))

    def preprocess_add_request(self, request):
        return request, 0

    def add_request(self, request, wave):
        self.left[request] = self.config.steps

    def abort_requests(self, ids):
        self.aborted += ids
        for i in ids:
            self.left.pop(i, None)

    def step_fn(self):
        self.steps += 1
        self.stepped_on.add(threading.current_thread().name)
        if self.steps == self.config.fail_at_step:
            raise RuntimeError("a kernel failed")
        out = []
        for rid in list(self.left):
            self.left[rid] -= 1
            out.append((rid, self.left[rid]))
            if not self.left[rid]:
                del self.left[rid]
        return {0: out}, True

    def post_step(self, model_executed):
        pass

    def get_supported_tasks(self):
        return ("generate",)

    def reset_prefix_cache(self, reset_running_requests, reset_connector):
        return (reset_running_requests, reset_connector)

    def is_sleeping(self):
        raise ValueError("asked of a core that cannot say")

    def shutdown(self):
        self.shut = True


def config(steps: int = 3, fail_at_step: int | None = None, fail_init: bool = False, dp: int = 1):
    return SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp), steps=steps,
                           fail_at_step=fail_at_step, fail_init=fail_init)  # fmt: skip


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(vllm_core, "EngineCore", StandInCore)


async def collect(client, count: int, timeout_s: float = 10) -> list:
    got = []
    while len(got) < count:
        got += (await asyncio.wait_for(client.get_output_async(), timeout_s))
    return got


def test_requests_are_stepped_in_the_engine_thread_and_their_outputs_come_back_in_order(stand_in):
    client = engine_thread.ThreadEngineClient(config(steps=3), None, False)

    async def run():
        await client.add_request_async("a")
        await client.add_request_async("b")
        return await collect(client, 6)

    try:
        got = asyncio.run(run())
    finally:
        client.shutdown()
    assert [left for rid, left in got if rid == "a"] == [2, 1, 0]
    assert [left for rid, left in got if rid == "b"] == [2, 1, 0]
    assert client._core is None and client.resources.engine_dead is False
    assert not client._thread.is_alive()


def test_an_idle_engine_waits_instead_of_stepping(stand_in):
    client = engine_thread.ThreadEngineClient(config(steps=2), None, False)
    core = client._core

    async def run():
        await client.add_request_async("a")
        await collect(client, 2)
        await asyncio.sleep(0.3)

    try:
        asyncio.run(run())
        assert core.steps == 2 and core.stepped_on == {"EdgeEngineCore"}
    finally:
        client.shutdown()
    assert core.shut


def test_an_abort_reaches_the_core(stand_in):
    client = engine_thread.ThreadEngineClient(config(steps=10**6), None, False)
    core = client._core

    async def run():
        await client.add_request_async("long")
        await collect(client, 3)
        await client.abort_requests_async(["long"])
        for _ in range(100):
            if not core.left:
                return
            await asyncio.sleep(0.05)

    try:
        asyncio.run(run())
    finally:
        client.shutdown()
    assert core.aborted == ["long"] and not core.left


def test_a_failing_step_marks_the_engine_dead_and_fails_what_comes_next(stand_in):
    client = engine_thread.ThreadEngineClient(config(steps=5, fail_at_step=2), None, False)

    async def run():
        await client.add_request_async("a")
        first = await client.get_output_async()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(client.get_output_async(), 10)
        with pytest.raises(EngineDeadError):
            await client.add_request_async("b")
        with pytest.raises(EngineDeadError):
            await client.reset_prefix_cache_async()
        return first

    try:
        assert asyncio.run(run()) == [("a", 4)]
    finally:
        client.shutdown()
    assert client.resources.engine_dead


def test_shutdown_ends_the_requests_in_flight_before_the_handler_is_cancelled(stand_in):
    """vLLM's launcher calls shutdown from an executor thread, then cancels AsyncLLM's output handler: a stream still
    open must get an error first, or it waits for tokens that never come (and the server's graceful exit with it)."""
    client = engine_thread.ThreadEngineClient(config(steps=10**6), None, False)
    core = client._core

    async def run():
        failed: list[BaseException] = []

        async def output_handler():  # a stand-in for AsyncLLM's: outputs to requests, an error to every one
            try:
                while True:
                    await client.get_output_async()
            except Exception as e:  # noqa: BLE001
                failed.append(e)

        handler = asyncio.create_task(output_handler())
        await client.add_request_async("open stream")
        await asyncio.sleep(0.2)
        started = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, client.shutdown, 0)
        took = time.monotonic() - started
        handler.cancel()
        return failed, took

    failed, took = asyncio.run(run())
    assert len(failed) == 1 and isinstance(failed[0], EngineDeadError)
    assert took < engine_thread.STOP_WAIT_S and not client._thread.is_alive() and core.shut


def test_an_engine_that_fails_to_start_raises_its_error_to_the_server(stand_in):
    with pytest.raises(RuntimeError, match="did not load"):
        engine_thread.ThreadEngineClient(config(fail_init=True), None, False)


def test_one_process_refuses_data_parallel(stand_in):
    with pytest.raises(ValueError, match="data_parallel_size"):
        engine_thread.ThreadEngineClient(config(dp=2), None, False)


def test_utilities_run_in_the_engine_thread_and_their_errors_are_the_callers(stand_in):
    client = engine_thread.ThreadEngineClient(config(), None, False)

    async def run():
        reset = await client.reset_prefix_cache_async(True, False)
        with pytest.raises(ValueError, match="cannot say"):
            await client.is_sleeping_async()
        tasks = await client.get_supported_tasks_async()
        await client.add_request_async("after")
        return reset, tasks, await collect(client, 3)

    try:
        reset, tasks, after = asyncio.run(run())
    finally:
        client.shutdown()
    assert reset == (True, False) and tasks == ("generate",) and after[-1] == ("after", 0)
    assert not client.resources.engine_dead


PROBE = """
import json
from vllm.v1.engine import async_llm
from kernels.vllm_plugin import engine_thread
before = async_llm.EngineCoreClient.make_async_mp_client
installed, again = engine_thread.install(), engine_thread.install()
after = async_llm.EngineCoreClient.make_async_mp_client
print(json.dumps({"installed": installed, "again": again, "replaced": after is not before,
                  "ours": getattr(after, "_edge_select_engine_thread", False)}))
"""


@pytest.mark.parametrize(
    ("env", "installed"),
    [
        ({"EDGE_ENGINE_CORE_START": "thread", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, True),
        ({"EDGE_ENGINE_CORE_START": "thread"}, False),  # vLLM's platform would turn the executor into mp
        ({"EDGE_ENGINE_CORE_START": "fork", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, False),  # two-process
        ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, False),
    ],
)
def test_the_client_is_routed_only_in_one_process_mode(env, installed):
    import os

    mode_vars = ("EDGE_ENGINE_CORE_START", "VLLM_ENABLE_V1_MULTIPROCESSING")
    base = {k: v for k, v in os.environ.items() if k not in mode_vars}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**base, **env}, capture_output=True, text=True,
                          timeout=300, check=True)  # fmt: skip
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"installed": installed, "again": False, "replaced": installed, "ours": installed}


class StandInRunner:
    """A stand-in for vLLM's model runner: only the `_model_forward` the client hooks."""

    def __init__(self, core) -> None:
        self.core = core

    def _model_forward(self):
        self.core.events.append(("forward", self.core.steps, len(self.core.delivered)))


class StandInCoreWithRunner(StandInCore):
    """The stand-in core, reaching its runner as vLLM's EngineCore does (model_executor.driver_worker.worker);
    each step records what the event loop had been handed when it scheduled and when its forward started."""

    def __init__(self, vllm_config, executor_class, log_stats) -> None:
        super().__init__(vllm_config, executor_class, log_stats)
        self.events: list[tuple[str, int, int]] = []
        self.delivered: list = []
        runner = StandInRunner(self)
        worker = SimpleNamespace(model_runner=runner)
        self.model_executor = SimpleNamespace(driver_worker=SimpleNamespace(worker=worker))
        self.runner = runner

    def step_fn(self):
        self.events.append(("schedule", self.steps + 1, len(self.delivered)))
        self.runner._model_forward()  # looked up on the instance, as vLLM's execute_model calls it
        return super().step_fn()


@pytest.mark.parametrize("hold", ["1", "0"])
def test_a_steps_outputs_reach_the_event_loop_when_the_next_forward_starts(monkeypatch, hold):
    """EDGE_HOLD_OUTPUTS (default on): step N's outputs are handed over as step N+1's forward starts, so the event
    loop's work on them overlaps the forward, not the next step's scheduling; the last step's go at once; order
    kept. With "0", each step's outputs go as it ends."""
    monkeypatch.setattr(vllm_core, "EngineCore", StandInCoreWithRunner)
    monkeypatch.setenv(engine_thread.HOLD_ENV, hold)
    client = engine_thread.ThreadEngineClient(config(steps=3), None, False)
    core = client._core
    deliver = client._deliver

    def recorded(out):
        core.delivered.append(out)
        deliver(out)

    client._deliver = recorded

    async def run():
        await client.add_request_async("a")
        return await collect(client, 3)

    try:
        got = asyncio.run(run())
    finally:
        client.shutdown()
    assert [left for _, left in got] == [2, 1, 0]
    if hold == "1":
        # step 2 schedules with step 1's output still held; its forward starts with it handed over
        assert core.events == [("schedule", 1, 0), ("forward", 0, 0), ("schedule", 2, 0), ("forward", 1, 1),
                               ("schedule", 3, 1), ("forward", 2, 2)]
    else:
        assert core.events == [("schedule", 1, 0), ("forward", 0, 0), ("schedule", 2, 1), ("forward", 1, 1),
                               ("schedule", 3, 2), ("forward", 2, 2)]
    assert len(core.delivered) == 3  # the last step's output too, with no next forward to wait for
