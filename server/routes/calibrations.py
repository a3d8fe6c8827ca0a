"""Calibration record routes: store what a box measured (POST /calibrations), list what is stored
(GET /calibrations, a page at a time), remove a record (DELETE /calibrations/{digest}, the API token only).
The store is `request.app.state.calibrations` (server.calibrations.CalibrationStore).

The bearer-token middleware says which token a request carries in `request.state.token_role`: "api" (the
administrator's) or "report" (what boxes post with). Absent (no token configured, or a middleware that does not
say), the request is the API token's.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Query, Request, Response
from fastapi.responses import JSONResponse

from edge.device.calibration import parse
from edge.errors import InputError
from server.planning import LocatedInputError
from server.schemas import CalibrationStored, CalibrationSummary

router = APIRouter()
MAX_PAGE = 1000  # summaries per GET /calibrations
ADMIN_ROLE = "api"


def token_role(request: Request) -> str:
    return getattr(request.state, "token_role", None) or ADMIN_ROLE


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
            description="A calibration record as `edge-calibrate --json` prints it (edge.device.calibration."
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
    created = request.app.state.calibrations.add(record, posted_by=token_role(request))
    response.status_code = 201 if created else 200
    return CalibrationStored(key=record.key, digest=record.digest, created=created)


@router.get(
    "/calibrations",
    response_model=list[CalibrationSummary],
    tags=["calibrations"],
    summary="The stored calibration records, newest measurement first, a page at a time",
)
def get_calibrations(
    request: Request,
    cpu_model: Annotated[
        str | None, Query(max_length=256, description="Only this CPU model's, e.g. 'AMD EPYC'.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="At most this many summaries.")] = 100,
    offset: Annotated[int, Query(ge=0, le=1 << 31, description="Skip this many first (the next page).")] = 0,
) -> list[CalibrationSummary]:
    return request.app.state.calibrations.summaries(cpu_model, limit=limit, offset=offset)


@router.delete(
    "/calibrations/{digest}",
    status_code=204,
    tags=["calibrations"],
    summary="Remove a stored calibration record (the API token only)",
    responses={403: {"description": "The request's token is not the API token."},
               404: {"description": "No record has this digest."}},  # fmt: skip
)
def delete_calibration(
    digest: Annotated[str, Path(pattern="^[0-9a-f]{16}$", description="The record's digest (GET /calibrations).")],
    request: Request,
) -> Response:
    role = token_role(request)
    if role != ADMIN_ROLE:
        return JSONResponse({"detail": f"removing a record needs the API token, not the {role} token"}, 403)
    if not request.app.state.calibrations.delete(digest):
        return JSONResponse({"detail": f"no calibration record {digest}"}, 404)
    return Response(status_code=204)


def _record_loc(field: str) -> list[str | int]:
    """'calibration.kernels.0.status' (edge.device.calibration.parse's field) -> ['body', 'kernels', 0, 'status']."""
    parts = field.split(".")[1:]
    return ["body", *(int(part) if part.isdigit() else part for part in parts)]
