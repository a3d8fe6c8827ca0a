"""The AVX2 int4 decode kernels as a plan's choice: edge.measure.cost.faster_decode, the quantization_config field
edge.measure.kernel_params owns (`decode_kernel`), the ledger's row-major copies the kernels read, and the speed plan's
int8-activation kernel, taken only where an edge-eval record of the model shows the quality floor holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.device.calibration import CalibrationRecord, KernelResult, KernelTime
from edge.measure.cost import faster_decode
from edge.measure.quality import QualityRecord, quality_key
from edge.plan.planner import make_plan

DATA = Path(__file__).parent / "data"
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _avx2_record_with_avx2_kernel(speedup: float, int8_speedup: float | None = None) -> CalibrationRecord:
    """The AVX2 host's record, plus the AVX2 kernels timed at tinygemm's times / speedup (int8: / int8_speedup)."""
    record = CalibrationRecord.model_validate_json((DATA / "calibration_epyc_avx2.json").read_text())
    tinygemm = record.timed("tinygemm")
    added = []
    for name, factor in (("avx2-int4", speedup), ("avx2-w4a8", int8_speedup)):
        if factor is not None:
            times = [KernelTime(n=t.n, k=t.k, m=t.m, ms=t.ms / factor) for t in tinygemm.times]
            added.append(KernelResult(kernel=name, status="ok", times=times))
    return record.model_copy(update={"kernels": [*record.kernels, *added]})


def test_the_avx2_kernel_decodes_where_the_record_timed_it_faster_at_one_row():
    assert faster_decode(_avx2_record_with_avx2_kernel(2.0), SHAPES) == ("avx2", None)
    assert faster_decode(_avx2_record_with_avx2_kernel(0.5), SHAPES) == ("tinygemm", None)


def test_the_int8_kernel_counts_as_faster_only_against_the_best_int16_choice():
    assert faster_decode(_avx2_record_with_avx2_kernel(2.0, 3.0), SHAPES) == ("avx2", "avx2-w4a8")
    assert faster_decode(_avx2_record_with_avx2_kernel(2.0, 1.5), SHAPES) == ("avx2", None)
    assert faster_decode(_avx2_record_with_avx2_kernel(0.5, 1.5), SHAPES) == ("tinygemm", "avx2-w4a8")


def test_a_record_without_the_avx2_kernel_keeps_tinygemm():
    record = CalibrationRecord.model_validate_json((DATA / "calibration_epyc_avx2.json").read_text())
    assert faster_decode(record, SHAPES) == ("tinygemm", None)


def test_a_plan_that_picks_it_writes_decode_kernel_and_books_the_row_major_copies(avx2_host, smollm2):
    w4a16 = {"path": "w4a16-tinygemm", "layout": "dual"}
    plan = make_plan(avx2_host, smollm2, calibration=_avx2_record_with_avx2_kernel(2.0), **w4a16)
    assert plan.quantization_config["decode_kernel"] == "avx2"
    assert "AVX2 decode kernel (decode_kernel: avx2) reads the row-major copy" in plan.model_dump_json()


def test_a_direct_plan_with_it_books_each_int4_layer_once(avx2_host, smollm2):
    w4a16 = {"path": "w4a16-tinygemm", "layout": "direct"}
    plan = make_plan(avx2_host, smollm2, calibration=_avx2_record_with_avx2_kernel(2.0), **w4a16)
    int4 = [item for item in plan.memory.items if item.kind in ("int4-weights", "row-major-copy")]
    assert {item.kind for item in int4} == {"int4-weights"}
    assert all("decode copy" in item.name for item in int4)
    dual = make_plan(avx2_host, smollm2, calibration=_avx2_record_with_avx2_kernel(2.0), path="w4a16-tinygemm",
                     layout="dual")  # fmt: skip
    dual_int4 = sum(item.bytes for item in dual.memory.items if item.kind in ("int4-weights", "row-major-copy"))
    assert dual_int4 == 2 * sum(item.bytes for item in int4)


def test_a_plan_without_it_writes_the_config_as_before(avx2_host, smollm2):
    record = CalibrationRecord.model_validate_json((DATA / "calibration_epyc_avx2.json").read_text())
    plan = make_plan(avx2_host, smollm2, calibration=record, path="w4a16-tinygemm", layout="direct")
    assert "decode_kernel" not in plan.quantization_config
    assert "AVX2 decode kernel" not in plan.model_dump_json()


def test_the_cost_model_counts_decode_steps_at_the_avx2_kernels_times_when_the_plan_picks_it(avx2_host, smollm2):
    record = _avx2_record_with_avx2_kernel(2.0)
    plan = make_plan(avx2_host, smollm2, calibration=record, path="w4a16-tinygemm", layout="direct")
    cost = next(r.text for r in plan.reasons if "decode steps of" in r.text)
    assert "avx2-int4" in cost


def test_with_an_avx2_decode_kernel_the_8_bit_head_decodes_on_the_avx2_int8_kernel():
    """The head (int8 per channel, K % 32 == 0) at its timed AVX2 times; a record without that kernel counts it at
    PyTorch's int8 times and says so; tinygemm decode keeps PyTorch's kernel."""
    from edge.measure.cost import HEAD, EngineLinear, request_cost

    linears = [EngineLinear("model.layers.0.mlp.down_proj", 576, 1536, 30, "int4"),
               EngineLinear(HEAD, 49152, 576, 1, "int8")]
    costs = {"dequant_threshold": 128, "prefill_dtype": "float32"}
    avx2 = _avx2_record_with_avx2_kernel(2.0)
    bf16 = avx2.timed("bf16")  # the fixture has no int8 times: both int8 kernels at fractions of bf16's

    def at(name: str, factor: float) -> KernelResult:
        return KernelResult(kernel=name, status="ok",
                            times=[KernelTime(n=t.n, k=t.k, m=t.m, ms=t.ms / factor) for t in bf16.times])  # fmt: skip

    record = avx2.model_copy(update={"kernels": [*avx2.kernels, at("int8", 2)]})
    timed = avx2.model_copy(update={"kernels": [*avx2.kernels, at("int8", 2), at("avx2-int8", 6)]})
    with_kernel = request_cost(timed, linears, "w4a16-tinygemm", "direct", decode_kernel="avx2", **costs)
    assert "avx2-int8" in with_kernel.kernels and "int8" not in with_kernel.kernels
    without = request_cost(record, linears, "w4a16-tinygemm", "direct", decode_kernel="avx2", **costs)
    assert "avx2-int8 counted at int8's times (not timed)" in without.substituted and "int8" in without.kernels
    assert without.decode_step_ms > with_kernel.decode_step_ms
    tinygemm = request_cost(timed, linears, "w4a16-tinygemm", "direct", **costs)
    assert "avx2-int8" not in tinygemm.kernels and "int8" in tinygemm.kernels


def _int8_record(model: str, plan, kld: float) -> QualityRecord:
    """An edge-eval record of `plan`'s weights run with the int8-activation decode kernel."""
    key = quality_key("w4a16-tinygemm", {**plan.quantization_config, "decode_kernel": "avx2-w4a8"})
    return QualityRecord(model=model, key=key, kld_mean=kld, kld_mean_se=0.0001, top1_agreement=0.95,
                         top1_agreement_se=0.002, ppl_ratio=1.01, ppl_ratio_se=0.001, confident_flip_rate=0.01,
                         confident_flip_rate_se=0.001, tokens=16384)  # fmt: skip


def test_an_avx2_host_without_a_record_decodes_on_the_int16_kernel(avx2_host, smollm2):
    plan = make_plan(avx2_host, smollm2, priority="speed", path="w4a16-tinygemm", layout="direct")
    assert plan.quantization_config["decode_kernel"] == "avx2"
    why = next(r.text for r in plan.reasons if r.text.startswith("decode stays on avx2"))
    assert "no edge-eval record of this model with int8 activations" in why


def test_speed_takes_int8_activations_only_within_the_quality_floor_and_fidelity_never(avx2_host, smollm2):
    w4a16 = {"path": "w4a16-tinygemm", "layout": "direct"}
    base = make_plan(avx2_host, smollm2, priority="speed", **w4a16)
    good, bad = _int8_record(smollm2.name, base, 0.01), _int8_record(smollm2.name, base, 0.2)
    plan = make_plan(avx2_host, smollm2, priority="speed", quality=[good], **w4a16)
    assert plan.quantization_config["decode_kernel"] == "avx2-w4a8"
    assert plan.quality.status == "measured" and plan.quality.record.kld_mean == pytest.approx(0.01)
    assert any(r.text.startswith("decode rows on the AVX2 int8-activation kernel") for r in plan.reasons)
    assert "the only copy (direct layout, decode_kernel avx2-w4a8)" in plan.model_dump_json()
    lossy = make_plan(avx2_host, smollm2, priority="speed", quality=[bad], **w4a16)
    assert lossy.quantization_config["decode_kernel"] == "avx2"
    assert any("exceeds --max-kld 0.08" in r.text for r in lossy.reasons)
    fidelity = make_plan(avx2_host, smollm2, priority="fidelity", quality=[good], **w4a16)
    assert fidelity.quantization_config.get("decode_kernel") == "avx2"


def test_only_the_int8_kernel_enters_the_quality_key():
    config = {"quant_method": "cpu_int4", "bits": 4, "group_size": 32}
    assert quality_key("w4a16-tinygemm", {**config, "decode_kernel": "avx2"}) == quality_key("w4a16-tinygemm", config)
    assert quality_key("w4a16-tinygemm", {**config, "decode_kernel": "avx2-w4a8"})["decode_kernel"] == "avx2-w4a8"
