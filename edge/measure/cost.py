"""The cost model: what one request costs each option, from a calibration record's kernel times.

A request is a prompt prefill (PROMPT_TOKENS rows through every linear) plus NEW_TOKENS decode steps (one row per
sequence), as vLLM runs them: q/k/v fused into qkv_proj, gate/up into gate_up_proj, and the head applied only to
the last row of each sequence (logits are computed for sampled positions only). With max_num_seqs > 1 the decode
steps are batched: `batch` sequences share each step, so the request's share of a step is cost(M=batch) / batch.

Each linear runs the kernel its format and the option say (edge.catalog.kernel_registry): int4 layers the path's own
kernels (below the dequant threshold the decode kernel, from it the prefill kernel), int8 layers the int8 kernel
(per group: the AVX2 one) below the threshold and a dequantize + bf16 GEMM from it, bf16 layers the bf16 GEMM.
Times come from the record at the exact shape and M when measured; between measured M they are interpolated
linearly; a shape the record lacks is priced from the measured shape of nearest size timed at as many rows, scaled
by weight count (said so in the result, with how far). Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field

from edge.catalog.kernel_registry import (
    DECODE_KERNELS,
    DEFAULT_DECODE_KERNEL,
    FORMAT_KERNEL,
    GROUPED_INT8_KERNEL,
    PREFILL_KERNELS,
    WIDE_BATCH_KERNEL,
    decode_rows,
    eight_bit_kernel,
    grouped_int8_kernel,
    kernels_for,
)
from edge.catalog.quantized_layers import (
    EMBEDDING,
    FORMAT_WIDTH,
    FUSED,
    HEAD,
    SHARDS,
    LayerDecision,
    by_kind,
    eight_bit_group_size,
    format_counts,
)
from edge.catalog.weight_paths import Layout, WeightPath
from edge.device.calibration import CalibrationRecord, KernelResult
from edge.formats import format_of
from edge.formats.int8 import INT8
from edge.model.shapes import LinearShape

PROMPT_TOKENS = 512
NEW_TOKENS = 128
CALIBRATION_ROWS = (1, 4, 16, 64, 128, 512)  # M edge-calibrate times: decode, batched decode, prefill sizes


@dataclass(frozen=True)
class EngineLinear:
    """One GEMM vLLM runs per layer (fused as vLLM fuses it), `count` times per forward."""

    name: str
    n: int
    k: int
    count: int
    format: str  # int4, int8 or bf16 (edge.catalog.quantized_layers)
    int8_group: int | None = None  # an int8 GEMM's scales per this many weights (per group); None: per channel
    blocks: str | None = None  # an 8-bit-set GEMM kept as the file's own blocks of this GGML type (OWN_BLOCKS)

    def blocks_share(self) -> float:
        """The bytes its decode rows read as the file's blocks, over what the 8-bit set's grid reads: its kernel
        streams them as the grid's kernel streams the grid (int8 activations per 32, the same loop), so the decode
        rows are priced at the grid kernel's time for that share. Measured, the blocks did better still: Q6_K took
        0.39-0.53x the grid's time for 0.66x its bytes at one row (AMD EPYC Zen 4,
        docs/reports/2026-12-06-own-blocks.md). 1 for a GEMM without blocks."""
        if not (self.blocks and self.format == "int8"):
            return 1.0
        shape = LinearShape(name=self.name, n=self.n, k=self.k, count=1)
        return INT8.blocks_bytes(shape, self.blocks) / INT8.bytes(shape, self.int8_group)

    @property
    def logits(self) -> bool:
        return self.name == HEAD


def engine_linears(layers: list[LayerDecision]) -> list[EngineLinear]:
    """The plan's layer decisions as vLLM's GEMMs: shards fused (N added, the widest format), the embedding out
    (a lookup, not a GEMM). A kind split by format (a GGUF's mixed grid) runs one GEMM per format, `count` layers
    each; fused siblings take each layer's widest format (edge.catalog.quantized_layers), so their counts agree."""
    out: list[EngineLinear] = []
    by_name = by_kind(layers)
    group = eight_bit_group_size(layers)

    def gemm(name: str, n: int, k: int, count: int, fmt: str, blocks: str | None) -> EngineLinear:
        return EngineLinear(name, n, k, count, fmt, group if fmt == "int8" else None, blocks)

    for name, parts in by_name.items():
        if name == EMBEDDING:
            continue
        fused = FUSED.get(name)
        if fused is None or not all(s in by_name for s in SHARDS[fused]):
            out += [gemm(name, parts[0].n, parts[0].k, count, fmt, blocks)
                    for (fmt, blocks), count in _kinds(parts).items()]  # fmt: skip
            continue
        if name != SHARDS[fused][0]:
            continue  # added with the first shard
        shards = [by_name[s] for s in SHARDS[fused]]
        counts = [_kinds(shard) for shard in shards]
        if any(c != counts[0] for c in counts):  # shards decided apart, not by the plan's rules: the widest, no blocks
            widest = [format_counts(shard) for shard in shards]
            assert all(len(c) == 1 for c in widest), widest
            counts = [{(max((next(iter(c)) for c in widest), key=FORMAT_WIDTH.__getitem__), None): parts[0].count}]
        n = sum(shard[0].n for shard in shards)
        out += [gemm(fused, n, parts[0].k, count, fmt, blocks) for (fmt, blocks), count in counts[0].items()]
    return out


def _kinds(parts: list[LayerDecision]) -> dict[tuple[str, str | None], int]:
    """How many layers of a kind take each format, and within the 8-bit set each kind of own blocks (an int4
    layer's Q4_K decode copy is priced as its grid's)."""
    counts: dict[tuple[str, str | None], int] = {}
    for part in parts:
        key = (part.format, part.blocks if part.format == "int8" else None)
        counts[key] = counts.get(key, 0) + part.count
    return counts


def calibration_shapes(layers: list[LayerDecision]) -> list[tuple[int, int]]:
    """The distinct [N, K] edge-calibrate times for a model: every GEMM vLLM runs."""
    return sorted({(lin.n, lin.k) for lin in engine_linears(layers)})


class Unmeasured(LookupError):
    """The record has no usable time for a kernel the option needs."""


def _interpolate(points: dict[int, float], m: int) -> float:
    """ms at m rows from {rows: ms}: exact, linear between neighbours, proportional beyond the last."""
    if m in points:
        return points[m]
    ms = sorted(points)
    i = bisect_left(ms, m)
    if i == 0:
        return points[ms[0]]  # fewer rows than the smallest measured cost no less than a GEMV
    if i == len(ms):
        return points[ms[-1]] * m / ms[-1]
    lo, hi = ms[i - 1], ms[i]
    return points[lo] + (points[hi] - points[lo]) * (m - lo) / (hi - lo)


@dataclass(frozen=True)
class Scaled:
    """A shape the record did not time, priced from another that it did."""

    shape: tuple[int, int]
    source: tuple[int, int]

    @property
    def factor(self) -> float:
        """How far the price was extrapolated: the shape's weights over the source's."""
        return self.shape[0] * self.shape[1] / (self.source[0] * self.source[1])

    def describe(self) -> str:
        (n, k), (sn, sk) = self.shape, self.source
        return f"{n}x{k} from {sn}x{sk} ({self.factor:.2g}x its weights)"


@dataclass
class KernelTimes:
    """A record's times for one kernel, with the shape fallback stated."""

    result: KernelResult
    scaled: set[Scaled] = field(default_factory=set)  # shapes priced from another measured shape

    def ms(self, n: int, k: int, m: int) -> float:
        points = self.result.at(n, k)
        if points:
            return _interpolate(points, m)
        source = self.source(n, k, m)
        self.scaled.add(Scaled((n, k), source))
        return _interpolate(self.result.at(*source), m) * (n * k) / (source[0] * source[1])

    def source(self, n: int, k: int, m: int) -> tuple[int, int]:
        """The timed shape an untimed [N, K] at M rows is priced from: the nearest in weight count (by ratio) among
        those timed at M rows or more, so that a prompt's price is never stretched in rows from a shape timed only
        for decode (the head, at up to 16 rows: a dequantizing kernel's fixed cost would be counted 32 times over
        at 512). At the same M a call's bytes and its multiply-adds both grow with the weight count, so the price
        scales by it (tested against timed shapes held out of the record: tests/edge/test_cost.py)."""
        reach: dict[tuple[int, int], int] = {}
        for t in self.result.times:
            reach[(t.n, t.k)] = max(reach.get((t.n, t.k), 0), t.m)
        assert reach, "timed results carry times"
        covering = [shape for shape, rows in reach.items() if rows >= m] or list(reach)
        return min(covering, key=lambda s: (abs(math.log(s[0] * s[1] / (n * k))), s))


def kernel_times(record: CalibrationRecord, name: str) -> KernelTimes:
    result = record.timed(name)
    if result is None:
        found = record.kernel(name)
        why = f"{found.status}: {found.reason}" if found is not None else "not in the record"
        raise Unmeasured(f"{name} ({why})")
    return KernelTimes(result)


def measured_threshold(record: CalibrationRecord, shapes: list[tuple[int, int]], prefill: str) -> int | None:
    """The rows from which `prefill` (dequantize + GEMM) beats tinygemm on the model's shapes summed and keeps
    beating it up to the largest measured M: the crossing of the two interpolated curves, rounded up; None when
    it never does."""
    try:
        decode, wide = kernel_times(record, "tinygemm"), kernel_times(record, prefill)
    except Unmeasured:
        return None
    rows = sorted({t.m for t in wide.result.times} | {t.m for t in decode.result.times})

    def gap(m: int) -> float:  # > 0: tinygemm is slower, the dequantize path wins
        return sum(decode.ms(n, k, m) for n, k in shapes) - sum(wide.ms(n, k, m) for n, k in shapes)

    gaps = [gap(m) for m in rows]
    if not gaps or gaps[-1] <= 0:
        return None
    i = len(gaps) - 1
    while i > 0 and gaps[i - 1] > 0:
        i -= 1
    if i == 0:
        return rows[0]
    lo, hi = rows[i - 1], rows[i]  # it loses at lo and wins from hi on: both curves are linear in between
    return math.ceil(lo + (hi - lo) * -gaps[i - 1] / (gaps[i] - gaps[i - 1]))


def faster_prefill(record: CalibrationRecord, shapes: list[tuple[int, int]], rows: int = PROMPT_TOKENS) -> str | None:
    """Which prefill dtype ("bfloat16" or "float32") the record measured faster at `rows` on these shapes."""
    costs = {}
    for dtype, name in PREFILL_KERNELS.items():
        try:
            times = kernel_times(record, name)
        except Unmeasured:
            continue
        costs[dtype] = sum(times.ms(n, k, rows) for n, k in shapes)
    return min(costs, key=costs.__getitem__) if costs else None


def faster_decode(record: CalibrationRecord, shapes: list[tuple[int, int]]) -> tuple[str, str | None]:
    """(decode kernel, lossy one faster): the lossless decode kernel (edge.catalog.kernel_registry.DECODE_KERNELS) the
    record timed fastest at 1 row summed over these shapes (tinygemm on a tie), and the fastest lossy one (int8
    activations) timed faster than that, or None. A kernel the record lacks is not chosen."""

    def decode_ms(choice: str) -> float | None:
        try:
            times = kernel_times(record, DECODE_KERNELS[choice].name)
            return sum(times.ms(n, k, 1) for n, k in shapes)
        except Unmeasured:
            return None

    timed = {choice: ms for choice in DECODE_KERNELS if (ms := decode_ms(choice)) is not None}
    if DEFAULT_DECODE_KERNEL not in timed:
        return DEFAULT_DECODE_KERNEL, None
    lossless = {c: ms for c, ms in timed.items() if not DECODE_KERNELS[c].lossy}
    decode = min(lossless, key=lossless.__getitem__)  # the first of equals: tinygemm is listed first
    lossy = {c: ms for c, ms in timed.items() if DECODE_KERNELS[c].lossy and ms < lossless[decode]}
    return decode, min(lossy, key=lossy.__getitem__) if lossy else None


@dataclass
class RequestCost:
    ms: float  # one request: prefill + NEW_TOKENS decode steps (the request's share when batched)
    prefill_ms: float
    decode_step_ms: float  # one decode step for one sequence (the batch's step / batch)
    kernels: dict[str, float]  # ms of the request spent in each kernel
    scaled_shapes: list[str]  # shapes not in the record, each with the shape it was priced from and how far
    substituted: list[str]  # kernels the record lacks, counted at another's times


def request_cost(record: CalibrationRecord, linears: list[EngineLinear], path: WeightPath, layout: Layout | None,
                 *, dequant_threshold: int, prefill_dtype: str, batch: int = 1,
                 decode_kernel: str = DEFAULT_DECODE_KERNEL) -> RequestCost:  # fmt: skip
    """Raises Unmeasured when a kernel the option needs has no times in the record.

    decode_kernel other than tinygemm (edge.catalog.kernel_registry.DECODE_KERNELS): a w4a16 path's int4 layers run
    batches of up to its decode_rows() on that kernel instead of tinygemm, and its 8-bit set's layers on the kernel its
    choice names for them (the AVX2 int8-weight kernel instead of PyTorch's)."""
    int4_kernels = {
        "decode": kernels_for(path, layout, "decode"),
        "prefill": kernels_for(path, layout, "prefill"),
    }
    decode_kernels = format_of(path).decode_kernels  # its 4-bit layers take a decode kernel (edge.formats)
    if decode_kernels and layout in ("direct", "dual"):
        int4_kernels["prefill"] = [PREFILL_KERNELS[prefill_dtype]]
    times: dict[str, KernelTimes] = {}
    spent: dict[str, float] = {}
    substituted: set[str] = set()
    decode_spec = DECODE_KERNELS[decode_kernel]
    rows = decode_rows(decode_kernel) if decode_kernels else None  # the rows its decode kernel takes
    # a layer keeping only the decode kernel's copy runs that kernel on every batch below the dequant threshold
    # (edge.formats.tinygemm decode_copy_only; kernels/ops/int4_ops.py)
    one_copy = bool(rows) and format_of(path).decode_copy_only(layout, decode_kernel)

    def run(lin: EngineLinear, m: int) -> float:
        if lin.format == "int4" or (path == "bf16" and lin.format == "bf16"):
            role = "prefill" if (m >= dequant_threshold and int4_kernels["prefill"]) else "decode"
            names = int4_kernels[role] or int4_kernels["decode"]
            assert names, f"{path}/{layout} has no kernel for {role}"
            # a path served by one kernel per ISA class (w4a8-gptq: vLLM's on x86, KleidiAI on ARM): the one timed
            names = [name for name in names if record.timed(name) is not None] or names
            name = names[0]
            if rows and lin.format == "int4" and (m <= rows or (one_copy and m < dequant_threshold)):
                name = decode_spec.name
                if record.timed(name) is None:  # a record from before the kernel existed: no faster than tinygemm
                    substituted.add(f"{name} counted at {names[0]}'s times (not timed)")
                    name = names[0]
        elif (m >= dequant_threshold and lin.format in WIDE_BATCH_KERNEL
              and record.timed(WIDE_BATCH_KERNEL[lin.format]) is not None):  # fmt: skip
            name = WIDE_BATCH_KERNEL[lin.format]
        else:
            name = FORMAT_KERNEL[lin.format]
            eight_bit = eight_bit_kernel(decode_kernel, lin.k) if rows and lin.format == "int8" and m <= rows else name
            if lin.int8_group and m < dequant_threshold:  # PyTorch's int8 GEMM takes no groups: the AVX2 one
                eight_bit = grouped_int8_kernel(lin.k)
            if eight_bit != name:
                if record.timed(eight_bit) is not None:
                    name = eight_bit
                else:  # a record from before the kernel existed: no faster than PyTorch's int8 kernel
                    substituted.add(f"{eight_bit} counted at {name}'s times (not timed)")
            if name != "bf16" and record.timed(name) is None and record.timed("bf16") is not None:
                substituted.add(f"{name} counted at bf16's times (not timed)")  # a wider weight: no faster
                name = "bf16"
        if name not in times:
            times[name] = kernel_times(record, name)
        ms = times[name].ms(lin.n, lin.k, m) * lin.count
        if lin.blocks and lin.format == "int8" and name == GROUPED_INT8_KERNEL:  # decode rows on the blocks' kernel
            share = lin.blocks_share()
            ms *= share
            substituted.add(f"{lin.blocks} blocks counted at {name}'s times for their bytes ({share:.2f}x the grid's)")
        spent[name] = spent.get(name, 0.0) + ms
        return ms

    prefill = sum(run(lin, 1 if lin.logits else PROMPT_TOKENS) for lin in linears)
    before = dict(spent)
    step = sum(run(lin, batch) for lin in linears) / batch
    for name in spent:  # the request's share of NEW_TOKENS steps, from the one batched step recorded
        spent[name] = before.get(name, 0.0) + (spent[name] - before.get(name, 0.0)) * NEW_TOKENS / batch
    scaled = sorted({s.describe() for t in times.values() for s in t.scaled})
    return RequestCost(prefill + NEW_TOKENS * step, prefill, step, spent, scaled, sorted(substituted))


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str


def thread_choice(record: CalibrationRecord, kernel: str, cores: int) -> ThreadChoice | None:
    """How many threads the engine's GEMMs should get, from the record's 1-thread vs all-core decode step.

    All cores only when the GEMMs speed up by more than the engine loses: vLLM's own front end and scheduler need a
    core, so taking it back must pay for its share, cores / (cores - 1) (2x on a 2-core box). Measured on the Zen 5
    host: OMP_NUM_THREADS=2 on 2 cores cut the default model's decode from 102.6 to 61-68 tok/s (docs/FACTS.md)."""
    steps: dict[int, float] = {t.threads: t.ms for t in record.thread_scaling if t.kernel == kernel}
    if 1 not in steps or len(steps) < 2 or cores < 2:
        return None
    most = max(steps)
    speedup = steps[1] / steps[most]
    needed = cores / (cores - 1)
    threads = most if speedup >= needed else 1
    return ThreadChoice(threads, (
        f"{kernel} decode step {steps[1]:.3f} ms on 1 thread vs {steps[most]:.3f} ms on {most} ({speedup:.2f}x): "
        + (f"{threads} threads" if threads > 1 else "1 thread")
        + f", since more threads must beat {needed:.2f}x to pay for the core vLLM's front end needs"))
