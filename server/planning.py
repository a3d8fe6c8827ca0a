"""From an HTTP request body to a Plan: read the device and the model, parse the budget, call the planner.

Every edge.errors.InputError raised here or below keeps its field; `located()` says where in the body it is.
Quality and calibration records are read once per request, not once per device.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from edge.bounds import check_finite_numbers
from edge.device import calibration
from edge.device.calibration import CalibrationRecord
from edge.device.cpuinfo import parse_cpuinfo
from edge.device.describe import parse_device_json, parse_size
from edge.device.lscpu import parse_lscpu
from edge.device.nfd import parse_nfd_labels
from edge.device.profile import DeviceProfile
from edge.errors import InputError
from edge.measure.quality import QualityRecord, cached_records
from edge.model.gguf_metadata import header_from_json
from edge.model.reader import default_model, read_gguf_header, read_model_config
from edge.model.shapes import ModelShape
from edge.plan.inputs import gather
from edge.plan.schema import Plan
from server.schemas import (
    ConfigModel,
    CpuinfoDevice,
    GgufModel,
    LscpuDevice,
    NfdDevice,
    PlanOptions,
    PlanRequest,
    ProfileDevice,
)

if TYPE_CHECKING:  # the store is built on first use (server/store.py): SQLAlchemy with it
    from server.calibrations import CalibrationStore

AnyDevice = ProfileDevice | CpuinfoDevice | NfdDevice | LscpuDevice


class LocatedInputError(Exception):
    """An InputError and where in the request body it came from (for the 422's `loc`)."""

    def __init__(self, loc: list[str | int], error: InputError) -> None:
        super().__init__(str(error))
        self.loc = loc
        self.error = error


def _located(loc: list[str | int], fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except InputError as exc:
        raise LocatedInputError(loc, exc) from exc


def read_device(device: AnyDevice) -> DeviceProfile:
    """The device's profile; every number in its JSON finite and bounded first (edge.bounds)."""
    if isinstance(device, ProfileDevice):
        check_finite_numbers(device.profile, "profile")
        return parse_device_json(device.profile)
    if isinstance(device, CpuinfoDevice):
        return parse_cpuinfo(device.cpuinfo, meminfo=device.meminfo, name=device.name)
    if isinstance(device, LscpuDevice):
        check_finite_numbers(device.lscpu, "lscpu")
        return parse_lscpu({"lscpu": device.lscpu}, name=device.name, meminfo=device.meminfo)
    check_finite_numbers(device.nfd_labels, "nfd_labels")
    return parse_nfd_labels(device.nfd_labels, name=device.name)


def _device_key(device: AnyDevice) -> str:
    if isinstance(device, ProfileDevice):
        return "profile"
    if isinstance(device, LscpuDevice):
        return "lscpu"
    return "cpuinfo" if isinstance(device, CpuinfoDevice) else "nfd_labels"


def read_model(options: PlanOptions) -> ModelShape:
    model = options.model
    if isinstance(model, ConfigModel):
        _located(["body", "model", "config"], check_finite_numbers, model.config, "config")
        name = model.name or str(model.config.get("_name_or_path") or "model")
        return _located(["body", "model", "config"], read_model_config, model.config, name)
    if isinstance(model, GgufModel):
        _located(["body", "model", "gguf"], check_finite_numbers, model.gguf.metadata, "gguf.metadata")
        header = _located(["body", "model", "gguf"], header_from_json, model.gguf.model_dump())
        name = model.name or str(header.metadata.get("general.name") or "model")
        return _located(["body", "model", "gguf"], read_gguf_header, header, name)
    return default_model()


def budget_bytes(options: PlanOptions) -> int | None:
    budget = options.memory_budget
    if budget is None:
        return None
    if isinstance(budget, int) and budget <= 0:
        raise LocatedInputError(
            ["body", "memory_budget"], InputError("memory_budget", budget, "a positive number of bytes")
        )
    return _located(["body", "memory_budget"], parse_size, budget, "memory_budget")


def calibration_records(store: CalibrationStore, devices: Iterable[DeviceProfile]) -> list[CalibrationRecord]:
    """The records that can match these devices: the store's for their CPU models, and this host's own
    (edge-calibrate's, in the cache directory)."""
    cpu_models = [device.cpu_model.value for device in devices if device.cpu_model.value]
    return [*store.records(cpu_models), *calibration.cached_records()]


def plan_one(
    device: DeviceProfile,
    model: ModelShape,
    options: PlanOptions,
    budget: int | None,
    quality: list[QualityRecord],
    calibrations: list[CalibrationRecord],
    **pins,
) -> Plan:
    """One plan, ranked from the device's calibration record when one of `calibrations` matches it (the facts
    table's otherwise). `quality` and `calibrations` are read once per request, not once per device."""
    return gather(device, model, quality=quality, calibrations=calibrations).plan(
        priority=options.priority,
        budget_bytes=budget,
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_num_seqs,
        serving_mode=options.serving_mode,
        threads=options.threads,
        speculative=options.speculative,
        **pins,
    )


def plan_request(request: PlanRequest, store: CalibrationStore) -> Plan:
    """POST /plan: the request's device, model and options through the planner."""
    device_loc: list[str | int] = ["body", "device", _device_key(request.device)]
    device = _located(device_loc, read_device, request.device)
    model = read_model(request)
    budget = budget_bytes(request)
    pins = {"path": request.path, "layout": request.layout, "force": request.force}
    calibrations = calibration_records(store, [device])
    return _located(["body"], plan_one, device, model, request, budget, cached_records(), calibrations, **pins)
