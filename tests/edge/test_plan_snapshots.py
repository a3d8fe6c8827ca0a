"""Refactors keep behaviour: the plan for every fixture device, model and priority is the one recorded in
`data/plan_snapshots.json` (each plan's full JSON by sha256, and its choice in words for a readable diff).

The inputs are what a fresh box plans with: the device descriptions under data/, the fixture configs and the
default model, the quality records the package ships, and the fixture calibration records where one matches the
device (as `edge-select` matches its cache). `make_plan` is pure, so the same code gives the same digests on
every host. A change that is meant to change plans regenerates the file and says so in its commit:

    .venv/bin/python -m tests.edge.test_plan_snapshots --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from edge.device.calibration import CalibrationRecord, best_match
from edge.device.describe import load_device_file
from edge.errors import InputError
from edge.measure.quality import shipped_records
from edge.model.reader import default_model, read_model
from edge.plan.planner import make_plan

DATA = Path(__file__).parent / "data"
SNAPSHOTS = DATA / "plan_snapshots.json"
DEVICE_PREFIXES = ("cpuinfo_", "device_", "inventory_", "lscpu_", "nfd_")
PRIORITIES = ("speed", "fidelity")


def device_files() -> list[Path]:
    return sorted(p for p in DATA.iterdir() if p.name.startswith(DEVICE_PREFIXES) and p.suffix in (".txt", ".json"))


def models() -> dict:
    found = {"default": default_model()}
    found.update({p.stem: read_model(p) for p in sorted((DATA / "configs").glob("*.json"))})
    return found


def calibrations() -> list[CalibrationRecord]:
    return [CalibrationRecord.model_validate_json(p.read_text()) for p in sorted(DATA.glob("calibration_*.json"))]


def plan_outcomes() -> dict[str, dict]:
    """Every combination's outcome: the plan's digest and its choice, or the refusal's field."""
    quality, records, outcomes = shipped_records(), calibrations(), {}
    for device_file in device_files():
        device = load_device_file(str(device_file))
        for model_name, model in models().items():
            record = best_match(records, device, model.name)
            for priority in PRIORITIES:
                key = f"{device_file.name} | {model_name} | {priority}"
                try:
                    plan = make_plan(device, model, priority=priority, quality=quality, calibration=record)
                except InputError as refused:
                    outcomes[key] = {"refused": refused.field}
                    continue
                qconfig = plan.quantization_config or {}
                outcomes[key] = {
                    "choice": f"{plan.path}/{plan.layout or '-'} decode {qconfig.get('decode_kernel', '-')}",
                    "sha256": hashlib.sha256(plan.model_dump_json().encode()).hexdigest()[:16],
                }
    return outcomes


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    return plan_outcomes()


def test_every_fixture_combination_has_a_recorded_plan(outcomes):
    recorded = json.loads(SNAPSHOTS.read_text())
    assert sorted(outcomes) == sorted(recorded)


def test_every_plan_is_the_recorded_one(outcomes):
    recorded = json.loads(SNAPSHOTS.read_text())
    changed = {key: {"recorded": recorded.get(key), "now": now} for key, now in outcomes.items()
               if recorded.get(key) != now}  # fmt: skip
    assert not changed, json.dumps(changed, indent=1)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(__doc__)
    SNAPSHOTS.write_text(json.dumps(plan_outcomes(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOTS}")
