"""What a plan is made from, gathered one way for every entry point (edge-select, POST /plan and GET /plan,
edge-serve and its dry run, edge-convert without --plan): the device, the model, edge-eval's quality records
and the device's calibration record. The same host and model then give the same plan through each.

    quality       the records the package ships and the ones edge-eval cached (edge.measure.quality)
    calibration   a record given as such (edge-select --calibration FILE); else the best match for the device
                  among `calibrations` (default: the cache's, edge-calibrate's records of this host and others)

Unlike make_plan this reads the cache directory; make_plan stays pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from edge.device.calibration import CalibrationRecord, best_match
from edge.device.calibration import cached_records as cached_calibrations
from edge.device.profile import DeviceProfile
from edge.measure.quality import QualityRecord, cached_records
from edge.model.shapes import ModelShape
from edge.plan.planner import make_plan
from edge.plan.schema import Plan


@dataclass(frozen=True)
class PlanInputs:
    device: DeviceProfile
    model: ModelShape
    quality: list[QualityRecord]
    calibration: CalibrationRecord | None

    def with_calibration(self, record: CalibrationRecord | None) -> PlanInputs:
        return replace(self, calibration=record)

    def plan(self, **options: Any) -> Plan:
        """make_plan on these inputs; `options` are its own (priority, budget_bytes, path, ...)."""
        return make_plan(self.device, self.model, quality=self.quality, calibration=self.calibration, **options)


def gather(device: DeviceProfile, model: ModelShape, *, quality: list[QualityRecord] | None = None,
           calibrations: Iterable[CalibrationRecord] | None = None,
           calibration: CalibrationRecord | None = None) -> PlanInputs:  # fmt: skip
    """The inputs of a plan for this device and model. `quality` and `calibrations` are for a caller that read
    them once for many devices (POST /plan/batch); `calibration` is a record the user named."""
    quality = cached_records() if quality is None else quality
    if calibration is None:
        records = cached_calibrations() if calibrations is None else calibrations
        calibration = best_match(records, device, model.name)
    return PlanInputs(device, model, quality, calibration)
