"""Rank the (path, layout) options for a device by priority, from the measured facts of its ISA class.

Speed is judged on one request: a 512-token prompt (prefill) and 128 generated tokens (single-stream decode),
because an edge box's user waits for both. Where the ISA class has measurements (AMX: reference study; AVX2 and
AVX-512 with AVX512-BF16: this project's hosts) the cost is computed from them; elsewhere the rule is derived
(decode is bandwidth-bound, so fewer weight bytes win) and said to be extrapolated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge.facts import fact
from edge.plan import Layout, Priority, Reason, WeightPath

PROMPT_TOKENS = 512
NEW_TOKENS = 128
W4A16_LAYOUTS: tuple[Layout, ...] = ("dual", "direct", "kernel-only")


@dataclass
class Option:
    path: WeightPath
    layout: Layout | None
    request_cost: float | None  # lower is faster; None when unmeasured on this ISA class
    cost_unit: str
    reasons: list[Reason] = field(default_factory=list)
    extrapolated: bool = False

    @property
    def label(self) -> str:
        return f"{self.path}/{self.layout}" if self.layout else self.path


def _cite(key: str, text: str) -> Reason:
    f = fact(key)
    classes = {"avx2": "measured here (AVX2)", "avx512": "measured here (AVX-512, Zen 5)"}
    here = classes.get(f.isa_class, "measured here")
    source = {"reference": "reference study (Xeon 8480C, AMX)", "here": here}.get(f.source, f.source)
    return Reason(text=text, fact=key, value=f.value, unit=f.unit, source=source)


def _amx_options() -> list[Option]:
    """Seconds per request from the reference study's tok/s (Spark-X2.5-1.7B on a Xeon 8480C)."""

    def cost(prefill_key: str, decode_key: str, prefill_slowdown: float = 1.0) -> float:
        prefill = fact(prefill_key).value / prefill_slowdown
        return PROMPT_TOKENS / prefill + NEW_TOKENS / fact(decode_key).value

    unit = "s per request (512-token prompt + 128 tokens, reference model)"
    w4a16_prefill = "amx.w4a16.dual.prefill_tok_s"
    slowdown = {"dual": 1.0, "direct": fact("amx.direct.prefill_slowdown").value,
                "kernel-only": fact("amx.kernel_only.prefill_slowdown").value}  # fmt: skip
    options = [
        Option("w4a8-gptq", None, cost("amx.w4a8.prefill_tok_s", "amx.w4a8.decode_tok_s"), unit,
               [_cite("amx.w4a8.decode_tok_s", "W4A8 decodes fastest on AMX")]),
        Option("bf16", None, cost("amx.bf16.prefill_tok_s", "amx.bf16.decode_tok_s"), unit,
               [_cite("amx.bf16.decode_tok_s", "bf16 decode on AMX")]),
    ]  # fmt: skip
    for layout in W4A16_LAYOUTS:
        reasons = [_cite("amx.w4a16.decode_tok_s", "W4A16 tinygemm decode on AMX")]
        if layout != "dual":
            key = "amx.direct.prefill_slowdown" if layout == "direct" else "amx.kernel_only.prefill_slowdown"
            reasons.append(_cite(key, f"{layout} layout prefill is slower than dual"))
        options.append(
            Option("w4a16-tinygemm", layout,
                   cost(w4a16_prefill, "amx.w4a16.decode_tok_s", slowdown[layout]), unit, reasons)
        )  # fmt: skip
    return options


def _avx2_options(extrapolated: bool) -> list[Option]:
    """Milliseconds per request per 4096x4096 layer, from this host's GEMM medians at 1 thread, group 64.

    One thread because vLLM 0.28 serves with one Torch thread unless OMP_NUM_THREADS is set
    (vllm/utils/torch_utils.py), and the plans leave it so.
    """
    unit = "ms per request per 4096x4096 layer (512-token prefill + 128 single-row steps, 1 thread)"
    bf16_1, bf16_512 = fact("avx2.1t.gemm.m1.bf16_ms").value, fact("avx2.1t.gemm.m512.bf16_ms").value
    int4_1, int4_512 = fact("avx2.1t.gemm.m1.int4_ms").value, fact("avx2.1t.gemm.m512.int4_ms").value
    # dual and direct prefill = dequantize once + GEMM in fp32: AVX2 has no native bf16 FMA (kernels/int4_ops.py).
    dequant_512 = fact("avx2.1t.dequant_fp32.m512_ms").value
    bf16_reasons = [
        _cite("avx2.1t.gemm.m1.bf16_ms", "one-row bf16 GEMM (decode step)"),
        _cite("avx2.1t.gemm.m512.bf16_ms", "512-row bf16 GEMM (prefill): no native bf16 FMA on AVX2"),
    ]
    decode_reason = _cite("avx2.1t.gemm.m1.int4_ms", "one-row tinygemm (decode step)")
    options = [
        Option("bf16", None, bf16_512 + NEW_TOKENS * bf16_1, unit, bf16_reasons, extrapolated),
        Option("w4a16-tinygemm", "kernel-only", int4_512 + NEW_TOKENS * int4_1, unit,
               [decode_reason, _cite("avx2.1t.gemm.m512.int4_ms", "512-row tinygemm (prefill)")], extrapolated),
    ]  # fmt: skip
    prefill_reason = _cite("avx2.1t.dequant_fp32.m512_ms", "512-row prefill: dequantize once, then an fp32 GEMM")
    engine_reason = _cite("avx2.engine.direct.prefill_tok_s",
                          "in vLLM on the default model, direct prefilled 6.7x and decoded 1.5x faster than bf16")
    for layout in ("direct", "dual"):  # equal speed; direct keeps one copy, so it sorts first
        reasons = [decode_reason, prefill_reason] + ([engine_reason] if layout == "direct" else [])
        options.append(Option("w4a16-tinygemm", layout, dequant_512 + NEW_TOKENS * int4_1, unit, reasons,
                              extrapolated))
    return options


def _avx512_options(extrapolated: bool) -> list[Option]:
    """Milliseconds per request per 4096x4096 layer from the AVX-512 host's GEMM medians (Zen 5, AVX512-BF16, 1
    thread, group 64): wide batches dequantize to bf16 and run the native bf16 GEMM (edge.kernel_params)."""
    unit = "ms per request per 4096x4096 layer (512-token prefill + 128 single-row steps, 1 thread)"
    bf16_1, bf16_512 = fact("avx512.1t.gemm.m1.bf16_ms").value, fact("avx512.1t.gemm.m512.bf16_ms").value
    int4_1, int4_512 = fact("avx512.1t.gemm.m1.int4_ms").value, fact("avx512.1t.gemm.m512.int4_ms").value
    dequant_512 = fact("avx512.1t.dequant_bf16.m512_ms").value
    decode_reason = _cite("avx512.1t.gemm.m1.int4_ms", "one-row tinygemm (decode step)")
    prefill_reason = _cite("avx512.1t.dequant_bf16.m512_ms", "512-row prefill: dequantize once, then a bf16 GEMM")
    engine_reason = _cite("avx512.engine.direct.decode_tok_s",
                          "in vLLM on the default model, direct decoded 2.1x and prefilled 1.4x as fast as bf16")
    options = [
        Option("bf16", None, bf16_512 + NEW_TOKENS * bf16_1, unit,
               [_cite("avx512.1t.gemm.m1.bf16_ms", "one-row bf16 GEMM (decode step)")], extrapolated),
        Option("w4a16-tinygemm", "kernel-only", int4_512 + NEW_TOKENS * int4_1, unit,
               [decode_reason, _cite("avx512.1t.gemm.m512.int4_ms", "512-row tinygemm (prefill)")], extrapolated),
    ]  # fmt: skip
    for layout in ("direct", "dual"):  # equal speed; direct keeps one copy, so it sorts first
        reasons = [decode_reason, prefill_reason] + ([engine_reason] if layout == "direct" else [])
        options.append(Option("w4a16-tinygemm", layout, dequant_512 + NEW_TOKENS * int4_1, unit, reasons,
                              extrapolated))
    return options


def _derived_options() -> list[Option]:
    """No measurements for this ISA class: decode reads every weight each step, so fewer bytes per weight win."""
    unit = "bytes read per weight per decode step (derived)"
    reason = Reason(
        text="no measurement on this ISA class: ranked by bytes read per decode step (bandwidth-bound)",
        source="derived",
    )
    options = [Option("bf16", None, 2.0, unit, [reason], True)]
    # 4.5 bits/weight with bf16 scale and zero per 64 weights; layouts differ only in prefill, unmeasured here.
    for layout in ("kernel-only", "direct", "dual"):  # equal cost: the sort is stable, leanest first
        options.append(Option("w4a16-tinygemm", layout, 0.5625, unit, [reason], True))
    return options


def speed_options(isa_class: str, native_bf16: bool = True) -> list[Option]:
    """Every option this ISA class can be ranked on, fastest first (the gates decide what is runnable).

    AVX-512 was measured on a CPU with AVX512-BF16 (Zen 5); one without it (Ice Lake) dequantizes to fp32 and is
    ranked on AVX2's fp32 numbers, marked extrapolated."""
    if isa_class == "amx":
        options = _amx_options()
    elif isa_class == "avx512" and native_bf16:
        options = _avx512_options(extrapolated=False)
    elif isa_class in ("avx2", "avx512"):
        options = _avx2_options(extrapolated=isa_class != "avx2")
    else:
        options = _derived_options()
    return sorted(options, key=lambda o: o.request_cost if o.request_cost is not None else float("inf"))


# Fidelity: bf16 is the reference; W4A16 keeps bf16 activations (+12.5% perplexity on the reference model);
# W4A8 quantizes activations (+27.2%) and is never chosen for fidelity (docs/FACTS.md: agents lost completion).
FIDELITY_ORDER: dict[WeightPath, int] = {"bf16": 0, "w4a16-tinygemm": 1, "export-only": 2, "w4a8-gptq": 9}


def rank(isa_class: str, priority: Priority, native_bf16: bool = True) -> list[Option]:
    """Every option, best first for the priority; fidelity puts W4A8 last and the planner never picks it."""
    options = speed_options(isa_class, native_bf16)
    if priority == "fidelity":
        options.sort(key=lambda o: FIDELITY_ORDER[o.path])  # stable: speed order within a path
    return options
