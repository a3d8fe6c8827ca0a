"""Reconstruction SNR of the default model's real weights: symmetric GPTQ (absmax, searched) vs asymmetric W4A16.

    python benchmarks/gptq_snr.py [--model DIR] [--groups 64,32] [--threads 1]
    python benchmarks/gptq_snr.py --grid      # ratio step and refit, on 13 real matrices, group 64
    python benchmarks/gptq_snr.py --timing    # the head's search: 1 vs 2 threads x chunk sizes, medians

For every layer kind (q/k/v/o, gate/up/down, and the head = the tied embedding matrix) and group size, prints
the SNR over all 30 layers together (10 log10 sum|w|^2 / sum|w - w_hat|^2), the smallest per-layer gain of the
search over absmax, and the smallest per-layer margin of the asymmetric W4A16 export (kernels.ops.int4) over the
searched symmetric one. Weights are read in bf16, as the model ships; all reconstructions are exact fp32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.ops import int4, scale_search
from kernels.ops.gptq import dequantize_gptq, gptq_tensors
from kernels.ops.scale_search import absmax_scales, quantize_groups, search_scales

KINDS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
VARIANTS = ("absmax", "search", "asym")
BF16 = torch.bfloat16


def real_weights(model_dir: Path) -> dict[str, list[torch.Tensor]]:
    """Layer kind -> the bf16 weights [N, K] of every layer; 'lm_head' is the head (the embedding when tied)."""
    weights: dict[str, list[torch.Tensor]] = defaultdict(list)
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        layer = 0
        while f"model.layers.{layer}.self_attn.q_proj.weight" in names:
            for kind in KINDS:
                weights[kind].append(f.get_tensor(f"model.layers.{layer}.{kind}.weight"))
            layer += 1
        head = "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
        weights["lm_head"].append(f.get_tensor(head))
    return weights


def reconstructions(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """The fp32 weight each export stands for."""
    asym = int4.dequantize(*int4.quantize_packed(w, group), group, dtype=torch.float32)
    return {
        "absmax": dequantize_gptq(gptq_tensors("w", w, group, search=False), group),
        "search": dequantize_gptq(gptq_tensors("w", w, group, search=True), group),
        "asym": asym,
    }


def measure(weights: list[torch.Tensor], group: int) -> dict[str, float]:
    signal = 0.0
    noise = dict.fromkeys(VARIANTS, 0.0)
    gains, margins = [], []
    for w in weights:
        reference = w.double()
        layer_signal = float(reference.square().sum())
        layer_noise = {v: float((reference - r.double()).square().sum()) for v, r in reconstructions(w, group).items()}
        signal += layer_signal
        for variant in VARIANTS:
            noise[variant] += layer_noise[variant]
        db = {v: 10 * torch.log10(torch.tensor(layer_signal / n)).item() for v, n in layer_noise.items()}
        gains.append(db["search"] - db["absmax"])
        margins.append(db["asym"] - db["search"])
    row = {v: 10 * torch.log10(torch.tensor(signal / noise[v])).item() for v in VARIANTS}
    row["min_gain"] = min(gains)
    row["min_margin"] = min(margins)
    return row


def grid_study(weights: dict[str, list[torch.Tensor]], group: int) -> None:
    """SNR of the search at several ratio steps, with and without the least-squares refit, on a sample."""
    sample = [
        weights[kind][layer]
        for layer in (0, 15, 29)
        for kind in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj")
    ]
    sample.append(weights["lm_head"][0])
    groups = [w.float().reshape(-1, group) for w in sample]
    signal = sum(float(g.double().square().sum()) for g in groups)

    def db(choose) -> float:
        noise = 0.0
        for g in groups:
            scales = choose(g)
            noise += float((quantize_groups(g, scales) * scales[:, None] - g).double().square().sum())
        return 10 * torch.log10(torch.tensor(signal / noise)).item()

    print(f"grid study, group {group}, {len(sample)} matrices: absmax {db(lambda g: absmax_scales(g, BF16)):.3f} dB")
    for step in (0.05, 0.02, 0.01):
        ratios = tuple(round(0.5 + step * i, 3) for i in range(round(0.5 / step) + 1))
        for refit in (False, True):
            snr = db(lambda g, r=ratios, f=refit: search_scales(g, BF16, r, refit=f))
            print(f"  step {step} refit {refit}: {snr:.3f} dB", flush=True)


def timing(head: torch.Tensor, group: int, passes: int = 3) -> None:
    """Wall time of the head's scale search by torch threads and chunk size; variants interleaved, medians."""
    groups = head.float().reshape(-1, group)
    variants = [(threads, chunk) for threads in (1, 2) for chunk in (1 << 18, 1 << 20, 1 << 22)]
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    for _ in range(passes):
        for threads, chunk in variants:
            torch.set_num_threads(threads)
            scale_search._ELEMENTS_PER_CHUNK = chunk
            start = time.perf_counter()
            search_scales(groups, BF16)
            times[threads, chunk].append(time.perf_counter() - start)
    fastest = min(statistics.median(t) for t in times.values())
    for (threads, chunk), t in times.items():
        median = statistics.median(t)
        print(
            f"  threads {threads} chunk 2^{chunk.bit_length() - 1}: median {median:.2f} s "
            f"({median / fastest:.1f}x the fastest)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="bf16 safetensors model dir (default: the default model)")
    parser.add_argument("--groups", default="64,32", help="comma-separated group sizes")
    # 1 thread: on the shared 2-core box the head's search took 4.8 s with 2 threads, 1.3 s with 1 (--timing).
    parser.add_argument("--grid", action="store_true", help="compare ratio steps and the refit on a sample")
    parser.add_argument("--timing", action="store_true", help="time the head's search by threads and chunk")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from kernels.source.default_model import ensure_default_model

        args.model = ensure_default_model()
    weights = real_weights(args.model)
    if args.grid:
        grid_study(weights, 64)
        return
    if args.timing:
        print(f"scale search timing, head {list(weights['lm_head'][0].shape)}, group 64, load {os.getloadavg()}")
        timing(weights["lm_head"][0], 64)
        return
    print(f"model {args.model}, {len(weights['self_attn.q_proj'])} layers, torch threads {torch.get_num_threads()}")
    print()
    print(
        "| group | layer kind | shape [N, K] | layers | absmax dB | search dB | gain dB | min gain dB "
        "| asym W4A16 dB | asym - search dB | min asym - search dB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for group in (int(g) for g in args.groups.split(",")):
        start = time.perf_counter()
        for kind, layers in weights.items():
            row = measure(layers, group)
            shape = "x".join(str(d) for d in layers[0].shape)
            print(
                f"| {group} | {kind} | {shape} | {len(layers)} | {row['absmax']:.2f} | {row['search']:.2f} "
                f"| {row['search'] - row['absmax']:+.2f} | {row['min_gain']:+.2f} | {row['asym']:.2f} "
                f"| {row['asym'] - row['search']:+.2f} | {row['min_margin']:+.2f} |",
                flush=True,
            )
        print(f"<!-- group {group}: {time.perf_counter() - start:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
