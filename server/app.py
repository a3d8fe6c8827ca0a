"""The HTTP API: plan for any device, report what this box runs, forward /v1 to the engine it supervises.

`create_app()` with no supervisor is a planning service (fleet tooling); with one (edge-serve), it also runs
the engine for the plan in force. Nothing a request sends changes what runs: only the process that made the
app decides the plan and the engine.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.openapi.utils import get_openapi

from edge.plan.schema import Plan
from server.errors import add_exception_handlers
from server.metrics import ServiceMetrics
from server.middleware import BearerToken, BodyLimit, ForwardedPaths
from server.routes import calibrations, engine, proxy
from server.routes import plan as plan_routes
from server.settings import Settings
from server.store import LazyCalibrationStore
from server.supervisor.sockets import EngineTransport
from server.supervisor.supervisor import EngineSupervisor

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
DESCRIPTION = """\
How should model M run on CPU device D: the planner over HTTP, and the engine it chose for this box.

`/v1/*` (not listed here) is the engine's OpenAI-compatible API (vLLM), forwarded unchanged; every forwarded
response carries `X-Edge-Weight-Path: <path>[/<layout>]`. Errors in a request are 422 with the field named.
`/calibrations` keeps the kernel times boxes measured (`edge-serve --report-to`); `/plan` for a device of a CPU
with a stored record ranks from it, and the plan's `calibration` names it. `/metrics` is for Prometheus: this
server's series (`edge_*`), then the engine's own (vLLM's `vllm:*`).
"""


def weight_path(plan: Plan | None) -> str | None:
    if plan is None:
        return None
    return f"{plan.path}/{plan.layout}" if plan.layout else plan.path


def create_app(
    settings: Settings | None = None,
    *,
    supervisor: EngineSupervisor | None = None,
    plan: Plan | None = None,
    model_dir: str | None = None,
) -> FastAPI:
    settings = settings or Settings()
    app = FastAPI(title="edge-select", version="0.1.0", description=DESCRIPTION, lifespan=_lifespan)
    app.state.settings = settings
    app.state.calibrations = LazyCalibrationStore(settings.calibration_db)  # SQLAlchemy on first use
    app.state.weight_path = weight_path(plan)
    app.state.metrics = ServiceMetrics(supervisor, app.state.weight_path)
    app.state.engine_waits = proxy.EngineWaits(settings, app.state.metrics)
    app.state.supervisor = supervisor
    app.state.plan = plan
    app.state.model_dir = model_dir
    add_exception_handlers(app)
    # In this order, the OpenAPI document lists the paths as it always has
    app.include_router(plan_routes.router)
    app.include_router(calibrations.router)
    app.include_router(plan_routes.probe_router)
    app.include_router(engine.router)
    app.include_router(proxy.router)
    # The last added runs first: the token is checked before anything else looks at the request
    app.add_middleware(ForwardedPaths)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.api_token:
        app.add_middleware(
            BearerToken, token=settings.api_token, open_paths=OPEN_PATHS, report_token=settings.report_token
        )
        app.openapi = lambda: _with_bearer(app)
    return app


# vLLM's HTTP server closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE's default), and httpx keeps one
# for 5 s too: a request sent as the engine closed its connection failed with RemoteProtocolError and reached the
# client as a 503 (seen 2026-12-06, benchmarks/bench_serve.py rounds a few seconds apart). The proxy lets its idle
# connections go first.
ENGINE_KEEPALIVE_S = 2.0
# /metrics reads the engine's own with a client of its own: a flood of forwarded requests cannot starve a scrape
METRICS_CONNECTIONS = 2


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """The calibration store opened, the proxy's HTTP client (`app.state.http`, its connections bounded) and the
    metrics' (`app.state.metrics_http`), both to the engine's socket of the moment, the engine started; all closed
    again on the way out."""
    settings, store, supervisor = app.state.settings, app.state.calibrations, app.state.supervisor
    timeout = httpx.Timeout(connect=5.0, read=settings.proxy_timeout_s, write=60.0, pool=settings.proxy_pool_timeout_s)
    limits = httpx.Limits(max_connections=settings.proxy_max_connections,
                          max_keepalive_connections=settings.proxy_max_connections,
                          keepalive_expiry=ENGINE_KEEPALIVE_S)  # fmt: skip

    def engine_socket():
        return supervisor.socket_path if supervisor is not None else None

    await run_in_threadpool(store.open)
    async with (
        httpx.AsyncClient(timeout=timeout, transport=EngineTransport(engine_socket, limits=limits)) as client,
        httpx.AsyncClient(
            transport=EngineTransport(engine_socket, limits=httpx.Limits(max_connections=METRICS_CONNECTIONS,
                                                                         keepalive_expiry=ENGINE_KEEPALIVE_S))
        ) as metrics_client,
    ):
        app.state.http = client
        app.state.metrics_http = metrics_client
        if supervisor is not None:
            await supervisor.start()
        try:
            yield
        finally:
            if supervisor is not None:
                await supervisor.stop()
            store.close()


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
