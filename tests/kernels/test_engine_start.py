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
print(json.dumps({"wrapped": wrapped, "again": again, "method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
                  "real_sets_spawn": "VLLM_WORKER_MULTIPROC_METHOD" in __import__("inspect").getsource(real)}))
"""


def probe(env: dict[str, str]) -> dict:
    import os

    mode_vars = ("EDGE_ENGINE_CORE_START", "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS")
    base = {k: v for k, v in os.environ.items() if k not in mode_vars}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**base, **env}, capture_output=True,
                          text=True, timeout=300, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("env", "wrapped"),
    [
        ({"EDGE_ENGINE_CORE_START": "fork", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}, True),
        ({"EDGE_ENGINE_CORE_START": "fork", "OMP_NUM_THREADS": "1"}, False),  # three-process: workers bind OpenMP
        # more than one thread (or libgomp's default, every core): a forked core hangs in its first parallel region
        ({"EDGE_ENGINE_CORE_START": "fork", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2"}, False),
        ({"EDGE_ENGINE_CORE_START": "fork", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, False),
        ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, False),  # not asked for
    ],
)
def test_fork_is_put_back_only_in_two_process_mode_when_asked(env, wrapped):
    got = probe(env)
    assert got["wrapped"] is wrapped and got["again"] is False  # installed at most once per process
    assert got["method"] == ("fork" if wrapped else "spawn")  # after the platform's check set spawn


def test_the_two_process_plan_asks_for_it_and_vllms_platform_still_forces_spawn():
    """The plan's two-process environment is what installs the wrapper; and the installed vLLM's CPU platform still
    sets spawn in check_and_update_config (when a vLLM upgrade stops doing so, the wrapper has nothing to undo)."""
    from edge.engine_config import FORK_START_ENV, SERVING_MODE_ENV

    got = probe({**SERVING_MODE_ENV["two-process"], **FORK_START_ENV, "OMP_NUM_THREADS": "1"})
    assert got["wrapped"] is True and got["method"] == "fork"
    assert got["real_sets_spawn"]
