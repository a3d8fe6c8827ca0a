"""The read bound of a decode step on this host (issue 42): GB/s of reading a buffer far larger than the last-level
cache, with 256-bit (AVX2) and, where the CPU has AVX-512, 512-bit loads, on one thread and on every core.

    .venv/bin/python -m benchmarks.read_bandwidth [--rounds 9] [--mib 1024] [--json OUT]

The variants run interleaved: each round reads the buffer once per (width, threads), in an order rotated each round
(a shared VM's rate drifts by the minute), after one warm-up read each. Reported: the median GB/s of each variant
over the rounds with its q1-q3, and per thread count the width that was fastest here (measured, not assumed: on the
Zen 4 VM wider loads were slower). A decode step cannot read its weights faster than this: bytes per token x tok/s
/ this rate is a variant's fraction of the bound (bench_serve). The loop is benchmarks/read_bandwidth.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
from torch.utils import cpp_extension

from edge.device.cpuinfo import host_model_name

HERE = Path(__file__).parent
BUILD = HERE.parent / ".cache" / "read_bandwidth"


def extension():
    BUILD.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name="edge_read_bandwidth", sources=[str(HERE / "read_bandwidth.cpp")],
                              extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
                              build_directory=str(BUILD), verbose=False)  # fmt: skip


def widths() -> list[int]:
    flags = Path("/proc/cpuinfo").read_text().split()
    return [256] + ([512] if "avx512f" in flags else [])


def measure(rounds: int, mib: int) -> dict:
    ext = extension()
    buffer = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    cores = len(os.sched_getaffinity(0))
    variants = [(width, threads) for threads in sorted({1, cores}) for width in widths()]
    for width, threads in variants:  # warm-up: page the buffer in, start the OpenMP team
        ext.read_seconds(buffer, width, threads)
    rates: dict[tuple[int, int], list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for width, threads in variants[r % len(variants):] + variants[: r % len(variants)]:
            rates[(width, threads)].append(buffer.nbytes / ext.read_seconds(buffer, width, threads) / 1e9)
    results = []
    for (width, threads), samples in rates.items():
        q = statistics.quantiles(samples, n=4)
        results.append({"width_bits": width, "threads": threads, "gb_s": statistics.median(samples),
                        "q1": q[0], "q3": q[2], "samples": samples})  # fmt: skip
    best = {t: max((r for r in results if r["threads"] == t), key=lambda r: r["gb_s"]) for t in {1, cores}}
    return {"cpu": host_model_name(), "cores": cores, "buffer_mib": mib, "rounds": rounds, "results": results,
            "best": {str(t): {"width_bits": b["width_bits"], "gb_s": b["gb_s"]} for t, b in sorted(best.items())}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="read_bandwidth", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--mib", type=int, default=1024, help="buffer size (default 1 GiB: far above any LLC here)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report = measure(args.rounds, args.mib)
    print(f"{report['cpu']}, {report['cores']} cores, {args.mib} MiB buffer, {args.rounds} interleaved rounds")
    print("| loads | threads | GB/s (median) | q1-q3 |\n|---|---|---|---|")
    for r in report["results"]:
        print(f"| {r['width_bits']}-bit | {r['threads']} | {r['gb_s']:.1f} | {r['q1']:.1f}-{r['q3']:.1f} |")
    for threads, best in report["best"].items():
        print(f"fastest on {threads} thread(s): {best['width_bits']}-bit loads, {best['gb_s']:.1f} GB/s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
