"""One-process serving: vLLM's OpenAI server with its engine core in a thread of the API server's process.

vLLM 0.28's OpenAI server runs `AsyncLLM`, and `AsyncLLM` always starts its engine core in another process
(`EngineCoreClient.make_client`: "Running EngineCore in asyncio without multiprocessing is not currently supported";
`AsyncLLM.__init__` calls `make_async_mp_client` directly). That process imports torch and vLLM a second time
(or shares the API server's pages copy-on-write after a fork), and every step's outputs cross ZMQ as msgpack.

Asked for by EDGE_ENGINE_CORE_START=thread (edge/plan/engine_config.py, serving mode `one-process`), the plugin replaces
`make_async_mp_client` with `ThreadEngineClient`: vLLM's own `EngineCore` (the class its offline `LLM` runs
in-process through `InprocClient`, and `EngineCoreProc` extends) built and stepped in one thread of this process.
Requests reach it through a queue; its outputs come back to the event loop through `call_soon_threadsafe`. Everything
above the client (AsyncLLM's output processor, detokenizer, the OpenAI serving classes, the HTTP server) is vLLM's.

The GIL: the thread holds it only for vLLM's per-step Python (scheduler, input preparation, sampler bookkeeping);
torch ops and the project's kernels release it, and then the event loop serves HTTP and detokenizes. So a step's
outputs are handed to the event loop when the next step's forward starts (EDGE_HOLD_OUTPUTS, on unless "0"), not as
the step ends: the event loop's work on them then overlaps the forward, which holds no GIL, instead of taking the GIL
from the next step's scheduling and input preparation. The last step's outputs go at once. The engine's
OpenMP threads are this thread's team (OMP_NUM_THREADS); the event loop's thread computes nothing parallel.

Failure domain: the engine and the API server are one process, so a crash of either ends both; edge-serve's wrapper,
a separate process, is what stays up, sees the engine's /health fail or its process end, and starts it again. An
exception in the engine thread marks the engine dead (AsyncLLM's `errored`, /health 503) and fails every request.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any

from kernels.vllm_plugin import heap_trim

ENV = "EDGE_ENGINE_CORE_START"
THREAD = "thread"
HOLD_ENV = "EDGE_HOLD_OUTPUTS"  # "0": each step's outputs go to the event loop as the step ends
logger = logging.getLogger("vllm.edge_select.engine_thread")
_MARK = "_edge_select_engine_thread"
_STOP = object()
# How long shutdown waits for the engine thread's current step, and for AsyncLLM's output handler to take the error
STOP_WAIT_S = 5.0


class _Resources:
    """What AsyncLLM reads of its client's background resources: whether the engine is dead."""

    engine_dead: bool = False


class ThreadEngineClient:
    """An asyncio engine-core client (the interface of vLLM's AsyncMPClient, as AsyncLLM uses it) over an
    EngineCore stepped in a thread of this process."""

    def __init__(self, vllm_config: Any, executor_class: Any, log_stats: bool, client_addresses: Any = None,
                 client_count: int = 1, client_index: int = 0) -> None:
        if vllm_config.parallel_config.data_parallel_size > 1:
            raise ValueError("one-process serving runs one engine: data_parallel_size must be 1")
        self.resources = _Resources()
        self.engine_ranks_managed = [0]
        self._inputs: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = None
        self._pending: list[Any] = []  # outputs made before the event loop was known
        self._held: list[Any] = []  # this step's outputs, delivered when the next forward starts (HOLD_ENV)
        self._loop_thread: int | None = None
        self._handler_failed = threading.Event()
        self._lock = threading.Lock()
        self._core: Any = None
        started: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(vllm_config, executor_class, log_stats, started),
                                        name="EdgeEngineCore", daemon=True)
        self._thread.start()
        started.result()  # the core's init error, if any, raised here as vLLM's own startup raises it

    # ---- the engine thread ----
    def _run(self, vllm_config: Any, executor_class: Any, log_stats: bool, started: Future) -> None:
        from vllm.v1.engine.core import EngineCore

        serving, startup = _thread_counts()
        try:
            if startup != serving:
                _set_threads(startup)  # the event loop only waits meanwhile
            core = EngineCore(vllm_config, executor_class, log_stats)
            if startup != serving:
                _set_threads(serving)
        except BaseException as e:  # noqa: BLE001 - handed to the starting thread, which raises it
            started.set_exception(e)
            return
        self._core = core
        started.set_result(None)
        logger.info("engine core runs in thread %r of the API server's process (pid %d): %d threads to start, %d to "
                    "serve", threading.current_thread().name, os.getpid(), startup, serving)
        idle = heap_trim.IdleTrim()
        hold = _hold_outputs() and self._hand_over_in_forward(core)
        try:
            while True:
                # Wait for work when there is none; take every queued input before the next step.
                item = self._wait_for_input(idle) if not core.scheduler.has_requests() else self._next_input()
                while item is not None:
                    if item is _STOP:
                        return
                    self._handle(core, item)
                    item = self._next_input()
                if not core.scheduler.has_requests():
                    continue
                outputs, executed = core.step_fn()
                self._flush_held()  # a step that ran no forward: its predecessor's outputs go now, in order
                for out in outputs.values() if outputs else ():
                    if hold:
                        self._held.append(out)
                    else:
                        self._deliver(out)
                if not core.scheduler.has_requests():
                    self._flush_held()  # no next forward to hand them over in
                core.post_step(executed)
                idle.worked()
        except BaseException as e:  # noqa: BLE001 - the engine is dead: every request and /health learn it
            logger.exception("engine core thread failed")
            self._flush_held()
            self.resources.engine_dead = True
            self._deliver(e)
        finally:
            self._fail_inputs()

    def _hand_over_in_forward(self, core: Any) -> bool:
        """Deliver a step's outputs when the next step's forward starts (HOLD_ENV): the forward runs in C++ without
        the GIL, so the event loop's work on them (detokenizing, the streamed chunk) overlaps it instead of taking
        the GIL from the next step's scheduling and input preparation. False where the runner cannot be reached."""
        runner = getattr(getattr(getattr(getattr(core, "model_executor", None), "driver_worker", None), "worker", None),
                         "model_runner", None)  # fmt: skip
        forward = getattr(runner, "_model_forward", None)
        if forward is None:
            logger.warning("%s: the model runner's _model_forward is not reachable; outputs go after each step",
                           HOLD_ENV)
            return False

        def _model_forward(*args: Any, **kwargs: Any) -> Any:
            self._flush_held()
            return forward(*args, **kwargs)

        runner._model_forward = _model_forward
        return True

    def _flush_held(self) -> None:
        if self._held:
            held, self._held = self._held, []
            for out in held:
                self._deliver(out)

    def _wait_for_input(self, idle: heap_trim.IdleTrim) -> Any:
        """The next input, however long it takes; past idle.timeout() without one, the heap is trimmed first
        (heap_trim: what serving left in the allocator's arenas goes back while the box is idle)."""
        timeout = idle.timeout()
        if timeout is not None:
            try:
                return self._inputs.get(timeout=timeout)
            except queue.Empty:
                idle.trim()
        return self._inputs.get()

    def _next_input(self) -> Any:
        try:
            return self._inputs.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, core: Any, item: tuple) -> None:
        kind, payload, future = item
        if kind == "add":
            core.add_request(*core.preprocess_add_request(payload))
        elif kind == "abort":
            core.abort_requests(payload)
        else:  # a utility: (method name, args); its result or error goes to the caller's future
            name, args = payload
            try:
                future.set_result(getattr(core, name)(*args))
            except Exception as e:  # noqa: BLE001 - the caller's error, not the engine's
                future.set_exception(e)

    def _fail_inputs(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        while (item := self._next_input()) is not None:
            if item is not _STOP and item[2] is not None and not item[2].done():
                item[2].set_exception(EngineDeadError())

    def _deliver(self, out: Any) -> None:
        with self._lock:
            if self._loop is None:
                self._pending.append(out)
                return
            loop, outputs = self._loop, self._outputs
        with contextlib.suppress(RuntimeError):  # the event loop is closed: the server is shutting down
            loop.call_soon_threadsafe(outputs.put_nowait, out)

    # ---- the event loop's side ----
    def _bind_loop(self) -> None:
        if self._loop is not None:
            return
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
            self._outputs = asyncio.Queue()
            for out in self._pending:
                self._outputs.put_nowait(out)
            self._pending.clear()

    def _check_alive(self) -> None:
        if self.resources.engine_dead or not self._thread.is_alive():
            from vllm.v1.engine.exceptions import EngineDeadError

            self.resources.engine_dead = True
            raise EngineDeadError()

    async def get_output_async(self) -> Any:
        self._bind_loop()
        assert self._outputs is not None
        out = await self._outputs.get()
        if isinstance(out, BaseException):
            from vllm.v1.engine.exceptions import EngineDeadError

            self._handler_failed.set()  # AsyncLLM's output handler now hands the error to every request
            raise EngineDeadError() from out
        return out

    async def add_request_async(self, request: Any) -> None:
        self._bind_loop()
        self._check_alive()
        self._inputs.put(("add", request, None))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead:
            self._inputs.put(("abort", request_ids, None))

    async def _call(self, name: str, *args: Any) -> Any:
        self._bind_loop()
        self._check_alive()
        future: Future = Future()
        self._inputs.put(("call", (name, args), future))
        return await asyncio.wrap_future(future)

    async def get_supported_tasks_async(self) -> Any:
        return self._core.get_supported_tasks()  # fixed once the core is built

    async def profile_async(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        await self._call("profile", is_start, profile_prefix)

    async def reset_mm_cache_async(self) -> None:
        await self._call("reset_mm_cache")

    async def reset_prefix_cache_async(self, reset_running_requests: bool = False,
                                       reset_connector: bool = False) -> bool:
        return await self._call("reset_prefix_cache", reset_running_requests, reset_connector)

    async def reset_encoder_cache_async(self) -> None:
        await self._call("reset_encoder_cache")

    async def pause_scheduler_async(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("pausing the scheduler is not supported in one-process serving")

    async def resume_scheduler_async(self) -> None:
        await self._call("resume_scheduler")

    async def is_scheduler_paused_async(self) -> bool:
        return await self._call("is_scheduler_paused")

    async def sleep_async(self, level: int = 1, mode: str = "abort") -> None:
        raise NotImplementedError("sleep mode is not supported in one-process serving")

    async def wake_up_async(self, tags: list[str] | None = None) -> None:
        await self._call("wake_up", tags)

    async def is_sleeping_async(self) -> bool:
        return await self._call("is_sleeping")

    async def execute_dummy_batch_async(self) -> None:
        await self._call("execute_dummy_batch")

    async def set_weight_version_async(self, weight_version: str) -> None:
        await self._call("set_weight_version", weight_version)

    async def get_weight_version_async(self) -> str:
        return await self._call("get_weight_version")

    async def add_lora_async(self, lora_request: Any) -> bool:
        return await self._call("add_lora", lora_request)

    async def remove_lora_async(self, lora_id: int) -> bool:
        return await self._call("remove_lora", lora_id)

    async def list_loras_async(self) -> set[int]:
        return await self._call("list_loras")

    async def pin_lora_async(self, lora_id: int) -> bool:
        return await self._call("pin_lora", lora_id)

    async def save_sharded_state_async(self, path: str, pattern: str | None = None,
                                       max_size: int | None = None) -> None:
        await self._call("save_sharded_state", path, pattern, max_size)

    async def collective_rpc_async(self, method: Any, timeout: float | None = None, args: tuple = (),
                                   kwargs: dict[str, Any] | None = None) -> list[Any]:
        return await self._call("collective_rpc", method, timeout, args, kwargs)

    def dp_engines_running(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine thread after its current step, end every request in flight with EngineDeadError (as a
        dead engine process does through vLLM's MP client; otherwise each open stream waits for tokens that never
        come and the server's graceful shutdown with it), then release the core. vLLM's launcher calls this from an
        executor thread and cancels AsyncLLM's output handler right after, so it waits until the handler has taken
        the error. In-flight requests are aborted whatever `timeout` says: there is no drain in one-process mode."""
        if self._thread.is_alive():
            self._inputs.put(_STOP)
            self._thread.join(STOP_WAIT_S)
        self._fail_in_flight()
        if self._thread.is_alive():  # a step that does not end: the process is on its way out anyway (daemon)
            logger.warning("engine core thread still running %.0f s after it was told to stop", STOP_WAIT_S)
        elif self._core is not None:
            self._core.shutdown()
            self._core = None

    def _fail_in_flight(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed() or threading.get_ident() == self._loop_thread:
            return  # no request ever came, or called on the event loop itself, which cannot wait for itself
        from vllm.v1.engine.exceptions import EngineDeadError

        self._deliver(EngineDeadError("the API server is shutting down"))
        self._handler_failed.wait(STOP_WAIT_S)


def _hold_outputs() -> bool:
    return os.environ.get(HOLD_ENV, "1") != "0"


def _thread_counts() -> tuple[int, int]:
    """The engine thread's OpenMP threads to serve on (OMP_NUM_THREADS) and to start on: while it loads, repacks
    and warms up, the event loop only waits, so it starts on every CPU this process may use, as a forked two-process
    core does (kernels/vllm_plugin/engine_start.py; EDGE_ENGINE_STARTUP_THREADS=1 turns it off)."""
    import torch

    from kernels.vllm_plugin.engine_start import engine_threads_from_env, startup_threads

    serving = engine_threads_from_env() or torch.get_num_threads()
    return serving, startup_threads(serving)


# torch.set_num_threads, bound by install() before vLLM's CPU worker replaces it with a no-op (cpu_worker.py)
_torch_set_threads: Any = None


def _set_threads(threads: int) -> None:
    """This thread's OpenMP team size: omp_set_num_threads is a per-thread setting, so the engine thread's count
    leaves the event loop's alone."""
    import torch

    (_torch_set_threads or torch.set_num_threads)(threads)


def install() -> bool:
    """Route AsyncLLM's engine-core client to ThreadEngineClient when EDGE_ENGINE_CORE_START=thread; True if
    installed (once per process)."""
    if os.environ.get(ENV) != THREAD:
        return False
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        logger.warning("%s=thread ignored: the engine in a thread runs the model itself, which vLLM's CPU platform "
                       "allows only with VLLM_ENABLE_V1_MULTIPROCESSING=0", ENV)
        return False
    from vllm.v1.engine import async_llm

    client = async_llm.EngineCoreClient
    if getattr(client.make_async_mp_client, _MARK, False):
        return False

    def make_async_mp_client(vllm_config: Any, executor_class: Any, log_stats: bool, client_addresses: Any = None,
                             client_count: int = 1, client_index: int = 0) -> ThreadEngineClient:
        return ThreadEngineClient(vllm_config, executor_class, log_stats, client_addresses, client_count,
                                  client_index)

    setattr(make_async_mp_client, _MARK, True)
    client.make_async_mp_client = staticmethod(make_async_mp_client)
    global _torch_set_threads
    import torch

    _torch_set_threads = torch.set_num_threads
    # At exit the interpreter's last cyclic collection walks the engine's whole object graph (the model, its compiled
    # graphs): 2.5-4 s of every stop (py-spy: gc_collect_main in finalization, 2026-12-03), time in which a restart
    # waits and the watchdog's grace runs out. atexit runs before it (registered first, it runs last): the objects
    # left are then not collected, which the exit makes moot; vLLM's and logging's own exit handlers have run.
    atexit.register(gc.freeze)
    return True
