"""Real vLLM on this host's speed plan for the default model: n-gram drafting (`edge-select --speculative ngram`)
generates the greedy text the same plan generates without it, token for token, on the three workloads bench_serve
measures (benchmarks/workloads/: open continuation, a summary of a given passage, a function edited in place), and
its drafts are checked and accepted (vLLM's spec_decode counters); three sequences decoding at once draft nothing
(the plan lets one sequence draft: kernels/vllm_plugin/drafting.py).

Both runs take their engine arguments and environment from the plans themselves (edge.plan.engine_config:
`--speculative-config`, and the attention in one pass for every row, VLLM_CPU_ATTN_SPLIT_KV=0, without which a
summary's greedy text left the undrafted one at token 106 here), and torch on the plan's threads (numba's threading
layer had given it every core). One subprocess per plan, the engine core stepped inside it
(VLLM_ENABLE_V1_MULTIPROCESSING=0, as the one-process plan serves). Each workload runs alone, as the one stream an
edge user watches.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKLOADS = Path(__file__).parents[2] / "benchmarks" / "workloads"
NEW_TOKENS = 128


def generate(model: str, out: Path, keywords: dict) -> None:
    import torch
    from vllm import LLM, SamplingParams

    def counters() -> dict:
        return {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode") and
                hasattr(m, "value")}  # fmt: skip

    prompts = [(WORKLOADS / f"{name}.txt").read_text() for name in ("open", "summarize", "edit")]
    llm = LLM(model=model, seed=0, disable_log_stats=False, **keywords)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    tokens = [list(llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]  # one stream
    alone = counters()
    # the three at once, decoding together to the end: more sequences than the plan lets draft (EDGE_DRAFT_MAX_SEQS)
    together = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS // 4, ignore_eos=True),
                            use_tqdm=False)  # fmt: skip
    out.write_text(json.dumps({"tokens": tokens, "counters": alone, "after_together": counters(),
                               "together": [len(o.outputs[0].token_ids) for o in together],
                               "threads": torch.get_num_threads()}))  # fmt: skip
    llm.llm_engine.engine_core.shutdown()


def plan_for(speculative: str):
    from server.cli import parser, prepare

    args = parser().parse_args(["--priority", "speed", "--speculative", speculative, "--max-model-len", "1024"])
    prepared = prepare(args, calibration="cached")
    return prepared.plan, prepared.serve_dir


def run(speculative: str, tmp_path: Path) -> dict:
    from benchmarks.step_profile import child_env, llm_kwargs

    plan, serve_dir = plan_for(speculative)
    out = tmp_path / f"{speculative}.json"
    env = child_env(plan, "plain")
    code = (f"from tests.kernels.test_speculative_slow import generate; from pathlib import Path; "
            f"generate({str(serve_dir)!r}, Path({str(out)!r}), {llm_kwargs(plan)!r})")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return {"plan": plan, **json.loads(out.read_text())}


def test_ngram_drafting_generates_the_undrafted_greedy_text_and_accepts_drafts(tmp_path):
    off, ngram = run("off", tmp_path), run("ngram", tmp_path)
    spec = ngram["plan"].speculative
    assert spec.method == "ngram" and off["plan"].speculative.method == "off"
    assert "--speculative-config" in ngram["plan"].vllm.args and "--speculative-config" not in off["plan"].vllm.args
    for name, a, b in zip(("open", "summarize", "edit"), off["tokens"], ngram["tokens"], strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        assert a == b, f"{name}: the drafted text leaves the undrafted one at token {first}"
    counters = ngram["counters"]
    drafted, accepted = counters["vllm:spec_decode_num_draft_tokens"], counters["vllm:spec_decode_num_accepted_tokens"]
    assert drafted > 0, "no token was drafted: the plan's speculative_config did not reach the engine"
    assert 0 < accepted <= drafted
    assert not off["counters"], "the undrafted plan's engine drafted"
    # three sequences decoding at once draft nothing (kernels/vllm_plugin/drafting.py): their verify rows would leave
    # the decode kernel
    assert ngram["together"] == [NEW_TOKENS // 4] * 3
    assert ngram["after_together"]["vllm:spec_decode_num_drafts"] == counters["vllm:spec_decode_num_drafts"]
    # vLLM's n-gram proposer starts numba, whose default threading layer gave torch every core (edge.plan.engine_config
    # DRAFTING_ENV): the drafting engine computes on the plan's threads like the other
    for done in (off, ngram):
        assert done["threads"] == int(done["plan"].vllm.env["OMP_NUM_THREADS"])

