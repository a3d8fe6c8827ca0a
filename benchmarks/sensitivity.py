"""Which tensor types hurt most at 4 bits: one group of weights quantized at a time, the rest bf16, by edge-eval.

The groups are what vLLM can serve apart (q/k/v fuse into qkv_proj, gate/up into gate_up_proj:
edge.catalog.quantized_layers), plus the tied embedding and head. Each variant is converted with kernels.convert.convert
(round-to-nearest or the search, `--rounding`; the GGUF's own grid off: this measures a plain bf16 source) and
scored against the bf16 source by kernels.evaluate.evaluate on the default prose. Prints a markdown table.

    python -m benchmarks.sensitivity [--group 64] [--rounding nearest|search] [--tokens 16384] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kernels.convert.convert import convert
from kernels.evaluate.evaluate import evaluate
from kernels.source.default_model import ensure_default_model
from kernels.vllm_plugin.cpu_int4 import quantization_config

GROUPS = {
    "q_proj + k_proj + v_proj": ["q_proj", "k_proj", "v_proj"],
    "o_proj": ["o_proj"],
    "gate_proj + up_proj": ["gate_proj", "up_proj"],
    "down_proj": ["down_proj"],
    "embed_tokens + lm_head (tied)": ["lm_head"],
    "all of them (a whole 4-bit model, head at 4 bits)": [],
}
KINDS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def variant_config(quantized: list[str], group: int, rounding: str) -> dict:
    """Only `quantized` at 4 bits (an empty list: everything); the 8-bit set empty, the rest ignored (bf16)."""
    ignore = [kind for kind in KINDS if quantized and kind not in quantized]
    config = quantization_config("direct", group_size=group, int8=(), ignore=ignore)
    return {**config, "rounding": rounding}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--rounding", choices=("nearest", "search"), default="nearest")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=Path("/tmp/edge-sensitivity"))
    args = parser.parse_args()
    source = ensure_default_model()
    rows = []
    for label, quantized in GROUPS.items():
        config = variant_config(quantized, args.group, args.rounding)
        name = "-".join(quantized) or "all"
        dst = convert(source, args.out / f"g{args.group}-{args.rounding}-{name}", config, path="w4a16-tinygemm",
                      force=True, log=lambda message: None)  # fmt: skip
        started = time.monotonic()
        report = evaluate(source, dst, tokens=args.tokens, progress=False)
        rows.append((label, report.metrics, time.monotonic() - started, report.tokens_scored))
    print(f"group {args.group}, rounding {args.rounding}, {rows[0][3]} scored tokens each\n")
    print("| quantized at 4 bits (the rest bf16) | mean KLD | top-1 agreement | perplexity ratio | confident flips |")
    print("|---|---|---|---|---|")
    for label, m, _, _ in rows:
        print(f"| {label} | {cell(m, 'mean_kld')} | {cell(m, 'top1_agreement', True)} | {cell(m, 'ppl_ratio')} | "
              f"{cell(m, 'confident_flip_rate', True)} |")  # fmt: skip


def cell(metrics: dict, key: str, pct: bool = False) -> str:
    value, se = metrics[key]["value"], metrics[key]["se"]
    return f"{value:.2%} +- {se:.2%}" if pct else f"{value:.4f} +- {se:.4f}"


if __name__ == "__main__":
    main()
