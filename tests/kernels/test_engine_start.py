"""kernels/vllm_plugin/engine_start.py: a two-process engine's core starts by fork; nothing changes elsewhere.

Each case runs in a child process: the wrapper replaces vLLM's CpuPlatform method process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import json, os
os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
from vllm.platforms.cpu import CpuPlatform
real = CpuPlatform.check_and_update_config
def stand_in_check(cls, vllm_config):  # a stand-in for the platform's check: what it does to the start method
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
CpuPlatform.check_and_update_config = classmethod(stand_in_check)
from kernels.vllm_plugin import engine_start
wrapped = engine_start.install()
again = engine_start.install()
CpuPlatform.check_and_update_config(object())
import torch
print(json.dumps({"wrapped": wrapped, "again": again, "method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
                  "threads": torch.get_num_threads(),
                  "real_sets_spawn": "VLLM_WORKER_MULTIPROC_METHOD" in __import__("inspect").getsource(real)}))
"""


def probe(env: dict[str, str]) -> dict:
    import os

    mode_vars = ("EDGE_ENGINE_CORE_START", "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS")
    base = {k: v for k, v in os.environ.items() if k not in mode_vars}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**base, **env}, capture_output=True,
                          text=True, timeout=300, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


FORK = {"EDGE_ENGINE_CORE_START": "fork", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.mark.parametrize(
    ("env", "wrapped"),
    [
        ({**FORK, "OMP_NUM_THREADS": "1"}, True),
        ({**FORK, "OMP_NUM_THREADS": "2"}, True),  # the API server then computes on one thread (below)
        ({"EDGE_ENGINE_CORE_START": "fork", "OMP_NUM_THREADS": "1"}, False),  # three-process: workers bind OpenMP
        # libgomp's default (every core) or nonsense: the core's thread count is not known before the fork
        (FORK, False),
        ({**FORK, "OMP_NUM_THREADS": "two"}, False),
        ({**FORK, "OMP_NUM_THREADS": "0"}, False),
        ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}, False),  # not asked for
    ],
)
def test_fork_is_put_back_only_in_two_process_mode_when_asked(env, wrapped):
    got = probe(env)
    assert got["wrapped"] is wrapped and got["again"] is False  # installed at most once per process
    assert got["method"] == ("fork" if wrapped else "spawn")  # after the platform's check set spawn


def test_the_api_server_of_a_two_thread_engine_computes_on_one_thread():
    assert probe({**FORK, "OMP_NUM_THREADS": "2"})["threads"] == 1


FORKED = """
import json, os, sys, torch
from kernels.vllm_plugin.engine_start import hold_threads_for_fork
from vllm.v1.engine.core import EngineCoreProc
serving, startup = int(sys.argv[1]), int(sys.argv[2])
hold_threads_for_fork(serving, startup)
parent = torch.get_num_threads()
(torch.rand(1 << 22) * 2).sum()  # a parallel region in the parent before the fork, as the API server runs
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    child = torch.get_num_threads()
    total = float((torch.ones(1 << 22) * 2).sum())  # the region a forked core without the hold never left
    class StandInEngineCore:  # a stand-in for vLLM's engine core: its loop polls _handle_shutdown first
        def _handle_shutdown(self):
            self.serving = torch.get_num_threads()
            return False
    core = StandInEngineCore()
    try:
        EngineCoreProc.run_busy_loop(core)  # the real method, wrapped or not
    except SystemExit:
        pass
    os.write(write, json.dumps({"child": child, "total": total, "serving": core.serving}).encode())
    os._exit(0)
os.close(write)
got = json.loads(os.read(read, 4096))
os.waitpid(pid, 0)
print(json.dumps({"parent": parent, **got}))
"""


def forked(serving: int, startup: int) -> dict:
    import os

    env = {**os.environ, "OMP_NUM_THREADS": str(serving)}
    done = subprocess.run([sys.executable, "-c", FORKED, str(serving), str(startup)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_child_forked_after_the_hold_computes_on_the_engines_threads():
    """The hang this guards against: a forked child of a process that had run a multi-thread OpenMP region never
    left its own first parallel region (the timeout fails the test if it comes back)."""
    assert forked(2, 2) == {"parent": 1, "child": 2, "total": 2.0 * (1 << 22), "serving": 2}


def test_a_one_thread_core_starts_on_two_threads_and_serves_on_one():
    assert forked(1, 2) == {"parent": 1, "child": 2, "total": 2.0 * (1 << 22), "serving": 1}


@pytest.mark.parametrize(("asked", "serving", "expected"), [("1", 1, 1), ("1", 3, 3), ("4", 1, 4), ("x", 1, None)])
def test_startup_threads_are_the_cpus_unless_asked_and_never_fewer_than_serving(monkeypatch, asked, serving, expected):
    from vllm.utils.torch_utils import available_cpu_count

    from kernels.vllm_plugin.engine_start import STARTUP_THREADS_ENV, startup_threads

    monkeypatch.setenv(STARTUP_THREADS_ENV, asked)
    assert startup_threads(serving) == (expected or max(serving, available_cpu_count()))


def test_the_two_process_plan_asks_for_it_and_vllms_platform_still_forces_spawn():
    """The plan's two-process environment is what installs the wrapper; and the installed vLLM's CPU platform still
    sets spawn in check_and_update_config (when a vLLM upgrade stops doing so, the wrapper has nothing to undo)."""
    from edge.plan.engine_config import FORK_START_ENV, SERVING_MODE_ENV

    got = probe({**SERVING_MODE_ENV["two-process"], **FORK_START_ENV, "OMP_NUM_THREADS": "1"})
    assert got["wrapped"] is True and got["method"] == "fork"
    assert got["real_sets_spawn"]
