"""Time one candidate kernel (edge.kernel_registry) on this host: the child process edge-calibrate runs per kernel.

    python -m kernels.calibrate.calibration_timers KERNEL --shapes NxK,... --rows 1,4,... --group G --threads T --llc
    BYTES python -m kernels.calibrate.calibration_timers host --threads T --llc BYTES

prints one JSON object on stdout: a KernelResult (edge.calibration) for a kernel; for `host`, what the record says
about the runtime (torch's and vLLM's versions, the native library vLLM loaded, torch's CPU capability, the
last-level cache and the read bandwidth). Everything else (vLLM's log lines too) goes to stderr.

Per shape [N, K] the timer builds random weights in the kernel's own format (TIMERS), then per M rows of bf16
activations [M, K]:
- checks the result against the fp32 weights the format stands for (a sample of rows and output channels; relative
  error bound CHECK_BOUND, wider for kernels that quantize activations): a kernel that runs but computes wrong
  numbers is "failed", never timed;
- warms up, then takes the median of at least MIN_CALLS calls (more for fast calls, until the time per point is
  spent), each call on the next of enough weight copies that together exceed 2x the last-level cache: a decode
  call streams its weight from memory as in serving, never from a cache the previous call filled.
Before timing, glibc's malloc is put in a long-running process's state (settle_allocator), so a dequantize path's
temporaries cost what they cost in the engine, not what the shapes timed before left behind.
Clock: the calling thread's CPU time at 1 thread (torch, oneDNN and vLLM's OpenMP loops run inline on it; other
jobs sharing the cores do not inflate it), wall time with more threads.

A kernel whose op the loaded library lacks is "absent" (the reason names the library and the op). The test hook
EDGE_CALIBRATE_TEST_HOOK_CRASH=KERNEL makes the child kill itself with SIGILL when asked to time KERNEL, as an
illegal instruction would: tests check the parent records it as crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edge.kernel_registry import KERNELS
from kernels.ops.gptq import dequantize_gptq, gptq_tensors
from kernels.ops.int4 import dequantize, quantize_packed
from kernels.ops.int8 import dequantize_int8, quantize_int8
from kernels.ops.layout import host_layout
from kernels.ops.tinygemm import dequantize_tinygemm, tiles, to_tinygemm
from kernels.ops.tinygemm import linear as tinygemm_linear

TEST_CRASH_HOOK = "EDGE_CALIBRATE_TEST_HOOK_CRASH"  # test-only: the kernel whose child dies of SIGILL
FALLBACK_LLC_BYTES = 32 << 20
MIN_CALLS = 5
MAX_CALLS = 200
SECONDS_PER_POINT = 0.1  # timed calls per (shape, M) continue past MIN_CALLS until this is spent
WARMUP_CALLS = 2
CHECK_BOUND = {False: 0.01, True: 0.05}  # relative error vs the fp32 reference, by quantizes_activations
CHECK_ROWS, CHECK_COLUMNS = 4, 512  # the sample of the output compared against the reference
HOST = "host"

Run = Callable[[torch.Tensor], torch.Tensor]  # x bf16 [M, K] -> y [M, N]


@dataclass
class Weights:
    """One layer's weights in a kernel's format."""

    reference: torch.Tensor  # fp32 [N, K]: the weights the stored format stands for
    nbytes: int  # bytes of one copy: what a decode call streams from memory
    copy: Callable[[], Run]  # a fresh copy at other addresses, ready to run


@dataclass
class Outcome:
    status: str = "ok"
    reason: str | None = None
    times: list[dict] = field(default_factory=list)


class Absent(Exception):
    """The loaded library has no such op."""


class Failed(Exception):
    """The kernel raised or computed wrong numbers at one point (the message says where)."""


# --- one builder per kernel: fp32 weights [N, K] and a group size -> Weights --------------------------------


def _bf16(w: torch.Tensor, group: int) -> Weights:
    weight = w.to(torch.bfloat16)  # [N, K]

    def copy() -> Run:
        held = weight.clone()
        return lambda x: torch.nn.functional.linear(x, held)

    return Weights(weight.float(), weight.nbytes, copy)


def _int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    qweight, scales, zeros = quantize_packed(w, group)  # [N, K/2] uint8, [N, K/g] bf16 x2
    packed, scales_and_zeros = to_tinygemm(qweight, scales, zeros, group)  # [N, K/2] host layout, [K/g, N, 2]
    return qweight, scales, zeros, packed, scales_and_zeros


def _tinygemm(w: torch.Tensor, group: int) -> Weights:
    qweight, scales, zeros, packed, scales_and_zeros = _int4(w, group)

    def copy() -> Run:
        held, held_sz = packed.clone(), scales_and_zeros.clone()
        return lambda x: tinygemm_linear(x, held, held_sz, group)

    reference = dequantize(qweight, scales, zeros, group, torch.float32)
    return Weights(reference, packed.nbytes + scales_and_zeros.nbytes, copy)


def _avx2_kernel(act_bits: int) -> Callable[[torch.Tensor, int], Weights]:
    """An AVX2 int4 kernel on the row-major checkpoint tensors, activations rounded to act_bits (built on first
    use; absent without a compiler or AVX2/FMA)."""

    def build(w: torch.Tensor, group: int) -> Weights:
        from kernels.ops import avx2_int4

        reason = avx2_int4.load()
        if reason:
            raise Absent(reason)
        qweight, scales, zeros = quantize_packed(w, group)  # [N, K/2] uint8, [N, K/g] bf16 x2

        def copy() -> Run:
            held = [t.clone() for t in (qweight, scales, zeros)]
            return lambda x: avx2_int4.linear(x, *held, group, act_bits)

        reference = dequantize(qweight, scales, zeros, group, torch.float32)
        return Weights(reference, qweight.nbytes + scales.nbytes + zeros.nbytes, copy)

    return build


def _dequantized_gemm(dtype: torch.dtype) -> Callable[[torch.Tensor, int], Weights]:
    """The wide-batch branch of kernels.ops.int4_ops.int4_linear_impl: dequantize to `dtype`, GEMM, back to bf16;
    straight from the tinygemm buffer when N tiles the host block (DIRECT), else from the row-major copy (DUAL)."""

    def build(w: torch.Tensor, group: int) -> Weights:
        qweight, scales, zeros, packed, scales_and_zeros = _int4(w, group)
        layout = host_layout()
        direct = tiles(w.shape[0], layout)
        held = (packed, scales_and_zeros) if direct else (qweight, scales, zeros)

        def copy() -> Run:
            mine = [t.clone() for t in held]
            if direct:
                return lambda x: torch.mm(x.to(dtype), dequantize_tinygemm(*mine, group, layout, dtype).t()).to(
                    torch.bfloat16
                )
            return lambda x: torch.mm(x.to(dtype), dequantize(*mine, group, dtype).t()).to(torch.bfloat16)

        reference = dequantize(qweight, scales, zeros, group, torch.float32)
        return Weights(reference, sum(t.nbytes for t in held), copy)

    return build


def _int8(w: torch.Tensor, group: int) -> Weights:
    qweight, scales = quantize_int8(w)  # [N, K] int8, [N] bf16

    def copy() -> Run:
        held = qweight.clone()
        # torch 2.13's AVX-512 kernel segfaults on int8 weights not 64-byte aligned (kernels/ops/int4_ops.py); torch's
        # allocator aligns to 64, so a clone always is.
        assert held.data_ptr() % 64 == 0, "an unaligned int8 weight would crash _weight_int8pack_mm"
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, held, scales)

    return Weights(dequantize_int8(qweight, scales, torch.float32), qweight.nbytes + scales.nbytes, copy)


def _avx2_int8(w: torch.Tensor, group: int) -> Weights:
    """The AVX2 int8-weight kernel on the 8-bit set's format (built on first use; absent as _avx2_kernel)."""
    from kernels.ops import avx2_int4

    reason = avx2_int4.load()
    if reason:
        raise Absent(reason)
    qweight, scales = quantize_int8(w)  # [N, K] int8, [N] bf16

    def copy() -> Run:
        held = qweight.clone()
        return lambda x: avx2_int4.int8_linear(x, held, scales)

    return Weights(dequantize_int8(qweight, scales, torch.float32), qweight.nbytes + scales.nbytes, copy)


def _vllm_ops(*names: str):
    """vLLM's op wrappers, after vLLM loaded its native library; Absent naming the library and the missing op."""
    try:
        from vllm import _custom_ops as ops
    except ImportError as err:
        raise Absent(f"vLLM is not importable ({err})") from None
    library = native_library() or "vLLM's native library"
    for name in names:
        if not hasattr(torch.ops._C, name):
            raise Absent(f"{library} registers no {name}")
    return ops


def _gptq(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The project's symmetric GPTQ export (kernels.ops.gptq): qweight int32 [K/8, N], scales bf16 [K/g, N], and the
    fp32 weights they stand for."""
    tensors = gptq_tensors("w", w, group, search=False, scale_dtype=torch.bfloat16)
    return tensors["w.qweight"], tensors["w.scales"], dequantize_gptq(tensors, group)


def _isa_hint() -> str:
    """vLLM 0.28 mixed_precision/cpu.py _get_isa_hint for bf16 scales (importing that module costs 1.8 s)."""
    if torch.cpu._is_amx_tile_supported():
        return "amx"
    return "rvv" if platform.machine().startswith("riscv") else "vec"


def _vllm_wna16(w: torch.Tensor, group: int) -> Weights:
    ops = _vllm_ops("cpu_gemm_wna16")
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        pack_quantized_values_into_int32,
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    qweight, scales, reference = _gptq(w, group)
    k = qweight.shape[0] * 8
    # vLLM 0.28 CPUWNA16LinearKernel._process_gptq_weights_w4a16: repack along N, blocks of 16 channels k-major.
    codes = unpack_quantized_values_into_int32(qweight, scalar_types.uint4b8, 0)  # [K, N] int32
    weight = pack_quantized_values_into_int32(codes, scalar_types.uint4b8, 1)  # [K, N/8]
    weight = weight.view(k, -1, 2).permute(1, 0, 2).reshape(-1, k * 2).contiguous()  # [N/16, 2K] int32
    hint = _isa_hint()

    def copy() -> Run:
        held, held_scales = weight.clone(), scales.clone()
        return lambda x: ops.cpu_gemm_wna16(x, held, held_scales, None, None, None, 8, hint)

    return Weights(reference, weight.nbytes + scales.nbytes, copy)


_W4A8_ZERO = -2004318072  # 0x88888888: zero 8 in every nibble, what vLLM substitutes for a symmetric GPTQ weight
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _vllm_w4a8(w: torch.Tensor, group: int) -> Weights:
    ops = _vllm_ops("convert_weight_packed_scale_zp", "int4_scaled_mm_cpu", "dynamic_scaled_int8_quant")
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        pack_quantized_values_into_int32,
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    qweight, scales, reference = _gptq(w, group)
    n, k = w.shape
    # vLLM 0.28 CPUWNA16LinearKernel._process_gptq_weights_w4a8: GPTQ repacked as AWQ, then blocked by the op.
    codes = unpack_quantized_values_into_int32(qweight, scalar_types.uint4b8, 0)  # [K, N]
    codes = codes.view(k, n // 8, 8)[:, :, _AWQ_ORDER].reshape(k, n)
    awq = pack_quantized_values_into_int32(codes, scalar_types.uint4b8, 1).contiguous()  # [K, N/8]
    zeros = torch.full((scales.shape[0], n // 8), _W4A8_ZERO, dtype=torch.int32)  # [K/g, N/8]
    blocked = ops.convert_weight_packed_scale_zp(awq, zeros, scales, ops.CPUQuantAlgo.AWQ)  # weight, zeros, scales

    def copy() -> Run:
        held_w, held_z, held_s = (t.clone() for t in blocked)
        return lambda x: ops.int4_scaled_mm_cpu(x, held_w, held_z, held_s, None)

    return Weights(reference, sum(t.nbytes for t in blocked), copy)


def _onednn_int8(w: torch.Tensor, group: int) -> Weights:
    ops = _vllm_ops("create_onednn_scaled_mm_handler", "dynamic_scaled_int8_quant", "onednn_scaled_mm")
    qweight, scales = quantize_int8(w)  # [N, K] int8, [N] bf16
    # vLLM 0.28 CPUInt8ScaledMMLinearKernel.process_weights_for_onednn, dynamic per-token symmetric activations.
    weight = qweight.t()  # [K, N] view
    channel_scales = scales.float().view(-1, 1)  # [N, 1] fp32
    azp_adj = weight.sum(dim=0, keepdim=True, dtype=torch.float32) * channel_scales.squeeze()  # [1, N]

    def copy() -> Run:
        handler = ops.create_onednn_scaled_mm(weight, channel_scales, torch.bfloat16, True, False, 32)

        # The handler copies the weight but keeps a pointer to the scales: freed, they gave inf and NaN here
        # (measured 2026-11-30). The default argument keeps them alive as long as the closure.
        def run(x: torch.Tensor, _scales: torch.Tensor = channel_scales) -> torch.Tensor:
            x_q, x_scales, x_zp = ops.onednn_scaled_int8_quant(x, None, None, True)
            out = torch.empty(x.shape[0], handler.n, dtype=torch.bfloat16)
            return ops.onednn_scaled_mm(handler, x_q, out, x_scales, x_zp, azp_adj, None)

        return run

    return Weights(dequantize_int8(qweight, scales, torch.float32), qweight.nbytes, copy)


TIMERS: dict[str, Callable[[torch.Tensor, int], Weights]] = {
    "bf16": _bf16,
    "tinygemm": _tinygemm,
    "avx2-int4": _avx2_kernel(KERNELS["avx2-int4"].activation_bits),
    "avx2-w4a8": _avx2_kernel(KERNELS["avx2-w4a8"].activation_bits),
    "dequant-bf16": _dequantized_gemm(torch.bfloat16),
    "dequant-fp32": _dequantized_gemm(torch.float32),
    "int8": _int8,
    "avx2-int8": _avx2_int8,
    "vllm-wna16": _vllm_wna16,
    "vllm-w4a8": _vllm_w4a8,
    "onednn-int8": _onednn_int8,
}
_TORCH_OPS = {"tinygemm": ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"),
              "dequant-bf16": ("_convert_weight_to_int4pack_for_cpu",),
              "dequant-fp32": ("_convert_weight_to_int4pack_for_cpu",),
              "int8": ("_weight_int8pack_mm",)}  # fmt: skip


def _cannot_hold(kernel: str, n: int, k: int, group: int) -> str | None:
    """Why the kernel's weight format cannot store an [N, K] weight at this group, or None."""
    fmt = KERNELS[kernel].weight_format
    if fmt == "int4-tinygemm" and (n % 16 or k % group):
        return f"{n}x{k}: tinygemm packs N in multiples of 16 and K in whole groups of {group}"
    if fmt == "int4-rowmajor" and k % group:
        return f"{n}x{k}: K in whole groups of {group}"
    multiple = KERNELS[kernel].k_multiple
    if multiple and k % multiple:
        return f"{n}x{k}: {kernel} rounds activations in groups of {multiple} along K"
    if fmt == "int4-gptq" and (n % 32 or k % 32 or k % group):
        return f"{n}x{k}: vLLM's GPTQ kernels need N and K multiples of 32 and K in whole groups of {group}"
    return None


# --- timing ----------------------------------------------------------------------------------------------------


def settle_allocator() -> None:
    """Put glibc's malloc in the state a long-running engine reaches: its mmap threshold follows the largest
    freed mmapped block, up to 32 MiB. A fresh child sits at 128 KiB, and whether a dequantize path's temporaries
    come back as fresh pages on every call then depends on which shapes ran before: 3072x576 dequant-bf16 took
    4.0 ms (1800 page faults per call) after 960x576 and 1.2 ms (none) alone, 1 thread, this host, 2026-11-30.
    Freeing one block just under the maximum pins the threshold there (blocks above it always fault)."""
    block = torch.empty((32 << 20) - (64 << 10), dtype=torch.uint8)
    del block


def _clock(threads: int) -> Callable[[], int]:
    return time.thread_time_ns if threads == 1 else time.perf_counter_ns


def rotation(weights: Weights, llc_bytes: int) -> list[Run]:
    """Enough copies of the weights that together they exceed 2x the last-level cache (at least two)."""
    count = max(2, 2 * llc_bytes // max(1, weights.nbytes) + 1)
    return [weights.copy() for _ in range(count)]


def check(y: torch.Tensor, x: torch.Tensor, reference: torch.Tensor, bound: float) -> str | None:
    """None when y [M, N] agrees with x @ reference.T on a sample of rows and output channels, else why not."""
    n = reference.shape[0]
    if tuple(y.shape) != (x.shape[0], n):
        return f"output shape {tuple(y.shape)}, expected {(x.shape[0], n)}"
    columns = torch.randperm(n, generator=torch.Generator().manual_seed(n))[:CHECK_COLUMNS]
    want = x[:CHECK_ROWS].float() @ reference[columns].t()  # [rows, cols]
    got = y[:CHECK_ROWS, columns].float()
    error = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
    if not error <= bound:  # NaN fails too
        return f"relative error {error:.3g} against the dequantized fp32 reference (bound {bound})"
    return None


def time_point(runs: list[Run], x: torch.Tensor, clock: Callable[[], int], seconds: float, start: int = 0
               ) -> tuple[float, int]:  # fmt: skip
    """Median ms of calls on x, each on the next copy in `runs`; (ms, calls)."""
    samples: list[int] = []
    spent, i = 0, start
    while len(samples) < MIN_CALLS or (spent < seconds * 1e9 and len(samples) < MAX_CALLS):
        run = runs[i % len(runs)]
        i += 1
        begin = clock()
        run(x)
        elapsed = clock() - begin
        samples.append(elapsed)
        spent += elapsed
    return max(statistics.median(samples) / 1e6, 1e-6), len(samples)


def _time_shape(kernel: str, n: int, k: int, rows: list[int], group: int, llc_bytes: int, threads: int,
                seconds: float) -> list[dict]:  # fmt: skip
    """Times of one shape at every M; Failed, saying where, when a call raises or disagrees with the reference.

    The weights and their copies are built at 1 thread: at 2 on a 2-core box another job kept busy, every
    parallel clone waited a time slice for its second thread (the 2-thread tinygemm child took 21 s, not 2)."""
    torch.set_num_threads(1)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * 7919 + k)) * 0.02  # [N, K] fp32
    weights = TIMERS[kernel](w, group)
    del w
    runs = rotation(weights, llc_bytes)
    torch.set_num_threads(threads)
    clock = _clock(threads)
    bound = CHECK_BOUND[KERNELS[kernel].quantizes_activations]
    times = []
    for m in rows:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)  # [M, K]
        try:
            wrong = check(runs[0](x), x, weights.reference, bound)
            if wrong is None:
                for i in range(1, WARMUP_CALLS):
                    runs[i % len(runs)](x)
                ms, calls = time_point(runs, x, clock, seconds, start=WARMUP_CALLS)
        except RuntimeError as err:  # what a native op raises (TORCH_CHECK, oneDNN)
            raise Failed(f"{n}x{k} M={m}: {_first_line(err)}") from err
        if wrong is not None:
            raise Failed(f"wrong results at {n}x{k} M={m}: {wrong}")
        times.append({"n": n, "k": k, "m": m, "ms": ms, "calls": calls})
    return times


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def time_kernel(kernel: str, shapes: list[tuple[int, int]], rows: list[int], group: int, threads: int,
                llc_bytes: int, *, narrow_shapes: frozenset = frozenset(), narrow_rows: int = 16,
                seconds: float = SECONDS_PER_POINT) -> Outcome:  # fmt: skip
    """Time `kernel` at every shape and M (shapes in narrow_shapes only at M <= narrow_rows: the head)."""
    if os.environ.get(TEST_CRASH_HOOK) == kernel:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file for a deliberate crash
        os.kill(os.getpid(), signal.SIGILL)
    missing = [op for op in _TORCH_OPS.get(kernel, ()) if not hasattr(torch.ops.aten, op)]
    if missing:
        return Outcome("absent", f"torch {torch.__version__} registers no aten::{missing[0]}")
    settle_allocator()
    outcome, skipped = Outcome(), []
    for n, k in shapes:
        why = _cannot_hold(kernel, n, k, group)
        if why:
            skipped.append(why)
            continue
        shape_rows = [m for m in rows if (n, k) not in narrow_shapes or m <= narrow_rows]
        try:
            outcome.times += _time_shape(kernel, n, k, shape_rows, group, llc_bytes, threads, seconds)
        except Absent as err:
            return Outcome("absent", str(err))
        except Failed as err:
            return Outcome("failed", str(err))
        except Exception as err:  # noqa: BLE001  (building the weights failed: this kernel's result, with where)
            return Outcome("failed", f"{n}x{k}: {_first_line(err)}")
    if skipped:
        outcome.reason = "not timed: " + "; ".join(skipped)
        if not outcome.times:
            outcome.status = "failed"
    return outcome


# --- host facts ------------------------------------------------------------------------------------------------


def last_level_cache_bytes(root: str | Path = "/") -> int:
    """The largest cache level of cpu0 (sysfs), or FALLBACK_LLC_BYTES when unreadable."""
    best: tuple[int, int] | None = None
    for index in sorted(Path(root, "sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = int((index / "level").read_text())
            size = _size_bytes((index / "size").read_text().strip())
        except (OSError, ValueError):
            continue
        if best is None or (level, size) > best:
            best = (level, size)
    return best[1] if best else FALLBACK_LLC_BYTES


def _size_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1:].upper() in units else int(text)


def native_library() -> str | None:
    """The file name stem of vLLM's native library mapped into this process (_C, _C_AVX512, _C_AVX2), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "/vllm/_C" in path and path.endswith(".so"):
            return Path(path).name.split(".")[0]
    return None


def read_bandwidth_gb_s(llc_bytes: int, threads: int, reads: int = 7) -> float:
    """GB/s of summing a float32 buffer larger than 4x the last-level cache, median of `reads`."""
    torch.set_num_threads(threads)
    buffer = torch.ones((4 * llc_bytes + (16 << 20)) // 4, dtype=torch.float32)
    clock = _clock(threads)
    buffer.sum()
    samples = []
    for _ in range(reads):
        begin = clock()
        buffer.sum()
        samples.append(clock() - begin)
    return buffer.nbytes / statistics.median(samples)  # bytes per ns = GB/s


def host_facts(threads: int, llc_bytes: int) -> dict:
    try:
        import vllm
        import vllm._custom_ops  # noqa: F401  (loads the native library vLLM picks for this CPU)

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = None
    return {
        "torch_version": torch.__version__,
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "vllm_version": vllm_version,
        "native_library": native_library(),
        "llc_bytes": llc_bytes,
        "read_bandwidth_gb_s": round(read_bandwidth_gb_s(llc_bytes, threads), 2),
    }


# --- command line ----------------------------------------------------------------------------------------------


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(n), int(k)) for n, k in (s.lower().split("x") for s in text.split(",") if s)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NxK,NxK,..., got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 1,4,16,..., got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kernels.calibrate.calibration_timers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kernel", choices=[*TIMERS, HOST])
    parser.add_argument("--shapes", type=_shapes, default=[], metavar="NxK,...")
    parser.add_argument(
        "--narrow-shapes",
        type=_shapes,
        default=[],
        metavar="NxK,...",
        help="shapes that see one row per sequence (the head): timed only at M <= 16",
    )
    parser.add_argument("--rows", type=_ints, default=[1], metavar="M,...")
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--llc", type=int, default=None, metavar="BYTES", help="default: read from sysfs")
    parser.add_argument("--seconds-per-point", type=float, default=SECONDS_PER_POINT)
    return parser  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The JSON object is the only thing on stdout: vLLM logs to stdout, so fd 1 points at stderr meanwhile.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    llc = args.llc or last_level_cache_bytes()
    if args.kernel == HOST:
        result: dict = host_facts(args.threads, llc)
    else:
        try:
            outcome = time_kernel(
                args.kernel,
                args.shapes,
                args.rows,
                args.group,
                args.threads,
                llc,
                narrow_shapes=frozenset(args.narrow_shapes),
                seconds=args.seconds_per_point,
            )
        except Exception as err:  # noqa: BLE001  (the child's boundary: any error is this kernel's result)
            outcome = Outcome("failed", _first_line(err))
        result = {"kernel": args.kernel, "status": outcome.status, "reason": outcome.reason, "times": outcome.times}
    out.write(json.dumps(result) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
