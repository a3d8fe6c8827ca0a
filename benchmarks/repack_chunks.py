"""How many output channels to repack at a time when building the tinygemm buffer (kernels.ops.tinygemm.to_tinygemm).

Repacking widens 4-bit codes to int32 (8x the packed size), so the chunk bounds the load-time transient; too
small a chunk pays per-call overhead. For each shape, every chunk size runs once per pass, passes interleave
(so drift and the neighbours' load hit all variants alike), and medians are reported:
  wall ms        wall-clock time of to_tinygemm
  cpu ms         CPU time of the whole process (all torch threads) over the call
  peak MiB       VmHWM growth over VmRSS just before the call (the high-water mark is reset through
                 /proc/self/clear_refs), minus the packed output itself: the transient the chunk costs.
                 The script re-executes itself with MALLOC_MMAP_THRESHOLD_=65536 so that every allocation
                 of 64 KiB or more is a fresh mapping, returned on free; otherwise glibc's retained heap
                 hides the transient (it read as negative here).
  ratio          wall ms / best wall ms for the shape

Default 1 torch thread: vLLM's worker runs 1 thread on this 2-core box (docs/FACTS.md), and OpenMP spinning
on shared cores inflates CPU time at 2.

    python benchmarks/repack_chunks.py [--passes 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from kernels.ops.layout import host_layout
from kernels.ops.tinygemm import to_tinygemm

SHAPES = [(49152, 576), (11008, 4096)]  # SmolLM2's tied embedding / head; a 7B-class MLP projection
CHUNKS = [256, 512, 1024, 2048, 4096, 8192, None]  # None: the whole matrix in one call
GROUP = 64
MMAP_THRESHOLD = "65536"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # "5" resets VmHWM to the current RSS (proc(5))


def run_once(qweight, scales, zeros, chunk_rows: int) -> tuple[float, float, float]:
    """One repack: (wall ms, process CPU ms, transient peak MiB above the packed output)."""
    _reset_high_water_mark()
    before = _status_kib("VmRSS")
    wall, cpu = time.perf_counter(), time.process_time()
    packed, interleaved = to_tinygemm(qweight, scales, zeros, GROUP, chunk_rows=chunk_rows)
    wall, cpu = (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3
    output_kib = (packed.numel() + interleaved.numel() * 2) / 1024
    peak_mib = (_status_kib("VmHWM") - before - output_kib) / 1024
    del packed, interleaved
    return wall, cpu, peak_mib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})
    torch.set_num_threads(args.threads)
    layout = host_layout()
    print(f"torch {torch.__version__}, {layout.cpu_capability}, block {layout.block}, {args.threads} threads, "
          f"group {GROUP}, median of {args.passes} interleaved passes, MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}")
    for n, k in SHAPES:
        generator = torch.Generator().manual_seed(0)
        qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
        scales = torch.rand(n, k // GROUP, generator=generator).to(torch.bfloat16)
        zeros = torch.rand(n, k // GROUP, generator=generator).to(torch.bfloat16)
        rows = {chunk: chunk or n for chunk in CHUNKS}
        samples: dict[int | None, list[tuple[float, float, float]]] = {chunk: [] for chunk in CHUNKS}
        run_once(qweight, scales, zeros, rows[CHUNKS[0]])  # warm-up
        for _ in range(args.passes):
            for chunk in CHUNKS:
                samples[chunk].append(run_once(qweight, scales, zeros, rows[chunk]))
        medians = {chunk: [statistics.median(s[i] for s in samples[chunk]) for i in range(3)] for chunk in CHUNKS}
        best = min(m[0] for m in medians.values())
        print(f"\n{n}x{k} (packed {n * k // 2 / 2**20:.1f} MiB, whole-matrix int32 {n * k * 4 / 2**20:.0f} MiB)")
        print("| chunk rows | wall ms | cpu ms | transient peak MiB | wall / best |")
        print("|---|---|---|---|---|")
        for chunk in CHUNKS:
            wall, cpu, peak = medians[chunk]
            label = str(chunk) if chunk else f"whole ({n})"
            print(f"| {label} | {wall:.1f} | {cpu:.1f} | {peak:.1f} | {wall / best:.2f} |")


if __name__ == "__main__":
    main()
