"""The AVX2 int4 decode kernel as a plan's choice: edge.cost.faster_decode, the quantization_config field
edge.kernel_params owns (`decode_kernel`), and the ledger's row-major copies the kernel reads."""

from __future__ import annotations

from pathlib import Path

from edge.calibration import CalibrationRecord, KernelResult, KernelTime
from edge.cost import faster_decode
from edge.planner import make_plan

DATA = Path(__file__).parent / "data"
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _avx2_record_with_avx2_kernel(speedup: float) -> CalibrationRecord:
    """The AVX2 host's record, plus the AVX2 kernel timed at tinygemm's times / speedup."""
    record = CalibrationRecord.model_validate_json((DATA / "calibration_epyc_avx2.json").read_text())
    tinygemm = record.timed("tinygemm")
    times = [KernelTime(n=t.n, k=t.k, m=t.m, ms=t.ms / speedup) for t in tinygemm.times]
    return record.model_copy(update={"kernels": [*record.kernels, KernelResult(kernel="avx2-int4", status="ok",
                                                                               times=times)]})  # fmt: skip


def test_the_avx2_kernel_decodes_where_the_record_timed_it_faster_at_one_row():
    assert faster_decode(_avx2_record_with_avx2_kernel(2.0), SHAPES) == "avx2"
    assert faster_decode(_avx2_record_with_avx2_kernel(0.5), SHAPES) == "tinygemm"


def test_a_record_without_the_avx2_kernel_keeps_tinygemm():
    record = CalibrationRecord.model_validate_json((DATA / "calibration_epyc_avx2.json").read_text())
    assert faster_decode(record, SHAPES) == "tinygemm"


def test_a_plan_that_picks_it_writes_decode_kernel_and_books_the_row_major_copies(avx2_host, smollm2):
    w4a16 = {"path": "w4a16-tinygemm", "layout": "direct"}
    plan = make_plan(avx2_host, smollm2, calibration=_avx2_record_with_avx2_kernel(2.0), **w4a16)
    assert plan.quantization_config["decode_kernel"] == "avx2"
    assert "AVX2 decode kernel (decode_kernel: avx2) reads the row-major copy" in plan.model_dump_json()


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
