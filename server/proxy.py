"""Forward `/v1/*` to the engine so clients use one port; responses stream through as they arrive."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("edge.proxy")

WEIGHT_PATH_HEADER = "X-Edge-Weight-Path"

# Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection, not the message; host and content-length
# are set anew by httpx; the caller's authorization is this server's token, not the engine's.
_REQUEST_DROP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length", "authorization",
}  # fmt: skip
_RESPONSE_DROP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade",
}  # fmt: skip


def engine_unavailable(message: str, state: str | None, weight_path: str | None) -> JSONResponse:
    """503 in the OpenAI error shape, so OpenAI clients show the message."""
    headers = {"Retry-After": "5"}
    if weight_path:
        headers[WEIGHT_PATH_HEADER] = weight_path
    body = {"error": {"message": message, "type": "engine_unavailable", "code": 503, "state": state}}
    return JSONResponse(body, status_code=503, headers=headers)


async def _relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The engine's bytes as they come; an engine that dies mid-response ends the stream, not the server."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        log.warning("engine response broke off: %s", exc)


async def forward(
    request: Request, path: str, *, client: httpx.AsyncClient, engine_url: str, weight_path: str, state: str
) -> Response:
    url = httpx.URL(f"{engine_url}/v1/{path}")
    if request.url.query:
        url = url.copy_with(query=request.url.query.encode("latin-1"))
    headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _REQUEST_DROP]
    outgoing = client.build_request(request.method, url, headers=headers, content=await request.body())
    try:
        upstream = await client.send(outgoing, stream=True)
    except httpx.HTTPError as exc:
        return engine_unavailable(f"engine did not answer: {type(exc).__name__}", state, weight_path)
    response_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROP}
    response_headers[WEIGHT_PATH_HEADER] = weight_path
    return StreamingResponse(
        _relay(upstream),
        status_code=upstream.status_code,
        headers=response_headers,
        background=BackgroundTask(upstream.aclose),
    )
