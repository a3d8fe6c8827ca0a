"""A 1 GiB box (issue 44): the default model planned for a 1 GiB memory budget serves under it with the REAL vLLM.

deploy/edge-up --memory-budget 1GiB starts twice. The first start may compile the model (a fresh box, or a changed
plan); its peak includes the compilers Inductor runs as child processes, so it is printed, not held to the budget.
The second start is every later start of the box: RssAnon summed over the whole process tree (edge-up, the wrapper,
the engine), sampled from launch through a prompt of the full context and max_num_seqs concurrent streams, stays
under the budget, and the engine still answers " Paris"."""

from __future__ import annotations

import pytest

from benchmarks.bench_serve import concurrent
from benchmarks.ledger_vs_rss import fill_context
from benchmarks.rss import TreeSampler
from tests.server.test_real_vllm import complete, get, ready, start_wrapper, stop_wrapper, wait_for

pytestmark = pytest.mark.slow

BUDGET = 2**30
ARGS = ("--memory-budget", "1GiB", "--max-model-len", "2048")


def _serve_once(tmp_path, workload: bool) -> tuple[dict, TreeSampler, str]:
    tmp_path.mkdir()
    process, url, log = start_wrapper(tmp_path, args=ARGS)
    sampler = TreeSampler(process.pid, interval_s=0.1).start()
    try:
        wait_for(lambda: ready(url), process, log)
        status = get(f"{url}/status").json()
        if workload:
            from transformers import AutoTokenizer

            from kernels.source.default_model import ensure_default_model

            model = get(f"{url}/v1/models").json()["data"][0]["id"]
            answer = complete(url, model)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"].startswith(" Paris"), answer.json()["choices"][0]["text"]
            tokenizer = AutoTokenizer.from_pretrained(ensure_default_model(), local_files_only=True)
            fill_context(url, model, tokenizer, status["plan"]["max_model_len"], seed=1)
            done = concurrent(url, model, status["plan"]["max_num_seqs"], 32)
            assert done["tokens"] == status["plan"]["max_num_seqs"] * 32, done
    finally:
        stop_wrapper(process)
        sampler.stop()
    return status, sampler, log.read_text(errors="replace")


def test_the_default_model_planned_for_1_gib_serves_under_it(tmp_path):
    first_status, first, _ = _serve_once(tmp_path / "first", workload=False)
    plan = first_status["plan"]
    assert plan["memory"]["budget_bytes"] == BUDGET and plan["memory"]["fits"], plan["memory"]
    assert plan["memory"]["peak_bytes"] <= BUDGET
    status, second, log = _serve_once(tmp_path / "second", workload=True)
    peak = second.peak_bytes
    print(f"tree RssAnon peak: first start {first.peak_bytes / 2**20:.0f} MiB, a later start with a full context and "
          f"{plan['max_num_seqs']} streams {peak / 2**20:.0f} MiB; the plan's ledger: resident "
          f"{plan['memory']['resident_bytes'] / 2**20:.0f} MiB, peak {plan['memory']['peak_bytes'] / 2**20:.0f} MiB")
    print(second.describe_peak())
    assert peak <= BUDGET, (f"{peak / 2**20:.0f} MiB over the tree, budget {BUDGET / 2**20:.0f} MiB; "
                            f"{second.describe_peak()}\nthe second start's log, last lines:\n{log[-6000:]}")
