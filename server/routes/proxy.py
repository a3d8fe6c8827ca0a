"""/v1/* (not in the OpenAPI document): the engine's OpenAI-compatible API, forwarded by server.proxy once the
engine is ready, a 503 in the OpenAI error shape until then (and always on a planning-only server).

Read from `request.app.state`: `supervisor`, `weight_path`, `settings`, `http` (the client the lifespan opens).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.proxy import engine_unavailable, forward

router = APIRouter()


@router.api_route(
    "/v1/{path:path}",
    methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
    include_in_schema=False,
)
async def v1(path: str, request: Request) -> Response:
    state = request.app.state
    supervisor = state.supervisor
    if supervisor is None:
        return engine_unavailable("this server only plans: no engine is running", None, None)
    if not supervisor.is_ready:
        engine_state = supervisor.state
        return engine_unavailable(f"engine is not ready (state: {engine_state})", engine_state, state.weight_path)
    return await forward(
        request,
        path,
        client=state.http,
        engine_url=supervisor.engine_url,
        api_key=supervisor.api_key,
        weight_path=state.weight_path or "",
        state=lambda: supervisor.state,
        send_timeout_s=state.settings.client_send_timeout_s,
        on_answer=supervisor.note_traffic,
        on_failure=supervisor.note_forward_failure,
    )
