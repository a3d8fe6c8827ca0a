"""How far decode steps move when an engine variant changes only the arithmetic of decoding (an attention kernel, a
reduction order): the same plan served by vLLM's engine, each variant in its own process, greedy decoding from
prompts cut from edge-eval's default text.

    .venv/bin/python -m benchmarks.decode_agreement [--variants plain,plain+no-lean] [--prompts 8]
        [--prompt-tokens 64] [--tokens 256] [--json OUT]

edge-eval scores a checkpoint against its source by prefill windows, so a kernel that only decode rows take (the
plugin's lean attention, attention.cpp) never enters its numbers. Here every scored position is a decode step of
the engine as the plan serves it. The first variant is the reference; for each other variant, per prompt:
  - the greedy tokens shared with the reference before the first difference (a difference at a near tie is
    expected of any change of summation order; after it the texts are not compared);
  - on those shared positions, KL(reference || variant) over the reference's top-20 tokens, both distributions
    renormalized over those 20 (vLLM returns at most 20 log-probabilities: a truncated KLD, a lower bound of the full
    one's part on those tokens), and the largest change of the chosen token's log-probability.
Reported: mean truncated KLD with its standard error over positions, the median shared prefix, and how many prompts
ran to the end without a difference. Variants and their environments: benchmarks.step_profile's (VARIANT_ENV).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

from benchmarks.step_profile import ROOT, VARIANT_ENV, child_env, llm_kwargs, plan_and_model, variant_kwargs

TOP = 20  # vLLM's default max_logprobs


def child(model: str, kwargs: dict, prompts: list[list[int]], tokens: int) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, seed=0, max_logprobs=TOP, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=TOP, detokenize=False)
    runs = []
    for prompt in prompts:  # one at a time: a single stream's decode steps, as a user watches them
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        logprobs = [{str(t): lp.logprob for t, lp in step.items()} for step in out.logprobs]
        runs.append({"tokens": list(out.token_ids), "logprobs": logprobs})
    print(json.dumps({"event": "runs", "runs": runs}), flush=True)


def prompts_from_text(model: str, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, cut at even intervals from edge-eval's default text."""
    from transformers import AutoTokenizer

    from kernels.scoring.eval_text import default_text_path

    ids = AutoTokenizer.from_pretrained(model)(default_text_path().read_text(encoding="utf-8"))["input_ids"]
    step = (len(ids) - length) // count
    return [ids[i * step : i * step + length] for i in range(count)]


def compare(reference: dict, other: dict) -> dict:
    shared = 0
    for a, b in zip(reference["tokens"], other["tokens"], strict=False):
        if a != b:
            break
        shared += 1
    klds, moves = [], []
    # position i's distribution is over the token chosen at i: comparable while the prefixes before it are equal
    for i in range(min(shared + 1, len(reference["tokens"]), len(other["tokens"]))):
        ref, got = reference["logprobs"][i], other["logprobs"][i]
        keys = list(ref)
        floor = min(got.values())  # a token outside the variant's top 20 is at most its 20th
        p = [math.exp(ref[k]) for k in keys]
        q = [math.exp(got.get(k, floor)) for k in keys]
        sp, sq = sum(p), sum(q)
        klds.append(sum(pi / sp * math.log((pi / sp) / (qi / sq)) for pi, qi in zip(p, q, strict=True) if pi > 0))
        chosen = str(reference["tokens"][i])
        moves.append(abs(ref[chosen] - got.get(chosen, floor)))
    return {"shared": shared, "klds": klds, "largest_logprob_move": max(moves) if moves else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="plain,plain+no-lean")
    parser.add_argument("--priority", default="speed")
    parser.add_argument("--model", help="a model edge-serve takes (default: the embedded one)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-kwargs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child_kwargs)
        child(args.child, spec["kwargs"], spec["prompts"], spec["tokens"])
        return 0
    variants = args.variants.split(",")
    unknown = [part for v in variants for part in v.split("+")[1:] if part not in VARIANT_ENV]
    if unknown:
        print(f"--variants: unknown modifier(s) {unknown}; known: {sorted(VARIANT_ENV)}", file=sys.stderr)
        return 2
    plan, model = plan_and_model(args)
    prompts = prompts_from_text(str(model), args.prompts, args.prompt_tokens)
    runs = {}
    for variant in variants:
        spec = {"kwargs": variant_kwargs(llm_kwargs(plan), variant), "prompts": prompts, "tokens": args.tokens}
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.decode_agreement", "--child", str(model), "--child-kwargs",
             json.dumps(spec)],
            env=child_env(plan, variant), capture_output=True, text=True, cwd=ROOT,
        )  # fmt: skip
        lines = [line for line in done.stdout.splitlines() if line.startswith('{"event"')]
        if done.returncode != 0 or not lines:
            print(done.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"variant {variant}: the engine child failed ({done.returncode})")
        runs[variant] = json.loads(lines[-1])["runs"]
    from benchmarks.host import cpu_model_name

    host = (f"{cpu_model_name()}, {os.cpu_count()} cores; plan {plan.path}/{plan.layout or '-'} "
            f"{plan.vllm.env.get('OMP_NUM_THREADS', '')} thread(s); model {model}")  # fmt: skip
    report = {"host": host, "args": vars(args), "variants": {}}
    print(f"{report['host']}; {args.prompts} prompts of {args.prompt_tokens} tokens, {args.tokens} greedy tokens each; "
          f"reference {variants[0]}")  # fmt: skip
    print("| variant | truncated KLD, mean +- s.e. (positions) | largest chosen-token logprob move | shared prefix, "
          "median (min-max) | prompts identical to the end |")  # fmt: skip
    print("|---|---|---|---|---|")
    for variant in variants[1:]:
        per = [compare(a, b) for a, b in zip(runs[variants[0]], runs[variant], strict=True)]
        klds = [k for p in per for k in p["klds"]]
        mean = statistics.fmean(klds)
        se = statistics.stdev(klds) / math.sqrt(len(klds)) if len(klds) > 1 else 0.0
        shared = [p["shared"] for p in per]
        whole = sum(s == args.tokens for s in shared)
        move = max(p["largest_logprob_move"] for p in per)
        report["variants"][variant] = {"kld_mean": mean, "kld_se": se, "positions": len(klds), "shared": shared,
                                       "identical_prompts": whole, "largest_logprob_move": move}  # fmt: skip
        print(f"| {variant} | {mean:.2e} +- {se:.1e} ({len(klds)}) | {move:.4f} | {statistics.median(shared):.0f} "
              f"({min(shared)}-{max(shared)}) | {whole} of {len(shared)} |")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
