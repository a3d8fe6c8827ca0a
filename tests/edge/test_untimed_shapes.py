"""A plan for a model whose shapes this host never timed chooses as a plan from a record at the model's own shapes
(issue 48). On each host class with both records in data/ (`calibration_<host>.json`, edge-calibrate on the
default model; `calibration_<host>_1b.json`, edge-calibrate --model on the generated ~1B Q4_K_M of
benchmarks/make_random_gguf.py --preset 1b, whose header is data/models/), planned for the device's own
/proc/cpuinfo (`cpuinfo_<host>*.txt`): the same path, layout and decode kernel, and a predicted decode step within
a fifth of the one priced at its own shapes. Host classes measured so far: the Zen 4 (AVX-512 BF16/VNNI, no
AVX-VNNI), 2026-12-04; the Zen 3 and the Zen 5 have records at the default model's shapes only."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from edge.catalog.kernel_registry import DEFAULT_DECODE_KERNEL
from edge.device.calibration import CalibrationRecord, matches
from edge.device.cpuinfo import parse_cpuinfo
from edge.measure.cost import KernelTimes, engine_linears, request_cost
from edge.measure.quality import shipped_records
from edge.model.gguf_metadata import header_from_json
from edge.model.reader import read_gguf_header
from edge.plan.planner import make_plan

DATA = Path(__file__).parent / "data"
ONE_B = DATA / "models" / "random-1b-Q4_K_M.header.json"


def hosts() -> list[str]:
    return sorted(p.name.removeprefix("calibration_").removesuffix("_1b.json")
                  for p in DATA.glob("calibration_*_1b.json"))  # fmt: skip


def test_a_host_class_has_records_at_both_shapes():
    assert "epyc_zen4" in hosts()


@pytest.mark.parametrize("priority", ["speed", "fidelity"])
@pytest.mark.parametrize("host", hosts())
def test_a_1b_planned_from_the_default_models_shapes_chooses_as_from_its_own(host, priority):
    (cpuinfo,) = DATA.glob(f"cpuinfo_{host}*.txt")
    device = parse_cpuinfo(cpuinfo.read_text())
    model = read_gguf_header(header_from_json(json.loads(ONE_B.read_text())), "random-1b-Q4_K_M")
    plans, records = {}, {}
    for shapes, name in (("default", f"calibration_{host}.json"), ("own", f"calibration_{host}_1b.json")):
        record = records[shapes] = CalibrationRecord.model_validate_json((DATA / name).read_text())
        assert matches(record, device)
        plans[shapes] = make_plan(device, model, priority=priority, quality=shipped_records(), calibration=record)
    choice = {k: (p.path, p.layout, (p.quantization_config or {}).get("decode_kernel")) for k, p in plans.items()}
    assert choice["default"] == choice["own"]
    assert any("scaled from others" in r.text for r in plans["default"].reasons)  # it was an extrapolation
    steps = {k: decode_step_ms(plans[k], records[k]) for k in plans}
    assert steps["default"] == pytest.approx(steps["own"], rel=0.2)


def decode_step_ms(plan, record: CalibrationRecord) -> float:
    """The decode step the cost model prices for the plan, from the record's times."""
    qconfig = plan.quantization_config or {}
    cost = request_cost(record, engine_linears(plan.layers), plan.path, plan.layout,
                        dequant_threshold=qconfig.get("dequant_threshold", 128),
                        prefill_dtype=qconfig.get("prefill_dtype", "bfloat16"),
                        decode_kernel=qconfig.get("decode_kernel") or DEFAULT_DECODE_KERNEL)  # fmt: skip
    return cost.decode_step_ms


@pytest.mark.parametrize("host", hosts())
def test_the_default_models_record_prices_the_1bs_own_shapes_within_a_quarter_kernel_by_kernel(host):
    """Every kernel the 1B's record timed, at every shape the default model's record did not time and every row
    count: the median of priced / measured over those points, per kernel. Measured on the Zen 4: 0.97-1.23 (single
    points 0.45-2.09: two runs of a shared VM, and dequantizing kernels whose cache behaviour changes with shape)."""
    default = CalibrationRecord.model_validate_json((DATA / f"calibration_{host}.json").read_text())
    own = CalibrationRecord.model_validate_json((DATA / f"calibration_{host}_1b.json").read_text())
    timed = {(t.n, t.k) for result in default.kernels for t in result.times}
    medians = {}
    for result in own.kernels:
        priced = default.timed(result.kernel)
        if result.status != "ok" or priced is None:
            continue
        times = KernelTimes(priced)
        ratios = [times.ms(t.n, t.k, t.m) / t.ms for t in result.times if (t.n, t.k) not in timed]
        medians[result.kernel] = statistics.median(ratios)
    assert len(medians) >= 8
    assert all(0.8 <= m <= 1.25 for m in medians.values()), medians
