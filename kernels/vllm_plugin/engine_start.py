"""Start a two-process engine's core by fork, not spawn: it then inherits the API server's imports (torch, vLLM,
this plugin) instead of importing them again, about 9 s of each start on a 2-core box (benchmarks/edge_up_times.py).

vLLM 0.28's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn unconditionally in
`CpuPlatform.check_and_update_config` (platforms/cpu.py), for its `mp` executor's workers, which bind OpenMP threads
to cores and must not inherit a parent's OpenMP state. In two-process mode there is no such worker: the engine core
runs the model itself (uni executor) with the thread count the plan gives it (OMP_NUM_THREADS,
edge/plan/engine_config.py). vLLM's default start method elsewhere is fork, and its engine core is built to be forked
from the API server.

Asked for by EDGE_ENGINE_CORE_START=fork (edge/plan/engine_config.py sets it for every two-process engine); without it
this changes nothing. After the platform's check, the wrapper puts `fork` back; vLLM's own reasons to force spawn
(`_maybe_force_spawn`: CUDA or XPU initialized, Ray, WSL, --numa-bind) still override it when the core starts.

OpenMP threads and fork: libgomp's thread pool does not survive a fork. A team the API server has started by the
time it forks exists in the child only as bookkeeping, and the forked core then hangs for good in its first parallel
region (seen 2026-12-02, OMP_NUM_THREADS=2: CpuGpuBuffer's torch.zeros in the model runner's init). So for an engine
of N > 1 threads the API server computes on one thread, which starts no team, and the forked child takes its N back
(`hold_threads_for_fork`). The API server's own torch work is tokenization-side and light.

Startup threads: while the core loads and repacks weights, loads the compile cache and runs vLLM's warm-up, the API
server only waits, so the core starts on every CPU this process may use (affinity and cgroup quota) and drops to
its serving count when its busy loop begins, as vLLM does for its GPU workers (`startup_omp_num_threads`, then
`set_torch_threads_for_runtime`).
EDGE_ENGINE_STARTUP_THREADS=N sets that count (1: start on the serving count).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

ENV = "EDGE_ENGINE_CORE_START"
STARTUP_THREADS_ENV = "EDGE_ENGINE_STARTUP_THREADS"
# under vLLM's logger, whose handler is the one a vLLM process has (a logger outside it prints no INFO)
logger = logging.getLogger("vllm.edge_select.engine_start")
_MARK = "_edge_select_engine_start"


def engine_threads_from_env() -> int | None:
    """OMP_NUM_THREADS as a thread count, or None where it is unset or not a positive integer."""
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return threads if threads >= 1 else None


def startup_threads(threads: int) -> int:
    """The forked core's threads until it serves: EDGE_ENGINE_STARTUP_THREADS, else every CPU this process may use
    (its affinity capped by its cgroup's CPU quota, as vLLM counts them: a container's quota, not the node's cores);
    never fewer than its serving count."""
    from vllm.utils.torch_utils import available_cpu_count

    try:
        asked = int(os.environ.get(STARTUP_THREADS_ENV, ""))
    except ValueError:
        asked = available_cpu_count()
    return max(threads, asked)


def hold_threads_for_fork(threads: int, startup: int) -> None:
    """This process computes on one OpenMP thread from now on; a core forked from it starts on `startup` threads
    and serves on `threads` (set as its busy loop begins)."""
    import torch
    from vllm.v1.engine.core import EngineCoreProc

    # Bound now: vLLM's CPU worker replaces torch.set_num_threads with a no-op once it has bound its threads.
    set_threads = torch.set_num_threads
    set_threads(1)
    os.register_at_fork(after_in_child=functools.partial(set_threads, startup))
    if startup == threads:
        return
    loop = EngineCoreProc.run_busy_loop

    @functools.wraps(loop)
    def run_busy_loop(self: Any) -> None:
        set_threads(threads)
        logger.info("engine core: %d threads to start, %d to serve", startup, threads)
        return loop(self)

    EngineCoreProc.run_busy_loop = run_busy_loop


def install() -> bool:
    """Wrap CpuPlatform.check_and_update_config when fork is asked for; True if wrapped (once per process)."""
    if os.environ.get(ENV) != "fork" or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return False  # fork is only safe where the core runs the model itself (two-process mode)
    threads = engine_threads_from_env()
    if threads is None:
        logger.warning("%s=fork ignored: OMP_NUM_THREADS=%r is not a thread count, and the engine core's threads "
                       "must be known before the fork; it starts by spawn", ENV, os.environ.get("OMP_NUM_THREADS"))
        return False
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__
    if getattr(check, _MARK, False):
        return False

    @functools.wraps(check)
    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    setattr(check_and_update_config, _MARK, True)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    if (startup := startup_threads(threads)) > 1:
        hold_threads_for_fork(threads, startup)
    return True
