"""What one decode-row call of a cpu_int4 layer costs through each door to the AVX2 kernel, at a layer of the default
model (576x576, group 32, int8 activations, 1 row, weights cache-hot so the call's fixed cost shows).

    python benchmarks/op_call_cost.py [--rounds 15] [--calls 2000]

Doors, from the kernel outwards:
    kernel op             torch.ops.edge_avx2.w4a8_linear.default: the kernel alone, as C++ calls it
    python op             torch.ops.vllm.cpu_int4_linear (kernels/ops/int4_ops.py int4_linear_impl, a Python op): what a
                          layer without avx2_rows calls, and what wide batches reach
    c++ front op          torch.ops.edge_avx2.int4_linear.default: what a layer with avx2_rows calls
                          (kernels/int4_ops.int4_linear); decode rows never enter Python
A decode step of the default model makes 120 of these calls (30 layers x qkv, o, gate_up, down). Doors are
interleaved round by round (each round: 200 warm-up calls, then `calls` timed calls per door); medians over rounds,
in microseconds per call, 1 torch thread. The CPU and torch's dispatch capability are printed with the numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from edge.device.probe import probe
    from kernels.ops import avx2_int4, int4_ops
    from kernels.ops.int4 import quantize_packed
    from kernels.ops.tinygemm import to_tinygemm

    reason = avx2_int4.load()
    if reason:
        raise SystemExit(f"the AVX2 kernel does not run here: {reason}")
    n = k = 576
    group = 32
    qweight, scales, zeros = quantize_packed(torch.randn(n, k), group)
    packed, scales_and_zeros = to_tinygemm(qweight, scales, zeros, group)
    x = torch.randn(1, k).to(torch.bfloat16)
    layer = (x, packed, scales_and_zeros, qweight, scales, zeros, group, int4_ops.DIRECT, 128, False, 4, 8)
    doors = {
        "kernel op": lambda: torch.ops.edge_avx2.w4a8_linear.default(x, qweight, scales, zeros, group),
        "python op": lambda: torch.ops.vllm.cpu_int4_linear.default(*layer),
        "c++ front op": lambda: torch.ops.edge_avx2.int4_linear.default(*layer),
    }
    times: dict[str, list[float]] = {name: [] for name in doors}
    for _ in range(args.rounds):
        for name, call in doors.items():
            for _ in range(200):
                call()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    device = probe(measure_layout=False)
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    vnni = "AVX-VNNI build" if torch.ops.edge_avx2.uses_vnni() else "plain AVX2 build"
    print(f"{device.cpu_model.value} ({device.isa_class}); torch dispatch {capability}; kernel {vnni}; 1 thread")
    base = statistics.median(times["kernel op"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:14s} {median:6.2f} us/call  (+{median - base:5.2f} over the kernel op)")


if __name__ == "__main__":
    main()
