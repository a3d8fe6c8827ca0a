"""Does the cost model predict the engine's ordering? The calibration's kernel times beside vLLM's end to end.

    .venv/bin/python -m benchmarks.cost_vs_engine --engine RAW.json [--calibration FILE]

RAW.json is `benchmarks.bench_engine`'s raw results (its --work folder, one file per run; e.g. `--models default
--variants direct,bf16 --passes 2`). The calibration is this host's cached record (edge-calibrate) unless given.
For each variant the cost model's GEMM time for one 512-token prefill and one decode step (edge.measure.cost, with the
kernel values this host's plan writes) is set beside the engine's measured prefill and decode (median over passes),
as ms. The engine adds attention, sampling and its own per-step overhead, so absolute times differ; what the
planner needs is the ordering, and the report says whether it agrees.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from edge.catalog.quantized_layers import model_layers, rules_for
from edge.device import calibration
from edge.device.probe import probe
from edge.measure.cost import engine_linears, request_cost
from edge.model.reader import default_model, read_model
from edge.plan.planner import make_plan

# bench_engine variant -> (path, layout)
VARIANTS = {"bf16": ("bf16", None), "direct": ("w4a16-tinygemm", "direct"), "dual": ("w4a16-tinygemm", "dual"),
            "kernel-only": ("w4a16-tinygemm", "kernel-only"), "w4a8": ("w4a8-gptq", None),
            "cpu_w4a8": ("w4a8-gptq", None)}  # fmt: skip


def predicted(record, model, device, variant: str) -> tuple[float, float] | None:
    """(prefill ms for 512 tokens, decode step ms) of the GEMMs, by the cost model."""
    path, layout = VARIANTS[variant]
    plan = make_plan(device, model, path=path, layout=layout, force=True, calibration=record)
    layers = model_layers(model, rules_for(model, path, plan.group_size, "speed"))
    qc = plan.quantization_config or {}
    cost = request_cost(record, engine_linears(layers), path, layout,
                        dequant_threshold=qc.get("dequant_threshold", 128),
                        prefill_dtype=qc.get("prefill_dtype", "bfloat16"))  # fmt: skip
    return cost.prefill_ms, cost.decode_step_ms


def order(values: dict[str, float]) -> list[str]:
    return sorted(values, key=values.__getitem__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=Path, required=True, help="bench_engine's raw results (JSON)")
    parser.add_argument("--calibration", type=Path, help="a calibration record (default: this host's cached one)")
    parser.add_argument("--model", default="default", help="the engine results' model: default or a directory")
    args = parser.parse_args()
    device = probe()
    model = default_model() if args.model == "default" else read_model(args.model)
    record = (calibration.load_file(args.calibration) if args.calibration
              else calibration.best_match(calibration.cached_records(), device, model.name))  # fmt: skip
    if record is None:
        raise SystemExit("no calibration record of this CPU: run edge-calibrate first")
    raw = json.loads(args.engine.read_text())
    raw = raw["results"] if isinstance(raw, dict) else raw  # a driver that wrapped bench_engine's results
    runs = [r for r in raw if r.get("returncode") == 0 and r.get("decode")]
    measured: dict[str, tuple[float, float]] = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        if variant not in VARIANTS:
            continue
        mine = [r for r in runs if r["variant"] == variant]
        decode = statistics.median(r["decode"] for r in mine)
        prefill = statistics.median(r["prefill"] for r in mine)
        measured[variant] = (512 / prefill * 1e3, 1e3 / decode)
    model_costs = {v: predicted(record, model, device, v) for v in measured}
    print(f"# Cost model vs engine, {record.describe()}\n")
    print(f"Engine: {args.engine} (vLLM, {model.name}). Model: GEMM time only (edge.measure.cost).\n")
    print("| variant | model prefill ms | engine prefill ms | model decode step ms | engine decode step ms |")
    print("|---|---|---|---|---|")
    for v, (prefill, step) in measured.items():
        p_prefill, p_step = model_costs[v]
        print(f"| {v} | {p_prefill:.1f} | {prefill:.1f} | {p_step:.3f} | {step:.3f} |")
    for i, what in ((0, "prefill"), (1, "decode")):
        by_model = order({v: c[i] for v, c in model_costs.items()})
        by_engine = order({v: m[i] for v, m in measured.items()})
        verdict = "agrees" if by_model == by_engine else "DISAGREES"
        print(f"\n{what}: model orders {' < '.join(by_model)}; engine {' < '.join(by_engine)}: {verdict}")


if __name__ == "__main__":
    main()
