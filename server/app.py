"""The HTTP API: plan for any device, report what this box runs, forward /v1 to the engine it supervises.

`create_app()` with no supervisor is a planning service (fleet tooling); with one (edge-serve), it also runs
the engine for the plan in force. Nothing a request sends changes what runs: only the process that made the
app decides the plan and the engine.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Annotated

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from edge.device import DeviceProfile
from edge.errors import InputError
from edge.model_reader import default_model
from edge.plan import Plan, Priority
from edge.planner import make_plan
from edge.probe import probe
from edge.quality import cached_records
from server import planning
from server.middleware import BearerToken, BodyLimit
from server.proxy import engine_unavailable, forward
from server.schemas import (
    BatchItem,
    BatchRequest,
    BatchResponse,
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
"""


def weight_path(plan: Plan | None) -> str | None:
    if plan is None:
        return None
    return f"{plan.path}/{plan.layout}" if plan.layout else plan.path


def _input_error_response(loc: list[str | int], error: InputError) -> JSONResponse:
    item = ErrorItem(loc=loc, msg=str(error), type="input_error", field=error.field)
    return JSONResponse({"detail": [item.model_dump()]}, status_code=422)


def create_app(
    settings: Settings | None = None,
    *,
    supervisor: EngineSupervisor | None = None,
    plan: Plan | None = None,
    model_dir: str | None = None,
) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(connect=5.0, read=settings.proxy_timeout_s, write=60.0, pool=10.0)
        async with httpx.AsyncClient(timeout=timeout) as client:
            app.state.http = client
            if supervisor is not None:
                await supervisor.start()
            try:
                yield
            finally:
                if supervisor is not None:
                    await supervisor.stop()

    app = FastAPI(title="edge-select", version="0.1.0", description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings

    @app.exception_handler(planning.LocatedInputError)
    async def located_input_error(request: Request, exc: planning.LocatedInputError) -> JSONResponse:
        return _input_error_response(exc.loc, exc.error)

    @app.exception_handler(InputError)
    async def input_error(request: Request, exc: InputError) -> JSONResponse:
        return _input_error_response(["body", exc.field], exc)

    @app.post("/plan", response_model=Plan, tags=["plan"], summary="Plan a model on a described device")
    def post_plan(request: PlanRequest) -> Plan:
        return planning.plan_request(request)

    @app.post("/plan/batch", response_model=BatchResponse, tags=["plan"], summary="Plan one model on many devices")
    def post_plan_batch(request: BatchRequest) -> BatchResponse | JSONResponse:
        if len(request.devices) > settings.max_batch_devices:
            error = InputError("devices", len(request.devices), f"at most {settings.max_batch_devices} devices")
            return _input_error_response(["body", "devices"], error)
        model = planning.read_model(request)
        budget = planning.budget_bytes(request)
        quality = cached_records()
        results = []
        for index, device in enumerate(request.devices):
            try:
                profile = planning.read_device(device)
                results.append(BatchItem(index=index, plan=planning.plan_one(profile, model, request, budget, quality)))
            except InputError as exc:
                loc: list[str | int] = ["body", "devices", index]
                error = ErrorItem(loc=loc, msg=str(exc), type="input_error", field=exc.field)
                results.append(BatchItem(index=index, error=error))
        planned = sum(item.plan is not None for item in results)
        return BatchResponse(results=results, planned=planned, failed=len(results) - planned)

    @app.get("/plan", response_model=Plan, tags=["plan"], summary="The plan in force, or a plan for this host")
    def get_plan(
        priority: Annotated[Priority, Query(description="Used only when no plan is in force.")] = "speed",
    ) -> Plan:
        if plan is not None:
            return plan
        return make_plan(probe(), default_model(), priority=priority, quality=cached_records())

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
        return await forward(
            request,
            path,
            client=request.app.state.http,
            engine_url=supervisor.engine_url,
            weight_path=weight_path(plan) or "",
            state=supervisor.state,
        )

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.api_token:
        app.add_middleware(BearerToken, token=settings.api_token, open_paths=OPEN_PATHS)
        app.openapi = lambda: _with_bearer(app)
    return app


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
