"""The HTTP API: plan for any device, report what this box runs, forward /v1 to the engine it supervises.

`create_app()` with no supervisor is a planning service (fleet tooling); with one (edge-serve), it also runs
the engine for the plan in force. Nothing a request sends changes what runs: only the process that made the
app decides the plan and the engine.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Annotated, Any

import httpx
from fastapi import Body, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from edge.calibration import best_match, parse
from edge.device import DeviceProfile
from edge.errors import InputError
from edge.model_reader import default_model
from edge.plan import Plan, Priority
from edge.planner import make_plan
from edge.probe import probe
from edge.quality import cached_records
from server import planning
from server.calibrations import CalibrationStore, StoreUnavailable
from server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from server.metrics import ServiceMetrics
from server.middleware import BearerToken, BodyLimit
from server.proxy import engine_unavailable, forward
from server.schemas import (
    BatchItem,
    BatchRequest,
    BatchResponse,
    CalibrationStored,
    CalibrationSummary,
    ErrorItem,
    Health,
    PlanRequest,
    StatusResponse,
)
from server.settings import Settings
from server.supervisor import EngineSupervisor

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
DESCRIPTION = """\
How should model M run on CPU device D: the planner over HTTP, and the engine it chose for this box.

`/v1/*` (not listed here) is the engine's OpenAI-compatible API (vLLM), forwarded unchanged; every forwarded
response carries `X-Edge-Weight-Path: <path>[/<layout>]`. Errors in a request are 422 with the field named.
`/calibrations` keeps the kernel times boxes measured (`edge-serve --report-to`); `/plan` for a device of a CPU
with a stored record ranks from it, and the plan's `calibration` names it. `/metrics` is for Prometheus: this
server's series (`edge_*`), then the engine's own (vLLM's `vllm:*`).
"""
PLANNING = "/plan"  # the paths whose errors count as planning errors in /metrics


def weight_path(plan: Plan | None) -> str | None:
    if plan is None:
        return None
    return f"{plan.path}/{plan.layout}" if plan.layout else plan.path


def _input_error_response(loc: list[str | int], error: InputError) -> JSONResponse:
    item = ErrorItem(loc=loc, msg=str(error), type="input_error", field=error.field)
    return JSONResponse({"detail": [item.model_dump()]}, status_code=422)


def _record_loc(field: str) -> list[str | int]:
    """'calibration.kernels.0.status' (edge.calibration.parse's field) -> ['body', 'kernels', 0, 'status']."""
    parts = field.split(".")[1:]
    return ["body", *(int(part) if part.isdigit() else part for part in parts)]


def create_app(
    settings: Settings | None = None,
    *,
    supervisor: EngineSupervisor | None = None,
    plan: Plan | None = None,
    model_dir: str | None = None,
) -> FastAPI:
    settings = settings or Settings()
    store = CalibrationStore(settings.calibration_db)
    metrics = ServiceMetrics(supervisor, weight_path(plan))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(connect=5.0, read=settings.proxy_timeout_s, write=60.0, pool=10.0)
        await run_in_threadpool(store.open)
        async with httpx.AsyncClient(timeout=timeout) as client:
            app.state.http = client
            if supervisor is not None:
                await supervisor.start()
            try:
                yield
            finally:
                if supervisor is not None:
                    await supervisor.stop()
                store.close()

    app = FastAPI(title="edge-select", version="0.1.0", description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    app.state.calibrations = store
    app.state.metrics = metrics

    def planning_error(request: Request, kind: str) -> None:
        if request.url.path.startswith(PLANNING):
            metrics.planning_error(kind)

    @app.exception_handler(planning.LocatedInputError)
    async def located_input_error(request: Request, exc: planning.LocatedInputError) -> JSONResponse:
        planning_error(request, "input")
        return _input_error_response(exc.loc, exc.error)

    @app.exception_handler(InputError)
    async def input_error(request: Request, exc: InputError) -> JSONResponse:
        planning_error(request, "input")
        return _input_error_response(["body", exc.field], exc)

    @app.exception_handler(StoreUnavailable)
    async def store_unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
        planning_error(request, "store")
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.exception_handler(RequestValidationError)
    async def request_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        planning_error(request, "request")
        return await request_validation_exception_handler(request, exc)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> PlainTextResponse:
        planning_error(request, "internal")  # counted, then Starlette logs and re-raises it
        return PlainTextResponse("Internal Server Error", status_code=500)

    @app.post("/plan", response_model=Plan, tags=["plan"], summary="Plan a model on a described device")
    def post_plan(request: PlanRequest) -> Plan:
        with metrics.planning("POST /plan"):
            return planning.plan_request(request, store)

    @app.post("/plan/batch", response_model=BatchResponse, tags=["plan"], summary="Plan one model on many devices")
    def post_plan_batch(request: BatchRequest) -> BatchResponse | JSONResponse:
        if len(request.devices) > settings.max_batch_devices:
            error = InputError("devices", len(request.devices), f"at most {settings.max_batch_devices} devices")
            metrics.planning_error("input")
            return _input_error_response(["body", "devices"], error)
        with metrics.planning("POST /plan/batch") as made:
            answer = plan_batch(request)
            made[0] = answer.planned
        metrics.planning_error("input", answer.failed)
        return answer

    def plan_batch(request: BatchRequest) -> BatchResponse:
        model = planning.read_model(request)
        budget = planning.budget_bytes(request)
        results: list[BatchItem | None] = [None] * len(request.devices)
        profiles: dict[int, DeviceProfile] = {}
        for index, device in enumerate(request.devices):
            try:
                profiles[index] = planning.read_device(device)
            except InputError as exc:
                results[index] = _batch_error(index, exc)
        quality = cached_records()
        calibrations = planning.calibration_records(store, profiles.values())
        for index, profile in profiles.items():
            try:
                made = planning.plan_one(profile, model, request, budget, quality, calibrations)
                results[index] = BatchItem(index=index, plan=made)
            except InputError as exc:
                results[index] = _batch_error(index, exc)
        done = [item for item in results if item is not None]
        planned = sum(item.plan is not None for item in done)
        return BatchResponse(results=done, planned=planned, failed=len(done) - planned)

    @app.get("/plan", response_model=Plan, tags=["plan"], summary="The plan in force, or a plan for this host")
    def get_plan(
        priority: Annotated[Priority, Query(description="Used only when no plan is in force.")] = "speed",
    ) -> Plan:
        if plan is not None:
            return plan
        with metrics.planning("GET /plan"):
            device, model = probe(), default_model()
            calibration = best_match(planning.calibration_records(store, [device]), device, model.name)
            return make_plan(device, model, priority=priority, quality=cached_records(), calibration=calibration)

    @app.post(
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
        response: Response,
    ) -> CalibrationStored:
        try:
            record = parse(body)
        except InputError as exc:
            raise planning.LocatedInputError(_record_loc(exc.field), exc) from exc
        created = store.add(record)
        response.status_code = 201 if created else 200
        return CalibrationStored(key=record.key, digest=record.digest, created=created)

    @app.get(
        "/calibrations",
        response_model=list[CalibrationSummary],
        tags=["calibrations"],
        summary="The stored calibration records, newest measurement first",
    )
    def get_calibrations(
        cpu_model: Annotated[
            str | None, Query(max_length=256, description="Only this CPU model's, e.g. 'AMD EPYC'.")
        ] = None,
    ) -> list[CalibrationSummary]:
        return store.summaries(cpu_model)

    @app.get("/probe", response_model=DeviceProfile, tags=["plan"], summary="This host's device profile")
    def get_probe() -> DeviceProfile:
        return probe()

    @app.get("/status", response_model=StatusResponse, tags=["engine"], summary="The plan in force and the engine")
    async def get_status() -> StatusResponse:
        return StatusResponse(
            plan=plan,
            engine=supervisor.status() if supervisor is not None else None,
            weight_path=weight_path(plan),
            openai_base_url=f"http://{settings.host}:{settings.port}/v1" if supervisor is not None else None,
            model_dir=model_dir,
        )

    @app.get("/healthz", response_model=Health, tags=["health"], summary="The API process is up")
    async def healthz() -> Health:
        return Health(status="ok")

    @app.get(
        "/readyz",
        response_model=Health,
        tags=["health"],
        summary="Ready to serve (the engine is ready; a planning-only server always is)",
        responses={503: {"model": Health, "description": "The engine is not ready."}},
    )
    async def readyz() -> Health | JSONResponse:
        if supervisor is None:
            return Health(status="ready", state=None)
        if supervisor.is_ready:
            return Health(status="ready", state=supervisor.state)
        return JSONResponse(Health(status="not ready", state=supervisor.state).model_dump(), status_code=503)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        tags=["health"],
        summary="Prometheus metrics: this server's series (edge_*), then the engine's own (vLLM's)",
        responses={200: {"description": "Prometheus text format 0.0.4."}},
    )
    async def get_metrics(request: Request) -> Response:
        body = await metrics.exposition(getattr(request.app.state, "http", None))
        return Response(body, media_type=METRICS_CONTENT_TYPE)

    @app.api_route(
        "/v1/{path:path}",
        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
        include_in_schema=False,
    )
    async def v1(path: str, request: Request) -> Response:
        if supervisor is None:
            return engine_unavailable("this server only plans: no engine is running", None, None)
        if not supervisor.is_ready:
            state = supervisor.state
            return engine_unavailable(f"engine is not ready (state: {state})", state, weight_path(plan))
        supervisor.note_traffic()
        return await forward(
            request,
            path,
            client=request.app.state.http,
            engine_url=supervisor.engine_url,
            weight_path=weight_path(plan) or "",
            state=lambda: supervisor.state,
        )

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.api_token:
        app.add_middleware(BearerToken, token=settings.api_token, open_paths=OPEN_PATHS)
        app.openapi = lambda: _with_bearer(app)
    return app


def _batch_error(index: int, exc: InputError) -> BatchItem:
    loc: list[str | int] = ["body", "devices", index]
    return BatchItem(index=index, error=ErrorItem(loc=loc, msg=str(exc), type="input_error", field=exc.field))


def _with_bearer(app: FastAPI) -> dict:
    """The OpenAPI schema, saying which operations need the bearer token (all but health)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema["paths"].items():
            if path not in OPEN_PATHS:
                for operation in operations.values():
                    operation["security"] = [{"bearer": []}]
        app.openapi_schema = schema
    return app.openapi_schema
