"""Rank the (path, layout) options for a device by priority: the cost model over kernel times.

Speed is judged on one request, a 512-token prompt (prefill) and 128 generated tokens (edge.measure.cost), because an
edge box's user waits for both. The kernel times come from, in order:
    a calibration record of this CPU (edge-calibrate on the box, or one a fleet planner stored): measured
    the facts table's 1-thread GEMM medians of the ISA class (AVX2, AVX-512 with AVX512-BF16), as a record of
        one 4096x4096 shape: measured on another box of the class, so extrapolated unless it is that class
    AMX: the reference study's end-to-end tok/s (no kernel times exist for it)
    anything else: derived (decode is bandwidth-bound, so fewer weight bytes win), extrapolated
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge.catalog.kernel_registry import KERNELS, reads_own_blocks, runs_grouped_int8
from edge.catalog.quantized_layers import model_layers, rules_for
from edge.catalog.weight_paths import (
    DERIVED_LAYOUT_FACTS,
    DERIVED_LAYOUT_ORDER,
    LAYOUT_PREFILL_SLOWDOWN,
    PATHS,
    Layout,
    Priority,
    Reference,
    WeightPath,
    fidelity_rank,
)
from edge.device.calibration import CalibrationRecord, KernelResult, KernelTime
from edge.facts import Reason, fact
from edge.formats import format_of
from edge.measure.cost import NEW_TOKENS, PROMPT_TOKENS, RequestCost, Unmeasured, engine_linears, request_cost
from edge.measure.kernel_params import KernelParams
from edge.model.shapes import ModelShape

REFERENCE_SHAPE = (4096, 4096)  # edge-calibrate times it for every model: records compare across models
# The options a record ranks: every path vLLM serves, in each of its layouts (equal cost sorts the leanest first).
_PATHS: list[tuple[WeightPath, Layout | None]] = [
    (name, layout) for name in sorted(PATHS, key=fidelity_rank) if PATHS[name].served_by_vllm
    for layout in (PATHS[name].layouts or (None,))]  # fmt: skip


@dataclass
class Option:
    path: WeightPath
    layout: Layout | None
    request_cost: float | None  # lower is faster; None when unmeasured
    cost_unit: str
    reasons: list[Reason] = field(default_factory=list)
    extrapolated: bool = False

    @property
    def label(self) -> str:
        return f"{self.path}/{self.layout}" if self.layout else self.path


@dataclass(frozen=True)
class RankInput:
    """What the ranking needs: the device's class, the model, the group each path would use (its gate's), the
    kernel parameters the plan writes, and the device's calibration record when there is one."""

    isa_class: str
    model: ModelShape
    groups: dict[WeightPath, int | None]
    kernel: KernelParams
    native_bf16: bool = True
    record: CalibrationRecord | None = None
    batch: int = 1  # sequences decoding together (max_num_seqs): a second cost, reported; ranking is per user


def facts_record(prefix: str) -> tuple[CalibrationRecord, list[str]]:
    """The facts table's GEMM medians for `prefix` ("avx2", "avx512") as a record, and the fact keys used."""
    from edge.facts import FACTS

    kernels, keys = [], []
    for name, spec in KERNELS.items():
        if not spec.facts:
            continue
        times = []
        for point in spec.facts:
            key = f"{prefix}.{point.suffix}"
            if key in FACTS:
                times.append(KernelTime(n=point.n, k=point.k, m=point.m, ms=FACTS[key].value))
                keys.append(key)
        kernels.append(KernelResult(kernel=name, status="ok" if times else "failed", times=times,
                                    reason=None if times else f"not in the facts table for {prefix}"))  # fmt: skip
    record = CalibrationRecord(
        cpu_model=f"facts table ({prefix})", isa_flags=[], isa_class=prefix, cores=2, threads=1, group_size=64,
        kernels=kernels, measured_at=max(FACTS[k].date for k in keys))  # fmt: skip
    return record, keys


def _cite(key: str, text: str) -> Reason:
    f = fact(key)
    classes = {"avx2": "measured here (AVX2)", "avx512": "measured here (AVX-512, Zen 5)"}
    here = classes.get(f.isa_class, "measured here")
    source = {"reference": "reference study (Xeon 8480C, AMX)", "here": here}.get(f.source, f.source)
    return Reason(text=text, fact=key, value=f.value, unit=f.unit, source=source)


def _headline(record: CalibrationRecord, kernel: str, m: int = 1) -> str | None:
    """'tinygemm 0.44 ms vs bf16 1.68 ms at 4096x4096, M=1' from the record's largest shape both timed."""
    mine, bf16 = record.timed(kernel), record.timed("bf16")
    if mine is None or bf16 is None or kernel == "bf16":
        return None
    shared = [(t.n, t.k) for t in mine.times if t.m == m and bf16.at(t.n, t.k).get(m)]
    if not shared:
        return None
    n, k = REFERENCE_SHAPE if REFERENCE_SHAPE in shared else max(shared, key=lambda s: s[0] * s[1])
    return f"{kernel} {mine.at(n, k)[m]:.3g} ms vs bf16 {bf16.at(n, k)[m]:.3g} ms at {n}x{k}, M={m}"


def _record_options(inp: RankInput, record: CalibrationRecord, source: str, fact_keys: list[str],
                    extrapolated: bool) -> list[Option]:  # fmt: skip
    unit = (f"ms per request ({PROMPT_TOKENS}-token prefill + {NEW_TOKENS} decode steps, {record.threads} "
            f"thread{'s' if record.threads != 1 else ''}, the model's own shapes)")
    options = []
    for path, layout in _PATHS:
        group = inp.groups.get(path)
        own_blocks = reads_own_blocks(inp.kernel.decode_kernel, path)  # as the plan's rules (edge.plan.planner)
        layers = model_layers(inp.model, rules_for(inp.model, path, group, "speed", own_blocks=own_blocks,
                                                   int8_groups=runs_grouped_int8(inp.isa_class)))
        linears = engine_linears(layers)
        try:
            cost, batched = (request_cost(record, linears, path, layout, batch=batch,
                                          dequant_threshold=inp.kernel.dequant_threshold,
                                          prefill_dtype=inp.kernel.prefill_dtype,
                                          decode_kernel=inp.kernel.decode_kernel)
                             for batch in (1, inp.batch))  # fmt: skip
        except Unmeasured as missing:
            options.append(Option(path, layout, None, unit, [Reason(
                text=f"not timed on this CPU: {missing}", source=source)], extrapolated))  # fmt: skip
            continue
        top = sorted(cost.kernels.items(), key=lambda kv: -kv[1])
        spent = ", ".join(f"{name} {ms:.1f} ms" for name, ms in top)
        reasons = [Reason(
            text=f"{cost.ms:.1f} ms per request: prefill {cost.prefill_ms:.1f} ms + {NEW_TOKENS} decode steps of "
            f"{cost.decode_step_ms:.3f} ms ({spent})" + "".join(f"; {note}" for note in _notes(cost)),
            value=round(cost.ms, 3), unit="ms", source=source)]  # fmt: skip
        if inp.batch > 1:
            reasons.append(Reason(
                text=f"with {inp.batch} sequences decoding together (max_num_seqs): {batched.ms:.1f} ms per request, "
                f"decode steps of {batched.decode_step_ms:.3f} ms per sequence", value=round(batched.ms, 3), unit="ms",
                source=source))  # fmt: skip
        if headline := _headline(record, top[0][0] if path != "bf16" else "bf16"):
            reasons.append(Reason(text=headline, source=source))
        reasons += [_cite(key, fact(key).note) for key in fact_keys if _serves(key, cost.kernels)]
        options.append(Option(path, layout, cost.ms, unit, reasons, extrapolated))
    return options


def _notes(cost: RequestCost) -> list[str]:
    scaled = [f"shapes scaled from others: {', '.join(cost.scaled_shapes)}"] if cost.scaled_shapes else []
    return scaled + cost.substituted


def _serves(key: str, kernels: dict[str, float]) -> bool:
    return any(key.endswith(point.suffix) for name in kernels for point in KERNELS[name].facts)


def _amx_options() -> list[Option]:
    """Seconds per request from the reference study's tok/s (Spark-X2.5-1.7B on a Xeon 8480C): no kernel times.
    Each path's `reference` (edge.catalog.weight_paths) names its figures; a layout's prefill is dual's scaled by its
    slowdown."""

    def cost(ref: Reference, prefill_slowdown: float = 1.0) -> float:
        prefill = fact(ref.prefill).value / prefill_slowdown
        return PROMPT_TOKENS / prefill + NEW_TOKENS / fact(ref.decode).value

    unit = "s per request (512-token prompt + 128 tokens, reference model)"
    options = []
    for name, spec in PATHS.items():
        ref = spec.reference
        if ref is None:
            continue
        if not spec.layouts:
            options.append(Option(name, None, cost(ref), unit, [_cite(ref.decode, ref.why)]))
            continue
        for layout, slowdown_key in LAYOUT_PREFILL_SLOWDOWN.items():
            reasons = [_cite(ref.decode, ref.why)]
            if slowdown_key is not None:
                reasons.append(_cite(slowdown_key, f"{layout} layout prefill is slower than dual"))
            slowdown = fact(slowdown_key).value if slowdown_key is not None else 1.0
            options.append(Option(name, layout, cost(ref, slowdown), unit, reasons))
    return options


def _derived_options() -> list[Option]:
    """No measurements for this ISA class: decode reads every weight each step, so fewer bytes per weight win."""
    unit = "bytes read per weight per decode step (derived)"
    reason = Reason(
        text="no measurement on this ISA class: ranked by bytes read per decode step (bandwidth-bound)",
        source="derived",
    )
    order = Reason(
        text=f"layouts decode alike: {', '.join(DERIVED_LAYOUT_ORDER)} in that order, as the measured ISA classes "
        "support (not measured on this one)", source="derived")  # fmt: skip
    cited = [order] + [_cite(key, fact(key).note) for key in DERIVED_LAYOUT_FACTS]
    options = []
    for name, spec in PATHS.items():
        per_weight = format_of(name).derived_bytes  # edge.formats
        if per_weight is None:
            continue
        layouts = [layout for layout in DERIVED_LAYOUT_ORDER if layout in spec.layouts] or [None]
        # equal cost: the sort is stable, in DERIVED_LAYOUT_ORDER
        options += [Option(name, layout, per_weight, unit, [reason, *(cited if spec.layouts else [])], True)
                    for layout in layouts]  # fmt: skip
    return options


def facts_prefix(isa_class: str, native_bf16: bool) -> str | None:
    """Which facts-table class a device is ranked on without a record: AVX-512 was measured with AVX512-BF16
    (Zen 5); one without it (Ice Lake) dequantizes to fp32 like AVX2 and is ranked on AVX2's numbers."""
    if isa_class == "avx512" and native_bf16:
        return "avx512"
    return "avx2" if isa_class in ("avx2", "avx512") else None


def speed_options(inp: RankInput) -> list[Option]:
    """Every option the device can be ranked on, fastest first (the gates decide what is runnable)."""
    if inp.record is not None:
        options = _record_options(inp, inp.record, f"calibration of this CPU ({inp.record.describe()})", [], False)
    elif inp.isa_class == "amx":
        options = _amx_options()
    elif prefix := facts_prefix(inp.isa_class, inp.native_bf16):
        record, keys = facts_record(prefix)
        source = f"facts table ({prefix}: 4096x4096 GEMM medians scaled to the model's shapes)"
        options = _record_options(inp, record, source, keys, extrapolated=prefix != inp.isa_class)
    else:
        options = _derived_options()
    return sorted(options, key=lambda o: o.request_cost if o.request_cost is not None else float("inf"))


def rank(inp: RankInput, priority: Priority) -> list[Option]:
    """Every option, best first for the priority; fidelity puts W4A8 last and the planner never picks it."""
    options = speed_options(inp)
    if priority == "fidelity":
        options.sort(key=lambda o: fidelity_rank(o.path))  # stable: speed order within a path
    return options
