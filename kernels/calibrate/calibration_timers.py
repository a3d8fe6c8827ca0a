"""Time one candidate kernel (edge.catalog.kernel_registry) on this host: the child process edge-calibrate runs per
kernel.

    python -m kernels.calibrate.calibration_timers KERNEL --shapes NxK,... --rows 1,4,... --group G --threads T --llc
    BYTES python -m kernels.calibrate.calibration_timers host --threads T --llc BYTES

prints one JSON object on stdout: a KernelResult (edge.device.calibration) for a kernel; for `host`, what the record
says about the runtime (torch's and vLLM's versions, the native library vLLM loaded, torch's CPU capability, the
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
import resource
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edge.catalog.kernel_registry import KERNELS
from edge.formats import kernel_layout_format
from kernels.formats import timed_kernels, timer
from kernels.formats.common import Absent, Builder, Run, Weights, native_library

TEST_CRASH_HOOK = "EDGE_CALIBRATE_TEST_HOOK_CRASH"  # test-only: the kernel whose child dies of SIGILL
FALLBACK_LLC_BYTES = 32 << 20
MIN_CALLS = 5
MAX_CALLS = 200
SECONDS_PER_POINT = 0.1  # timed calls per (shape, M) continue past MIN_CALLS until this is spent
WARMUP_CALLS = 2
CHECK_BOUND = {False: 0.01, True: 0.05}  # relative error vs the fp32 reference, by quantizes_activations
CHECK_ROWS, CHECK_COLUMNS = 4, 512  # the sample of the output compared against the reference
HOST = "host"


@dataclass
class Outcome:
    status: str = "ok"
    reason: str | None = None
    times: list[dict] = field(default_factory=list)


class Failed(Exception):
    """The kernel raised or computed wrong numbers at one point (the message says where)."""


TIMERS: dict[str, Builder] = {name: timer(name) for name in timed_kernels()}  # by kernel, kernels.formats
_TORCH_OPS = {"tinygemm": ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"),
              "dequant-bf16": ("_convert_weight_to_int4pack_for_cpu",),
              "dequant-fp32": ("_convert_weight_to_int4pack_for_cpu",),
              "int8": ("_weight_int8pack_mm",)}  # fmt: skip


def _cannot_hold(kernel: str, n: int, k: int, group: int) -> str | None:
    """Why the kernel's weight format cannot store an [N, K] weight at this group, or None."""
    spec = KERNELS[kernel]
    why = kernel_layout_format(spec.weight_format).cannot_hold(spec.weight_format, n, k, group)
    if why:
        return why
    if spec.k_multiple and k % spec.k_multiple:
        return f"{n}x{k}: {kernel} rounds activations in groups of {spec.k_multiple} along K"
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
