"""vLLM's CPU sampler against the plugin's (kernels/vllm_plugin/sampling.py), side by side, interleaved.

One sampling step as `TopKTopPSampler.forward_cpu` runs it for unseeded requests (top-k/top-p mask, then the
draw), per sampling setting a client sends and per batch size, over a vocabulary of the default model's size
(49152) and of Qwen3's (151936). Logits are random normal times a scale (3.0: a peaked row with a nucleus of a
few dozen tokens at top-p 0.95; the nucleus sizes are printed). Rounds alternate the two samplers; each reports
the median microseconds of its calls and the ratio vllm / edge:

    .venv/bin/python -m benchmarks.bench_sampler [--rounds 5] [--calls 50] [--threads 1] [--json FILE]

Run it alone: two benchmarks on two cores measure each other.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

SETTINGS = {
    "temperature only": (None, None),
    "top-k 40": (40, None),
    "top-p 0.95": (None, 0.95),
    "top-k 40 + top-p 0.95 (llama.cpp server's default)": (40, 0.95),
}


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", default="49152,151936")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--scale", type=float, default=3.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    from vllm.v1.sample.ops import topk_topp_sampler as vllm_sampler

    from kernels.vllm_plugin import sampling

    torch.set_num_threads(args.threads)
    vllm_draw = vllm_sampler.compiled_random_sample  # vLLM's own: this process never installs the plugin's

    def vllm_step(logits, k, p):
        masked = vllm_sampler.apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)
        return vllm_draw(masked)

    def edge_step(logits, k, p):
        return sampling.inverse_cdf_sample(sampling.top_k_top_p(logits, k, p))

    samplers = {"vllm": vllm_step, "edge": edge_step}
    results = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            generator = torch.Generator().manual_seed(vocab + batch)
            logits = torch.randn(batch, vocab, generator=generator) * args.scale
            for name, (k_value, p_value) in SETTINGS.items():
                k = None if k_value is None else torch.full((batch,), k_value)
                p = None if p_value is None else torch.full((batch,), p_value)
                nucleus = torch.isfinite(sampling.top_k_top_p(logits.clone(), k, p)).sum(dim=1).tolist()
                for step in samplers.values():  # warm-up (vLLM's draw compiles on its first call)
                    step(logits.clone(), k, p)
                times: dict[str, list[float]] = {s: [] for s in samplers}
                for _ in range(args.rounds):
                    for label, step in samplers.items():
                        inputs = [logits.clone() for _ in range(args.calls)]
                        for x in inputs:
                            start = time.perf_counter()
                            step(x, k, p)
                            times[label].append((time.perf_counter() - start) * 1e6)
                row = {"vocab": vocab, "batch": batch, "setting": name, "nucleus": nucleus,
                       **{f"{s}_us": round(statistics.median(t), 1) for s, t in times.items()}}
                row["ratio"] = round(row["vllm_us"] / row["edge_us"], 2)
                results.append(row)
                print(json.dumps(row), flush=True)
    report = {"cpu": _cpu_name(), "threads": args.threads, "torch": torch.__version__, "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'vocab':>7} {'batch':>5}  {'setting':52} {'vllm us':>9} {'edge us':>9} {'ratio':>6}")
    for row in results:
        print(f"{row['vocab']:7d} {row['batch']:5d}  {row['setting']:52} {row['vllm_us']:9.1f} "
              f"{row['edge_us']:9.1f} {row['ratio']:6.2f}")


if __name__ == "__main__":
    main()
