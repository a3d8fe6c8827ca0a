"""A GGUF's grids at their own size (issue 42 part 3): the decode kernel that reads a Q4_K tensor's own blocks
(144 bytes per 256 weights, 4.5 bits a weight) against today's path for the same tensor, its codes on the cpu_int4
grid at group 32 with bf16 scale and zero (5 bits a weight), and against this host's read bound, side by side.

    .venv/bin/python -m benchmarks.gguf_grids [--rounds 40] [--rows 1] [--shapes 11264x2048,...] [--json OUT]

Variants, interleaved call by call within each (shape, rows), median of `rounds` calls each, 1 torch thread, clock =
wall time of the call (the read loop is timed the same way):
  - q4k        torch.ops.edge_avx2.q4k_linear on the file's bytes (kernels/ops/q4k.py: its codes as cpu_int4's
                 row-major nibbles, its scales as they are), int8 activations per 32;
  - q4k-x8     the same op on the same bytes in the decode layout (kernels.ops.q4k.decode_layout: 8 output channels
               interleaved, their scales rearranged to as many bytes);
  - w4a8-g32   torch.ops.edge_avx2.w4a8_linear on the same codes repacked to cpu_int4 (today's Q4_K path);
  - w4a8-x8    the same op on those codes in the decode layout (kernels.ops.avx2_int4.decode_layout: 8 output
               channels interleaved, what the plugin serves the int8-activation kernel from; same bytes);
  - w4a16-g32  torch.ops.edge_avx2.w4a16_linear on those codes (int16 activations: the `avx2` decode kernel);
  - int8-g16   torch.ops.edge_avx2.w8a16_linear on int8 codes with float32 scales per 16 (today's path for a Q6_K
               tensor, 10 bits a weight; random codes of the same shape), for the prefetch comparison;
  - q6k-x8     torch.ops.edge_avx2.q6k_linear on random Q6_K blocks of the same shape in the decode layout
               (kernels/ops/q6k.py: the file's 210 bytes per 256 weights, 6.5625 bits a weight);
  - q8_0-x8    torch.ops.edge_avx2.g32_linear on random Q8_0 blocks of the same shape in the decode layout
               (kernels/ops/g32.py: the file's 34 bytes per 32 weights, 8.5 bits a weight);
  - q5_0-x8    the same op on random Q5_0 blocks (22 bytes per 32 weights, 5.5 bits a weight); today's path for both
               is int8-g16's kernel (Q5_0 at 10 bits a weight, Q8_0 at 9 or 10);
  - read       benchmarks/read_bandwidth.cpp's 256-bit loop over a buffer the size of the q4k weights' copies.
Every call reads the next of enough weight copies to exceed 2x the last-level cache, so weights come from memory
as in serving. GB/s = the bytes the variant's weights hold / median time; `of bound` = that over the read loop's
rate in the same run.
`--prefetch`: instead, one process per prefetch hint of the AVX2 kernels (EDGE_AVX2_PREFETCH=l1, the old hint,
and the default L2 hint), alternating for `--passes` passes: each variant's fraction of the bound per hint (median
over passes) and the time ratio. Otherwise two processes: the build this host picks (AVX512-VNNI or AVX-VNNI on
256-bit vectors where present) and EDGE_AVX2_VNNI=0 (the plain AVX2 build, what an AVX2-only box such as a Zen 3
runs).
Random blocks: any 144 bytes are a valid Q4_K block; d and dmin are set to small positive fp16 values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

# N x K of a ~1B's merged linears (make_random_gguf --preset 1b: qkv, o, gate_up, down) and the 4096x4096 reference
SHAPES = [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (4096, 4096)]
VARIANTS = ("q4k", "q4k-x8", "w4a8-g32", "w4a8-x8", "w4a16-g32", "int8-g16", "q6k-x8", "q8_0-x8", "q5_0-x8", "read")
KERNELS = VARIANTS[:-1]
BLOCK_BYTES = 144


def random_q4k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [N, K/256 * 144]: random codes and 6-bit scales, d in [1e-4, 1e-2), dmin in [0, 1e-2)."""
    nb = k // 256
    blocks = rng.integers(0, 256, size=(n, nb, BLOCK_BYTES), dtype=np.uint8)
    blocks[..., 0:2] = (rng.random((n, nb)) * 0.01 + 1e-4).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    blocks[..., 2:4] = (rng.random((n, nb)) * 0.01).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return blocks.reshape(n, nb * BLOCK_BYTES)


def random_q6k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [N, K/256, 210]: random codes and int8 scales (any bytes are a valid Q6_K block), d in [1e-5, 1e-3)."""
    nb = k // 256
    blocks = rng.integers(0, 256, size=(n, nb, 210), dtype=np.uint8)
    blocks[..., 208:210] = (rng.random((n, nb)) * 1e-3 + 1e-5).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return blocks


def random_g32(type_name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [N, K/32, 34 or 22]: random codes (any bytes are a valid Q8_0 or Q5_0 block's), d in [1e-5, 1e-3)."""
    from kernels.ops import g32

    nb = k // 32
    blocks = rng.integers(0, 256, size=(n, nb, g32.kind(type_name).bytes), dtype=np.uint8)
    blocks[..., 0:2] = (rng.random((n, nb)) * 1e-3 + 1e-5).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return blocks


def cpu_int4_of(blocks: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Today's path for a Q4_K tensor: kernels.source.gguf_source.cpu_int4_tensors on a one-tensor model."""
    from kernels.source.gguf_source import GgufModel, GgufTensor, cpu_int4_tensors

    tensor = GgufTensor("w", "w", "Q4_K", (n, k), None, blocks)
    model = GgufModel(Path("random.gguf"), "llama", 1, 1, {"w": tensor}, ())
    return cpu_int4_tensors(model, "w")


def q4k_of(blocks: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The q4k kernel's tensors for a Q4_K tensor's blocks (kernels/ops/q4k.py), its own copy of the codes."""
    from kernels.ops.q4k import from_blocks

    return from_blocks(blocks.reshape(n, k // 256, BLOCK_BYTES))


def measure(rounds: int, rows: list[int], shapes: list[tuple[int, int]]) -> dict:
    from benchmarks.read_bandwidth import extension
    from kernels.calibrate.calibration_timers import last_level_cache_bytes
    from kernels.ops import avx2_int4, g32, q6k
    from kernels.ops.q4k import decode_layout

    torch.set_num_threads(1)
    reason = avx2_int4.load()
    if reason:
        raise SystemExit(f"the AVX2 kernels cannot run here: {reason}")
    reader = extension()
    llc = last_level_cache_bytes()
    ops = torch.ops.edge_avx2
    q4k, w4a8, w4a16, w8a16 = ops.q4k_linear, ops.w4a8_linear, ops.w4a16_linear, ops.w8a16_linear
    rng = np.random.default_rng(0)
    results = []
    for n, k in shapes:
        copies = max(2, -(-2 * llc // (n * k // 256 * BLOCK_BYTES)))
        files = [random_q4k(n, k, rng) for _ in range(copies)]
        generator = torch.Generator().manual_seed(n * k)
        held = {"q4k": [q4k_of(b, n, k) for b in files],
                "q4k-x8": [decode_layout(*q4k_of(b, n, k)) for b in files],
                "w4a8-g32": [cpu_int4_of(b, n, k) for b in files],
                "w4a8-x8": [avx2_int4.decode_layout(*cpu_int4_of(b, n, k), 8) for b in files],
                "w4a16-g32": [cpu_int4_of(b, n, k) for b in files],
                "int8-g16": [(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator),
                              torch.rand(n, k // 16, generator=generator) * 1e-3) for _ in files],
                "q6k-x8": [(q6k.decode_layout(*q6k.from_blocks(random_q6k(n, k, rng))),) for _ in files],
                **{f"{t.lower()}-x8": [(g32.decode_layout(t, *g32.from_blocks(t, random_g32(t, n, k, rng))),)
                                       for _ in files] for t in g32.KINDS}}  # fmt: skip
        nbytes = {variant: sum(t.nbytes for t in held[variant][0]) for variant in held}
        buffer = torch.ones(copies * files[0].nbytes // 4, dtype=torch.float32)
        del files
        for m in rows:
            x = torch.randn(m, k, dtype=torch.float32).to(torch.bfloat16)
            calls = {
                "q4k": lambda i, x=x, h=held["q4k"]: q4k(x, *h[i % len(h)]),
                "q4k-x8": lambda i, x=x, h=held["q4k-x8"]: q4k(x, *h[i % len(h)]),
                "w4a8-g32": lambda i, x=x, h=held["w4a8-g32"]: w4a8(x, *h[i % len(h)], 32),
                "w4a8-x8": lambda i, x=x, h=held["w4a8-x8"]: w4a8(x, *h[i % len(h)], 32),
                "w4a16-g32": lambda i, x=x, h=held["w4a16-g32"]: w4a16(x, *h[i % len(h)], 32),
                "int8-g16": lambda i, x=x, h=held["int8-g16"]: w8a16(x, *h[i % len(h)]),
                "q6k-x8": lambda i, x=x, h=held["q6k-x8"]: ops.q6k_linear(x, *h[i % len(h)]),
                "q8_0-x8": lambda i, x=x, h=held["q8_0-x8"]: ops.g32_linear(x, *h[i % len(h)], 8),
                "q5_0-x8": lambda i, x=x, h=held["q5_0-x8"]: ops.g32_linear(x, *h[i % len(h)], 5),
                "read": lambda i, b=buffer: reader.read_seconds(b, 256, 1),
            }
            for call in calls.values():  # warm up
                call(0), call(1)
            samples = {v: [] for v in VARIANTS}
            for i in range(rounds):
                for variant in VARIANTS[i % len(VARIANTS) :] + VARIANTS[: i % len(VARIANTS)]:
                    begin = time.perf_counter_ns()
                    calls[variant](i)
                    samples[variant].append(time.perf_counter_ns() - begin)
            read_gb_s = buffer.nbytes / statistics.median(samples["read"])  # bytes per ns = GB/s
            row = {"n": n, "k": k, "m": m, "read_gb_s": round(read_gb_s, 2)}
            for variant in KERNELS:
                ms = statistics.median(samples[variant]) / 1e6
                gb_s = nbytes[variant] / ms / 1e6
                row[variant] = {"ms": round(ms, 4), "bytes": nbytes[variant], "gb_s": round(gb_s, 2),
                                "of_bound": round(gb_s / read_gb_s, 3)}  # fmt: skip
            row["time_q4k_over_w4a8"] = round(row["q4k"]["ms"] / row["w4a8-g32"]["ms"], 3)
            row["time_q4k_x8_over_w4a8_x8"] = round(row["q4k-x8"]["ms"] / row["w4a8-x8"]["ms"], 3)
            row["time_q6k_x8_over_int8_g16"] = round(row["q6k-x8"]["ms"] / row["int8-g16"]["ms"], 3)
            for t in ("q8_0", "q5_0"):
                row[f"time_{t}_x8_over_int8_g16"] = round(row[f"{t}-x8"]["ms"] / row["int8-g16"]["ms"], 3)
            results.append(row)
    build = "plain AVX2" if not torch.ops.edge_avx2.uses_vnni() else "VNNI (AVX-VNNI or AVX512-VNNI, 256-bit)"
    return {"build": build, "llc_bytes": llc, "results": results}


def table(runs: dict) -> str:
    from edge.device.cpuinfo import host_model_name

    lines = [
        f"CPU: {host_model_name()}; 1 thread; bytes: q4k and q4k-x8 4.5 bits a weight, w4a8/w4a16-g32 and w4a8-x8 5, "
        "q6k-x8 6.5625, q8_0-x8 8.5, q5_0-x8 5.5, int8-g16 10",
        "",
        "| build | N x K | M | read GB/s | q4k ms (GB/s, of bound) | w4a8-g32 ms (GB/s, of bound) | q4k / w4a8 time "
        "| w4a8-x8 ms (GB/s, of bound) | x8 / w4a8 time | q4k-x8 ms (GB/s, of bound) | q4k-x8 / w4a8-x8 time "
        "| w4a16-g32 ms (GB/s, of bound) | int8-g16 ms (GB/s, of bound) | q6k-x8 ms (GB/s, of bound) "
        "| q6k-x8 / int8-g16 time | q8_0-x8 ms (GB/s, of bound) | q8_0-x8 / int8-g16 time "
        "| q5_0-x8 ms (GB/s, of bound) | q5_0-x8 / int8-g16 time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, run in runs.items():
        for r in run["results"]:
            a, b, c = r["q4k"], r["w4a8-g32"], r["int8-g16"]
            cell = "{ms:.3f} ({gb_s:.1f}, {of_bound:.0%})".format
            lines.append(
                f"| {label} ({run['build']}) | {r['n']}x{r['k']} | {r['m']} | {r['read_gb_s']:.1f} | "
                f"{cell(**a)} | {cell(**b)} | {r['time_q4k_over_w4a8']:.2f}x | {cell(**r['w4a8-x8'])} | "
                f"{r['w4a8-x8']['ms'] / b['ms']:.2f}x | {cell(**r['q4k-x8'])} | {r['time_q4k_x8_over_w4a8_x8']:.2f}x | "
                f"{cell(**r['w4a16-g32'])} | {cell(**c)} | {cell(**r['q6k-x8'])} | "
                f"{r['time_q6k_x8_over_int8_g16']:.2f}x | {cell(**r['q8_0-x8'])} | "
                f"{r['time_q8_0_x8_over_int8_g16']:.2f}x | {cell(**r['q5_0-x8'])} | "
                f"{r['time_q5_0_x8_over_int8_g16']:.2f}x |"
            )
    return "\n".join(lines)


def prefetch_table(passes: dict[str, list[dict]]) -> str:
    from edge.device.cpuinfo import host_model_name

    lines = [
        f"CPU: {host_model_name()}; 1 thread; {len(passes['l2'])} passes a hint; fraction of the read bound, median",
        "",
        "| N x K | M | kernel | L1 hint | L2 hint | time L2 / L1 |",
        "|---|---|---|---|---|---|",
    ]
    first = passes["l2"][0]["results"]
    for i, r in enumerate(first):
        for kernel in KERNELS:
            cell = {h: [run["results"][i][kernel] for run in runs] for h, runs in passes.items()}
            bound = {h: statistics.median(c["of_bound"] for c in cells) for h, cells in cell.items()}
            ms = {h: statistics.median(c["ms"] for c in cells) for h, cells in cell.items()}
            lines.append(f"| {r['n']}x{r['k']} | {r['m']} | {kernel} | {bound['l1']:.0%} | {bound['l2']:.0%} | "
                         f"{ms['l2'] / ms['l1']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--rows", default="1")
    parser.add_argument("--shapes", help="NxK,... instead of a ~1B's linears and 4096x4096")
    parser.add_argument("--json", help="also write the runs here")
    parser.add_argument("--prefetch", action="store_true", help="compare the AVX2 kernels' prefetch hints (L1, L2)")
    parser.add_argument("--passes", type=int, default=3, help="with --prefetch: processes a hint, alternating")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    if args.child:
        print(json.dumps(measure(args.rounds, rows, shapes)))
        return 0
    command = [sys.executable, "-m", "benchmarks.gguf_grids", "--child", "--rounds", str(args.rounds),
               "--rows", args.rows, *(["--shapes", args.shapes] if args.shapes else [])]  # fmt: skip

    def child(extra: dict) -> dict:
        done = subprocess.run(command, env={**os.environ, **extra}, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    if args.prefetch:
        passes = {"l1": [], "l2": []}
        for i in range(args.passes):
            for hint in ("l1", "l2") if i % 2 == 0 else ("l2", "l1"):
                passes[hint].append(child({"EDGE_AVX2_PREFETCH": hint}))
        if args.json:
            Path(args.json).write_text(json.dumps(passes, indent=1) + "\n")
        print(prefetch_table(passes))
        return 0
    runs = {label: child(extra) for label, extra in (("native", {}), ("avx2", {"EDGE_AVX2_VNNI": "0"}))}
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1) + "\n")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
