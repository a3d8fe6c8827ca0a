"""What a request that fails gets back: the 422s and 503s the API answers, counted in /metrics when they come
from a planning path (`/plan...`).

`add_exception_handlers(app)` installs them; `input_error_response` is the 422 for an edge.errors.InputError at
a place in the request (routes that refuse a request themselves answer with it too).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse

from edge.errors import InputError
from server.planning import LocatedInputError
from server.schemas import ErrorItem
from server.store_error import StoreUnavailable

PLANNING = "/plan"  # the paths whose errors count as planning errors in /metrics


def input_error_response(loc: list[str | int], error: InputError) -> JSONResponse:
    item = ErrorItem(loc=loc, msg=str(error), type="input_error", field=error.field)
    return JSONResponse({"detail": [item.model_dump()]}, status_code=422)


def _planning_error(request: Request, kind: str) -> None:
    if request.url.path.startswith(PLANNING):
        request.app.state.metrics.planning_error(kind)


async def located_input_error(request: Request, exc: LocatedInputError) -> JSONResponse:
    _planning_error(request, "input")
    return input_error_response(exc.loc, exc.error)


async def input_error(request: Request, exc: InputError) -> JSONResponse:
    _planning_error(request, "input")
    return input_error_response(["body", exc.field], exc)


async def store_unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
    _planning_error(request, "store")
    return JSONResponse({"detail": str(exc)}, status_code=503)


# A validation 422 names each problem and the value it was given, shortened: FastAPI's own handler echoes every
# error's whole input (a union's error carries the whole object it was given), so a body at the size limit could
# come back several times over, and whatever it held with it (issue 24).
MAX_ERRORS = 16
MAX_VALUE_CHARS = 120


def shown(value: Any) -> str:
    """A request value as a 422 names it: a scalar's repr (cut at MAX_VALUE_CHARS), a container by its size."""
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)} items"
    text = repr(value)
    return text if len(text) <= MAX_VALUE_CHARS else f"{text[:MAX_VALUE_CHARS]}... ({len(text)} characters)"


async def request_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    _planning_error(request, "request")
    errors = exc.errors()
    items = [
        ErrorItem(loc=list(e["loc"]), msg=f"{e['msg']}, got {shown(e.get('input'))}", type=e["type"]).model_dump()
        for e in errors[:MAX_ERRORS]
    ]
    body: dict[str, Any] = {"detail": items}
    if len(errors) > MAX_ERRORS:
        body["more_errors"] = len(errors) - MAX_ERRORS
    return JSONResponse(body, status_code=422)


async def internal_error(request: Request, exc: Exception) -> PlainTextResponse:
    _planning_error(request, "internal")  # counted, then Starlette logs and re-raises it
    return PlainTextResponse("Internal Server Error", status_code=500)


def add_exception_handlers(app: FastAPI) -> None:
    app.add_exception_handler(LocatedInputError, located_input_error)
    app.add_exception_handler(InputError, input_error)
    app.add_exception_handler(StoreUnavailable, store_unavailable)
    app.add_exception_handler(RequestValidationError, request_invalid)
    app.add_exception_handler(Exception, internal_error)
