"""Start a two-process engine's core by fork, not spawn: it then inherits the API server's imports (torch, vLLM,
this plugin) instead of importing them again, about 9 s of each start on a 2-core box (benchmarks/edge_up_times.py).

vLLM 0.28's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn unconditionally in
`CpuPlatform.check_and_update_config` (platforms/cpu.py), for its `mp` executor's workers, which bind OpenMP threads
to cores and must not inherit a parent's OpenMP state. In two-process mode there is no such worker: the engine core
runs the model itself (uni executor) with the thread count the plan gives it (OMP_NUM_THREADS, edge/engine_config.py).
vLLM's default start method elsewhere is fork, and its engine core is built to be forked from the API server.

Asked for by EDGE_ENGINE_CORE_START=fork (edge/engine_config.py sets it for a two-process engine of one thread);
without it this changes nothing. With OMP_NUM_THREADS above 1 it is refused: libgomp's thread pool, which the API
server has started by then, does not survive a fork, and the forked core hung in its first parallel region
(edge/engine_config.py, FORK_START_ENV).

After the platform's check, the wrapper puts `fork` back; vLLM's own reasons to force spawn
(`_maybe_force_spawn`: CUDA or XPU initialized, Ray, WSL, --numa-bind) still override it when the core starts.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

ENV = "EDGE_ENGINE_CORE_START"
logger = logging.getLogger(__name__)
_MARK = "_edge_select_engine_start"


def install() -> bool:
    """Wrap CpuPlatform.check_and_update_config when fork is asked for; True if wrapped (once per process)."""
    if os.environ.get(ENV) != "fork" or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return False  # fork is only safe where the core runs the model itself (two-process mode)
    if os.environ.get("OMP_NUM_THREADS", "").strip() != "1":
        logger.warning("%s=fork ignored: OMP_NUM_THREADS=%r, and a forked engine core of more than one thread "
                       "hangs in its first parallel region; it starts by spawn", ENV, os.environ.get("OMP_NUM_THREADS"))
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
    return True
