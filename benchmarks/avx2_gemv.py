"""The AVX2 int4 kernels (kernels/ops/avx2_int4.py: int16 and int8 activations) against tinygemm and bf16 at decode:
ms and GB/s of weights read. avx2-w4a8 reads the row-major tensors, avx2-w4a8-x8 the same codes in the decode layout
(kernels.ops.avx2_int4.decode_layout: 8 output channels interleaved, what the plugin serves that kernel from).

    python benchmarks/avx2_gemv.py [--rounds 30] [--rows 1,4] [--group 64] [--json]
    python benchmarks/avx2_gemv.py --int8 [--rounds 30] [--rows 1,4]     # the 8-bit set's kernels instead

`--int8`: the 8-bit set's int8 weights per output channel (PyTorch's `_weight_int8pack_mm` and the AVX2 int8
kernel) against per group of 32 and 16 (a GGUF's Q8_0/Q5_0 and Q6_K grids, quantization_config's
`int8_group_size`; the AVX2 kernel only), at the default model's head (49152x576) and its linears' shapes, GB/s
over codes + scales.

Two processes: this host's own dispatch (tinygemm takes the CPU's widest path, AVX-512 on Zen 5) and a child under
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` (tinygemm's and oneDNN's AVX2 code, as on an AVX2-only box; the
AVX2 kernel is the same binary in both). In each: 1 torch thread, clock = the calling thread's CPU time (other jobs
on the shared cores barely move it), kernels interleaved call by call within each (shape, M), median of `rounds`
calls each; every call reads the next of enough weight copies to exceed 2x the last-level cache, so weights come
from memory as in serving. GB/s = bytes of the kernel's weight format (codes + scales + zeros; bf16: 2 bytes a
weight) / median time. The read bandwidth is kernels.calibrate.calibration_timers.read_bandwidth_gb_s (a float32 sum, 1
thread). EDGE_AVX2_VNNI=0 measures the AVX2 kernels' plain AVX2 build on a CPU with AVX-VNNI (an AVX2-only box has
none).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.host import cpu_model_name

SHAPES = [(4096, 4096), (960, 576), (576, 576), (3072, 576), (576, 1536)]  # N x K; the default model's four
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
KERNELS = ("avx2", "avx2-w4a8", "avx2-w4a8-x8", "tinygemm", "bf16")
INT8_SHAPES = [(49152, 576), (576, 576), (1536, 576), (576, 1536)]
INT8_KERNELS = ("int8pack-channel", "avx2-int8-channel", "avx2-int8-g32", "avx2-int8-g16")


def _builders(group: int):
    from kernels.ops import avx2_int4
    from kernels.ops.int4 import quantize_packed
    from kernels.ops.tinygemm import linear as tinygemm_linear
    from kernels.ops.tinygemm import to_tinygemm

    def avx2_kernel(act_bits, layout=lambda q, s, z, bits: (q, s, z)):
        def build(w):
            q, s, z = layout(*quantize_packed(w, group), act_bits)
            return (lambda x: avx2_int4.linear(x, q, s, z, group, act_bits)), q.nbytes + s.nbytes + z.nbytes

        return build

    def tinygemm(w):
        packed, sz = to_tinygemm(*quantize_packed(w, group), group)
        return (lambda x: tinygemm_linear(x, packed, sz, group)), packed.nbytes + sz.nbytes

    def bf16(w):
        held = w.to(torch.bfloat16)
        return (lambda x: torch.nn.functional.linear(x, held)), held.nbytes

    def int8(group, kernel):
        from kernels.ops.int8 import quantize_int8

        def build(w):
            q, s = quantize_int8(w, group=group)
            return (lambda x: kernel(x, q, s)), q.nbytes + s.nbytes

        return build

    int8pack = torch.ops.aten._weight_int8pack_mm
    return {"avx2": avx2_kernel(16), "avx2-w4a8": avx2_kernel(8),
            "avx2-w4a8-x8": avx2_kernel(8, avx2_int4.decode_layout), "tinygemm": tinygemm, "bf16": bf16,
            "int8pack-channel": int8(None, int8pack), "avx2-int8-channel": int8(None, avx2_int4.int8_linear),
            "avx2-int8-g32": int8(32, avx2_int4.int8_linear), "avx2-int8-g16": int8(16, avx2_int4.int8_linear)}


def measure(rounds: int, rows: list[int], group: int, kernel_set: tuple[str, ...] = KERNELS,
            shapes: list[tuple[int, int]] = SHAPES) -> dict:  # fmt: skip
    from kernels.calibrate.calibration_timers import last_level_cache_bytes, read_bandwidth_gb_s
    from kernels.ops.avx2_int4 import load

    torch.set_num_threads(1)
    reason = load()
    kernels = [k for k in kernel_set if not (k.startswith("avx2") and reason)]
    llc = last_level_cache_bytes()
    builders = _builders(group)
    results = []
    for n, k in shapes:
        generator = torch.Generator().manual_seed(n * k)
        runs, nbytes = {}, {}
        for kernel in kernels:
            copies = []
            while True:
                run, size = builders[kernel](torch.randn(n, k, generator=generator))
                copies.append(run)
                if len(copies) >= 2 and len(copies) * size > 2 * llc:
                    break
            runs[kernel], nbytes[kernel] = copies, size
        for m in rows:
            x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
            samples = {kernel: [] for kernel in kernels}
            for kernel in kernels:  # warm up
                for run in runs[kernel][:2]:
                    run(x)
            for i in range(rounds):
                for kernel in kernels:
                    run = runs[kernel][i % len(runs[kernel])]
                    begin = time.thread_time_ns()
                    run(x)
                    samples[kernel].append(time.thread_time_ns() - begin)
            for kernel in kernels:
                ms = statistics.median(samples[kernel]) / 1e6
                results.append({"n": n, "k": k, "m": m, "kernel": kernel, "ms": round(ms, 4),
                                "weight_bytes": nbytes[kernel],
                                "gb_s": round(nbytes[kernel] / ms / 1e6, 2)})  # fmt: skip
        del runs
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "avx2_kernel": reason
        or ("built, VNNI (AVX-VNNI or AVX512-VNNI)" if torch.ops.edge_avx2.uses_vnni() else "built, plain AVX2"),
        "read_bandwidth_gb_s": round(read_bandwidth_gb_s(llc, 1), 1),
        "llc_bytes": llc,
        "results": results,
    }


def table(native: dict, avx2: dict) -> str:
    """Markdown: one line per shape and M; ms and GB/s per kernel under each dispatch."""
    lines = [
        f"CPU: {cpu_model_name()}; read bandwidth (1 thread): {native['read_bandwidth_gb_s']} GB/s; "
        f"native dispatch {native['capability']}, child {avx2['capability']}; AVX2 kernels: {native['avx2_kernel']}",
        "",
        "| N x K | M | avx2 int16 ms (GB/s) | avx2 int8 ms (GB/s) | avx2 int8 x8 ms (GB/s) | x8 time / int8 | "
        "tinygemm native ms (GB/s) | tinygemm AVX2 ms (GB/s) | bf16 native ms | bf16 AVX2 ms | int16 vs tinygemm AVX2 "
        "| int8 vs tinygemm AVX2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pick(run, n, k, m, kernel):
        return next((r for r in run["results"] if (r["n"], r["k"], r["m"], r["kernel"]) == (n, k, m, kernel)), None)

    for r in native["results"]:
        if r["kernel"] != "avx2":
            continue
        n, k, m = r["n"], r["k"], r["m"]
        a8, x8 = pick(native, n, k, m, "avx2-w4a8"), pick(native, n, k, m, "avx2-w4a8-x8")
        tg, tg2 = pick(native, n, k, m, "tinygemm"), pick(avx2, n, k, m, "tinygemm")
        bf, bf2 = pick(native, n, k, m, "bf16"), pick(avx2, n, k, m, "bf16")
        lines.append(
            f"| {n}x{k} | {m} | {r['ms']:.3f} ({r['gb_s']:.1f}) | {a8['ms']:.3f} ({a8['gb_s']:.1f}) | "
            f"{x8['ms']:.3f} ({x8['gb_s']:.1f}) | {x8['ms'] / a8['ms']:.2f}x | "
            f"{tg['ms']:.3f} ({tg['gb_s']:.1f}) | {tg2['ms']:.3f} ({tg2['gb_s']:.1f}) | {bf['ms']:.3f} | "
            f"{bf2['ms']:.3f} | {tg2['ms'] / r['ms']:.2f}x | {tg2['ms'] / a8['ms']:.2f}x |"
        )
    return "\n".join(lines)


def int8_table(native: dict, avx2: dict) -> str:
    """Markdown for --int8: ms (GB/s) per kernel under each dispatch, and per-group against per-channel."""
    lines = [
        f"CPU: {cpu_model_name()}; read bandwidth (1 thread): {native['read_bandwidth_gb_s']} GB/s; "
        f"native dispatch {native['capability']}, child {avx2['capability']}; AVX2 kernels: {native['avx2_kernel']}",
        "",
        "| dispatch | N x K | M | " + " | ".join(f"{k} ms (GB/s)" for k in INT8_KERNELS)
        + " | g32 / avx2 channel | g16 / avx2 channel | g32 / int8pack |",
        "|---|---|---|" + "---|" * (len(INT8_KERNELS) + 3),
    ]
    for label, run in (("native", native), ("avx2", avx2)):
        found = {(r["n"], r["k"], r["m"], r["kernel"]): r for r in run["results"]}
        for n, k, m in dict.fromkeys((r["n"], r["k"], r["m"]) for r in run["results"]):
            cells = [found[n, k, m, kernel] for kernel in INT8_KERNELS]
            ms = {kernel: cell["ms"] for kernel, cell in zip(INT8_KERNELS, cells, strict=True)}
            lines.append(
                f"| {label} | {n}x{k} | {m} | " + " | ".join(f"{c['ms']:.3f} ({c['gb_s']:.1f})" for c in cells)
                + f" | {ms['avx2-int8-g32'] / ms['avx2-int8-channel']:.2f}x"
                f" | {ms['avx2-int8-g16'] / ms['avx2-int8-channel']:.2f}x"
                f" | {ms['avx2-int8-g32'] / ms['int8pack-channel']:.2f}x |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--int8", action="store_true", help="the 8-bit set's kernels, per channel and per group")
    parser.add_argument("--shapes", help="NxK,... instead of the default shapes, e.g. 49152x2048 (a ~1B model's head)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        sets = (INT8_KERNELS, INT8_SHAPES) if args.int8 else (KERNELS, SHAPES)
        if args.shapes:
            sets = (sets[0], [tuple(int(d) for d in shape.split("x")) for shape in args.shapes.split(",")])
        print(json.dumps(measure(args.rounds, rows, args.group, *sets)))
        return 0
    runs = {}
    for label, extra in (("native", {}), ("avx2", AVX2_ENV)):
        command = [sys.executable, __file__, "--child", "--rounds", str(args.rounds), "--rows", args.rows,
                   "--group", str(args.group), *(["--int8"] if args.int8 else []),
                   *(["--shapes", args.shapes] if args.shapes else [])]  # fmt: skip
        done = subprocess.run(command, env={**os.environ, **extra}, capture_output=True, text=True, check=True)
        runs[label] = json.loads(done.stdout.strip().splitlines()[-1])
    render = int8_table if args.int8 else table
    print(json.dumps(runs, indent=1) if args.json else render(runs["native"], runs["avx2"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
