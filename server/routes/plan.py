"""Planning routes: a plan for a described device (POST /plan), for many (POST /plan/batch), the plan in force
or one for this host (GET /plan), and this host's profile (GET /probe).

Read from `request.app.state`: `settings`, `calibrations` (the store), `metrics`, `plan` (the plan in force).
`probe_router` holds GET /probe apart so that the app can include it where it always stood (after
/calibrations): the OpenAPI document keeps its order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from edge.device.probe import probe
from edge.device.profile import DeviceProfile
from edge.errors import InputError
from edge.measure.quality import cached_records
from edge.model.reader import default_model
from edge.plan.inputs import gather
from edge.plan.schema import Plan, Priority
from server import planning
from server.errors import input_error_response
from server.schemas import BatchItem, BatchRequest, BatchResponse, ErrorItem, InvalidDevice, PlanRequest

if TYPE_CHECKING:  # the store is built on first use (server/store.py): SQLAlchemy with it
    from server.calibrations import CalibrationStore

router = APIRouter()
probe_router = APIRouter()


@router.post("/plan", response_model=Plan, tags=["plan"], summary="Plan a model on a described device")
def post_plan(body: PlanRequest, request: Request) -> Plan:
    state = request.app.state
    with state.metrics.planning("POST /plan"):
        return planning.plan_request(body, state.calibrations)


@router.post("/plan/batch", response_model=BatchResponse, tags=["plan"], summary="Plan one model on many devices")
def post_plan_batch(body: BatchRequest, request: Request) -> BatchResponse | JSONResponse:
    state = request.app.state
    max_devices = state.settings.max_batch_devices
    if len(body.devices) > max_devices:
        error = InputError("devices", len(body.devices), f"at most {max_devices} devices")
        state.metrics.planning_error("input")
        return input_error_response(["body", "devices"], error)
    with state.metrics.planning("POST /plan/batch") as made:
        answer = _plan_batch(body, state.calibrations)
        made[0] = answer.planned
    state.metrics.planning_error("input", answer.failed)
    return answer


@router.get("/plan", response_model=Plan, tags=["plan"], summary="The plan in force, or a plan for this host")
def get_plan(
    request: Request,
    priority: Annotated[Priority, Query(description="Used only when no plan is in force.")] = "speed",
) -> Plan:
    state = request.app.state
    if state.plan is not None:
        return state.plan
    with state.metrics.planning("GET /plan"):
        device, model = probe(), default_model()
        calibrations = planning.calibration_records(state.calibrations, [device])
        return gather(device, model, calibrations=calibrations).plan(priority=priority)


@probe_router.get("/probe", response_model=DeviceProfile, tags=["plan"], summary="This host's device profile")
def get_probe() -> DeviceProfile:
    return probe()


def _plan_batch(batch: BatchRequest, store: CalibrationStore) -> BatchResponse:
    model = planning.read_model(batch)
    budget = planning.budget_bytes(batch)
    results: list[BatchItem | None] = [None] * len(batch.devices)
    profiles: dict[int, DeviceProfile] = {}
    for index, device in enumerate(batch.devices):
        if isinstance(device, InvalidDevice):
            results[index] = _invalid_device(index, device)
            continue
        try:
            profiles[index] = planning.read_device(device)
        except InputError as exc:
            results[index] = _batch_error(index, exc)
    quality = cached_records()
    calibrations = planning.calibration_records(store, profiles.values())
    for index, profile in profiles.items():
        try:
            made = planning.plan_one(profile, model, batch, budget, quality, calibrations)
            results[index] = BatchItem(index=index, plan=made)
        except InputError as exc:
            results[index] = _batch_error(index, exc)
    done = [item for item in results if item is not None]
    planned = sum(item.plan is not None for item in done)
    return BatchResponse(results=done, planned=planned, failed=len(done) - planned)


def _invalid_device(index: int, device: InvalidDevice) -> BatchItem:
    """The first of the device's validation errors, located in the request as a 422's would be."""
    first = device.errors[0]
    loc: list[str | int] = ["body", "devices", index, *first["loc"]]
    return BatchItem(index=index, error=ErrorItem(loc=loc, msg=first["msg"], type=first["type"]))


def _batch_error(index: int, exc: InputError) -> BatchItem:
    loc: list[str | int] = ["body", "devices", index]
    return BatchItem(index=index, error=ErrorItem(loc=loc, msg=str(exc), type="input_error", field=exc.field))
