"""Which weight path wins at which batch size on this host: decides `dequant_threshold` without AMX.

For M rows of bf16 activations against an int4 g64 layer, median ms of:
  tinygemm        kernels.ops.tinygemm.linear (PyTorch's _weight_int4pack_mm_for_cpu)
  direct+bf16     dequantize straight from the tinygemm buffer to bf16, then a bf16 GEMM
  rowmajor+bf16   dequantize the row-major checkpoint copy to bf16, then a bf16 GEMM
  direct+fp32     dequantize from the tinygemm buffer to fp32, then an fp32 GEMM (activations cast up, out down)
  bf16            plain bf16 GEMM against bf16 weights held in memory (no quantization; the bf16 deployment)
Every variant runs once per pass at each M, passes interleave, and the median is reported. The crossover is the
smallest M from which the best dequantize path beats tinygemm.

Default clock: CPU time of the calling thread with torch at 1 thread (what vLLM runs here: on a 2-core box it
reserves one core, docs/FACTS.md), which shared cores barely disturb. `--threads 2 --clock wall` for wall time.

    python benchmarks/dequant_paths.py [--passes 5] [--threads 1] [--clock thread|wall]

Measured here 2026-11-29 (AVX2, block 32, torch 2.13.0, 1 thread, thread clock, 2 runs of 5 passes; ms):

    N x K        M    tinygemm    direct+bf16  rowmajor+bf16  direct+fp32    bf16
    576x1536     1    0.28/0.26   2.05/4.29    1.52/1.99      2.00/1.68      0.23/0.22
                 8    0.54/0.65   3.26/3.52    2.85/2.77      2.05/1.87      1.42/1.46
                 64   3.30/3.02   12.8/12.5    12.8/12.1      4.25/3.09      11.2/11.0
                 128  6.14/5.88   24.0/23.3    24.0/23.2      6.11/5.06      21.9/21.7
                 512  32.6/23.7   93.3/90.7    92.6/89.3      14.3/15.2      90.4/87.8
    1536x576     1    0.27/0.32   2.00/2.29    1.75/1.82      1.60/1.56      0.22/0.24
                 64   3.04/4.02   13.1/14.5    13.3/14.3      3.85/3.63      11.9/12.2
                 128  6.14/6.25   25.1/26.0    25.3/27.0      5.36/6.36      23.3/26.9
                 512  24.3/34.2   99.2/110     97.9/110       16.6/18.1      101/98.3
    4096x4096    1    2.70/2.90   76.6/73.2    63.6/65.0      92.6/89.5      3.65/4.05
                 64   59.5/74.6   260/264      268/271        147/157        200/205
                 256  220/299     862/883      873/885        190/220        820/821
                 512  485/554     1710/1765    1721/1710      373/355        1660/1695

Crossover (dequantize + fp32 GEMM beats tinygemm from here on): M=128 / 256 at 576x1536 and 1536x576
(ratio 0.86-1.02 at 128, 0.65-0.77 at 256), M=256 at 4096x4096 (0.74-0.86). tinygemm beats the bf16 GEMM
from M=2 at every shape; bf16 wins only at M=1. Without native bf16 (AVX2) the bf16 GEMM is never worth a
dequantize. With --threads 2 --clock wall the shared cores gave 16 ms scheduler stalls: not usable here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kernels.ops.int4 import dequantize, quantize_packed
from kernels.ops.layout import host_layout
from kernels.ops.tinygemm import dequantize_tinygemm, linear, to_tinygemm

SHAPES = [(576, 1536), (1536, 576), (4096, 4096)]  # [N, K]: SmolLM2 down_proj, up/gate_proj; a 7B-class square
ROWS = [1, 2, 4, 8, 16, 64, 128, 256, 512]  # the brief's M set plus 128, 256 to place the crossover
GROUP = 64
DEQUANT_PATHS = ("direct+bf16", "rowmajor+bf16", "direct+fp32")


def variants(n: int, k: int, m: int, layer: dict) -> dict[str, Callable[[], torch.Tensor]]:
    layout = host_layout()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    packed, interleaved = layer["packed"], layer["scales_and_zeros"]
    qweight, scales, zeros = layer["qweight"], layer["scales"], layer["zeros"]
    return {
        "tinygemm": lambda: linear(x, packed, interleaved, GROUP),
        "direct+bf16": lambda: x @ dequantize_tinygemm(packed, interleaved, GROUP, layout).t(),
        "rowmajor+bf16": lambda: x @ dequantize(qweight, scales, zeros, GROUP).t(),
        "direct+fp32": lambda: (
            x.float() @ dequantize_tinygemm(packed, interleaved, GROUP, layout, torch.float32).t()
        ).to(torch.bfloat16),
        "bf16": lambda: x @ layer["w_bf16"].t(),
    }


def make_layer(n: int, k: int) -> dict:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    qweight, scales, zeros = quantize_packed(w, GROUP)
    packed, interleaved = to_tinygemm(qweight, scales, zeros, GROUP)
    return {"qweight": qweight, "scales": scales, "zeros": zeros, "packed": packed,
            "scales_and_zeros": interleaved, "w_bf16": w.to(torch.bfloat16)}


def timed(fn: Callable[[], torch.Tensor], clock: Callable[[], float]) -> float:
    start = clock()
    fn()
    return (clock() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    layout = host_layout()
    print(f"torch {torch.__version__}, {layout.cpu_capability}, block {layout.block}, {args.threads} thread(s), "
          f"{args.clock} clock, group {GROUP}, median ms of {args.passes} interleaved passes")
    for shape in args.shapes.split(","):
        n, k = (int(d) for d in shape.split("x"))
        layer = make_layer(n, k)
        table = {m: variants(n, k, m, layer) for m in ROWS}
        samples = {(m, name): [] for m in ROWS for name in table[m]}
        for m in ROWS:  # warm-up
            for fn in table[m].values():
                fn()
        for _ in range(args.passes):
            for m in ROWS:
                for name, fn in table[m].items():
                    samples[(m, name)].append(timed(fn, clock))
        medians = {key: statistics.median(values) for key, values in samples.items()}
        names = list(table[ROWS[0]])
        print(f"\nN={n} K={k}")
        print("| M | " + " | ".join(names) + " | best dequant / tinygemm |")
        print("|---" * (len(names) + 2) + "|")
        crossover = None
        for m in ROWS:
            best = min(medians[(m, name)] for name in DEQUANT_PATHS)
            ratio = best / medians[(m, "tinygemm")]
            crossover = (crossover or m) if ratio < 1 else None  # from here on, dequantize keeps winning
            cells = " | ".join(f"{medians[(m, name)]:.3f}" for name in names)
            print(f"| {m} | {cells} | {ratio:.2f} |")
        print(f"crossover: dequantize beats tinygemm from M={crossover} (None: never up to {ROWS[-1]})")


if __name__ == "__main__":
    main()
