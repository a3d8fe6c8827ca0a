"""What this box runs and whether it is up: the plan in force and the engine (GET /status), liveness and
readiness (/healthz, /readyz), Prometheus metrics (/metrics).

Read from `request.app.state`: `plan`, `weight_path`, `supervisor` (None on a planning-only server), `settings`,
`model_dir`, `metrics`, `metrics_http` (the client the lifespan opens for /metrics).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from server.schemas import DraftingStatus, Health, StatusResponse

router = APIRouter()


@router.get("/status", response_model=StatusResponse, tags=["engine"], summary="The plan in force and the engine")
async def get_status(request: Request) -> StatusResponse:
    state = request.app.state
    supervisor, settings = state.supervisor, state.settings
    return StatusResponse(
        plan=state.plan,
        engine=supervisor.status() if supervisor is not None else None,
        drafting=await _drafting(request) if supervisor is not None else None,
        weight_path=state.weight_path,
        openai_base_url=f"http://{settings.host}:{settings.port}/v1" if supervisor is not None else None,
        model_dir=state.model_dir,
    )


async def _drafting(request: Request) -> DraftingStatus | None:
    state = request.app.state
    spec = state.plan.speculative if state.plan is not None else None
    if spec is None or spec.method == "off":
        return None
    counts = await state.metrics.drafting(getattr(state, "metrics_http", None))
    if counts is None:
        return None
    drafted, accepted, drafts = counts["drafted_tokens"], counts["accepted_tokens"], counts["drafts"]
    return DraftingStatus(
        method=spec.method,
        num_speculative_tokens=spec.num_speculative_tokens,
        **counts,
        acceptance_rate=accepted / drafted if drafted else None,
        tokens_per_step=1 + accepted / drafts if drafts else None,
    )


@router.get("/healthz", response_model=Health, tags=["health"], summary="The API process is up")
async def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Health,
    tags=["health"],
    summary="Ready to serve (the engine is ready; a planning-only server always is)",
    responses={503: {"model": Health, "description": "The engine is not ready."}},
)
async def readyz(request: Request) -> Health | JSONResponse:
    supervisor = request.app.state.supervisor
    if supervisor is None:
        return Health(status="ready", state=None)
    if supervisor.is_ready:
        return Health(status="ready", state=supervisor.state)
    return JSONResponse(Health(status="not ready", state=supervisor.state).model_dump(), status_code=503)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    tags=["health"],
    summary="Prometheus metrics: this server's series (edge_*), then the engine's own (vLLM's)",
    responses={200: {"description": "Prometheus text format 0.0.4."}},
)
async def get_metrics(request: Request) -> Response:
    body = await request.app.state.metrics.exposition(getattr(request.app.state, "metrics_http", None))
    return Response(body, media_type=METRICS_CONTENT_TYPE)
