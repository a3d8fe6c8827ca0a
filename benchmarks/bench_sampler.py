"""vLLM's CPU sampler against the plugin's (kernels/vllm_plugin/sampling.py), side by side, interleaved.

One sampling step as `TopKTopPSampler.forward_cpu` runs it for unseeded requests (top-k/top-p mask, then the
draw), per sampling setting a client sends and per batch size. Logits:

    default       the default model's own (SmolLM2-135M-Instruct bf16, transformers, 49152 tokens) at every position
                  of plain English prose, divided by temperature 0.8 (llama.cpp server's default): rows of a real
                  distribution, taken in turn, so each call sees another position's nucleus
    random:N      random normal times --scale over N tokens (151936: Qwen3's vocabulary); flatter than a real model
                  at 3.0: a nucleus of thousands at top-p 0.95, which is where the full sort still runs

The nucleus sizes are reported (median and max over the rows used). Last, the repetition penalty alone (vLLM's
CPU path against the plugin's), on a 64-token prompt and 128 output tokens a row. Rounds alternate the two samplers;
each reports the median microseconds of its calls and the ratio vllm / edge:

    .venv/bin/python -m benchmarks.bench_sampler [--logits default,random:151936] [--rounds 5] [--calls 50]
        [--threads 1] [--json FILE]

Run it alone: two benchmarks on two cores measure each other.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from edge.device.cpuinfo import host_model_name

SETTINGS = {
    "temperature only": (None, None),
    "top-k 40": (40, None),
    "top-p 0.95": (None, 0.95),
    "top-k 40 + top-p 0.95 (llama.cpp server's default)": (40, 0.95),
}


def _interleaved(steps: dict, calls: list[tuple], rounds: int) -> dict[str, float]:
    """Median microseconds a call of each step, the steps alternating round by round; each call gets its arguments
    with the logits (the first, which the steps change in place) cloned beforehand, outside the timing."""
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(rounds):
        for label, step in steps.items():
            for logits, *rest in [(arguments[0].clone(), *arguments[1:]) for arguments in calls]:
                start = time.perf_counter()
                step(logits, *rest)
                times[label].append((time.perf_counter() - start) * 1e6)
    return {f"{label}_us": round(statistics.median(t), 1) for label, t in times.items()}


def _logits(source: str, scale: float):
    """Rows of logits, float32: the default model's over PROSE at temperature 0.8, or random:N (see the docstring)."""
    import torch

    if source.startswith("random:"):
        return torch.randn(256, int(source.split(":", 1)[1]), generator=torch.Generator().manual_seed(0)) * scale
    if source != "default":
        raise SystemExit(f"--logits: {source!r} is neither 'default' nor 'random:N'")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.llama_cpp_decode import PROSE
    from kernels.source.default_model import ensure_default_model

    directory = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, torch_dtype=torch.float32)
    ids = tokenizer(PROSE, return_tensors="pt").input_ids[:, :512]
    with torch.no_grad():
        return (model(ids).logits[0] / 0.8).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--logits", default="default,random:151936")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--scale", type=float, default=3.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    from vllm.v1.sample.ops import topk_topp_sampler as vllm_sampler

    from kernels.vllm_plugin import sampling

    torch.set_num_threads(args.threads)
    sources = {name: _logits(name, args.scale) for name in args.logits.split(",")}
    vllm_draw = vllm_sampler.compiled_random_sample  # vLLM's own: this process never installs the plugin's

    def vllm_step(logits, k, p):
        masked = vllm_sampler.apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)
        return vllm_draw(masked)

    def edge_step(logits, k, p):
        return sampling.inverse_cdf_sample(sampling.top_k_top_p(logits, k, p))

    samplers = {"vllm": vllm_step, "edge": edge_step}
    results = []
    for source, rows in sources.items():
        vocab = rows.shape[1]
        for batch in (int(b) for b in args.batches.split(",")):
            batches = [rows[(i * batch) % (rows.shape[0] - batch + 1):][:batch] for i in range(args.calls)]
            for name, (k_value, p_value) in SETTINGS.items():
                k = None if k_value is None else torch.full((batch,), k_value)
                p = None if p_value is None else torch.full((batch,), p_value)
                nucleus = [n for x in batches for n in
                           torch.isfinite(sampling.top_k_top_p(x.clone(), k, p)).sum(dim=1).tolist()]
                for step in samplers.values():  # warm-up (vLLM's draw compiles on its first call)
                    step(batches[0].clone(), k, p)
                medians = _interleaved(samplers, [(x, k, p) for x in batches], args.rounds)
                row = {"logits": source, "vocab": vocab, "batch": batch, "setting": name,
                       "nucleus_median": statistics.median(nucleus), "nucleus_max": max(nucleus), **medians}
                row["ratio"] = round(row["vllm_us"] / row["edge_us"], 2)
                results.append(row)
                print(json.dumps(row), flush=True)
    # The repetition penalty (vLLM's CPU path, dense, against the plugin's on the seen tokens): a 64-token prompt and
    # 128 tokens of output per row, penalty 1.1, on the first source's logits
    from vllm import _custom_ops

    vllm_penalty = _custom_ops.apply_repetition_penalties_torch  # vLLM's own: this process never installs the plugin's
    rows = next(iter(sources.values()))
    for batch in (int(b) for b in args.batches.split(",")):
        generator = torch.Generator().manual_seed(batch)
        seen = [torch.zeros(batch, rows.shape[1], dtype=torch.bool) for _ in range(2)]
        for mask, count in zip(seen, (64, 128), strict=True):
            mask.scatter_(1, torch.randint(0, rows.shape[1], (batch, count), generator=generator), True)
        penalties = torch.full((batch,), 1.1)
        calls = [(rows[i % (rows.shape[0] - batch + 1):][:batch], *seen, penalties) for i in range(args.calls)]
        medians = _interleaved({"vllm": vllm_penalty, "edge": sampling.apply_repetition_penalties}, calls, args.rounds)
        row = {"logits": next(iter(sources)), "vocab": rows.shape[1], "batch": batch,
               "setting": "repetition penalty 1.1 (64 prompt + 128 output tokens)", "nucleus_median": rows.shape[1],
               "nucleus_max": rows.shape[1], **medians}
        row["ratio"] = round(row["vllm_us"] / row["edge_us"], 2)
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {"cpu": host_model_name() or platform.processor(), "threads": args.threads, "torch": torch.__version__,
              "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{report['cpu']}, {args.threads} thread(s), medians of {args.rounds} x {args.calls} calls\n")
    print("| logits | batch | setting | nucleus median (max) | vLLM us | edge us | vLLM / edge |")
    print("|---|---|---|---|---|---|---|")
    for row in results:
        print(f"| {row['logits']} ({row['vocab']}) | {row['batch']} | {row['setting']} | {row['nucleus_median']:g} "
              f"({row['nucleus_max']}) | {row['vllm_us']:.1f} | {row['edge_us']:.1f} | {row['ratio']:.2f} |")


if __name__ == "__main__":
    main()
