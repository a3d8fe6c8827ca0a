"""Calibration record routes: store what a box measured (POST /calibrations), list what is stored
(GET /calibrations). The store is `request.app.state.calibrations` (server.calibrations.CalibrationStore).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request, Response

from edge.calibration import parse
from edge.errors import InputError
from server.planning import LocatedInputError
from server.schemas import CalibrationStored, CalibrationSummary

router = APIRouter()


@router.post(
    "/calibrations",
    response_model=CalibrationStored,
    status_code=201,
    tags=["calibrations"],
    summary="Store a calibration record (what edge-calibrate measured on a box)",
    responses={200: {"model": CalibrationStored, "description": "The record was already stored."}},
)
def post_calibration(
    body: Annotated[
        dict[str, Any],
        Body(
            description="A calibration record as `edge-calibrate --json` prints it (edge.calibration."
            "CalibrationRecord). /plan for a device of its CPU then ranks from its kernel times."
        ),
    ],
    request: Request,
    response: Response,
) -> CalibrationStored:
    try:
        record = parse(body)
    except InputError as exc:
        raise LocatedInputError(_record_loc(exc.field), exc) from exc
    created = request.app.state.calibrations.add(record)
    response.status_code = 201 if created else 200
    return CalibrationStored(key=record.key, digest=record.digest, created=created)


@router.get(
    "/calibrations",
    response_model=list[CalibrationSummary],
    tags=["calibrations"],
    summary="The stored calibration records, newest measurement first",
)
def get_calibrations(
    request: Request,
    cpu_model: Annotated[
        str | None, Query(max_length=256, description="Only this CPU model's, e.g. 'AMD EPYC'.")
    ] = None,
) -> list[CalibrationSummary]:
    return request.app.state.calibrations.summaries(cpu_model)


def _record_loc(field: str) -> list[str | int]:
    """'calibration.kernels.0.status' (edge.calibration.parse's field) -> ['body', 'kernels', 0, 'status']."""
    parts = field.split(".")[1:]
    return ["body", *(int(part) if part.isdigit() else part for part in parts)]
