"""Forward `/v1/*` to the engine so clients use one port; responses stream through as they arrive.

Only `/v1/*` reaches the engine: a path with a dot segment (`..`, `.`, percent-encoded or not) or a control
character is refused with 400 before anything is sent, so `/v1/../metrics` never becomes the engine's `/metrics`
(httpx resolves dot segments, and vLLM's `/metrics`, `/tokenize`, `/docs` need no key). The engine's own key
(`EngineSupervisor.api_key`) is added to every forwarded request; the caller's authorization is never passed on.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol
from urllib.parse import quote

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Send

log = logging.getLogger("edge.proxy")

WEIGHT_PATH_HEADER = "X-Edge-Weight-Path"

# Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection, not the message: these, and any that a
# `Connection` header names. Host and content-length are set anew by httpx; the caller's authorization is this
# server's token, not the engine's.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "transfer-encoding", "upgrade",
})  # fmt: skip
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-length", "authorization"}
# Date and Server: this server is the origin its clients talk to (a gateway, RFC 9110 3.7), and uvicorn writes
# its own of both on every response; the engine's would make two of each (seen: two `date`, two `server`).
_RESPONSE_DROP = _HOP_BY_HOP | {"date", "server"}


def _connection_options(headers: list[tuple[str, str]]) -> set[str]:
    """The header names a `Connection` header lists: hop-by-hop too (RFC 9110 7.6.1)."""
    return {
        option.strip().lower()
        for name, value in headers
        if name.lower() == "connection"
        for option in value.split(",")
        if option.strip()
    }


def end_to_end(headers: list[tuple[str, str]], drop: frozenset[str]) -> list[tuple[str, str]]:
    """The headers a proxy passes on: all but the hop-by-hop ones and `drop`; repeated headers kept in order."""
    dropped = drop | _connection_options(headers)
    return [(name, value) for name, value in headers if name.lower() not in dropped]


class UnsafePath(ValueError):
    """A /v1 path that could leave /v1 on its way to the engine, or that no engine route has."""


def engine_path(path: str) -> str:
    """The part of a request's (percent-decoded) path after `/v1/`, checked and percent-encoded again for the
    engine. Raises UnsafePath for a `.` or `..` segment (however it was encoded: the path arrives decoded) and for
    a control character."""
    segments = path.split("/")
    if any(segment in (".", "..") for segment in segments):
        raise UnsafePath(f"path /v1/{path!r}: a dot segment ('.' or '..') is not forwarded; expected /v1/<route>")
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in path):
        raise UnsafePath(f"path /v1/{path!r}: a control character is not forwarded; expected /v1/<route>")
    return quote(path, safe="/:@!$&'()*+,;=~")


def bad_request(message: str) -> JSONResponse:
    """400 in the OpenAI error shape."""
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": 400}}, status_code=400)


def engine_unavailable(
    message: str, state: str | None, weight_path: str | None, *, retry_after_s: int = 5
) -> JSONResponse:
    """503 in the OpenAI error shape, so OpenAI clients show the message; Retry-After says when to try again."""
    headers = {"Retry-After": str(retry_after_s)}
    if weight_path:
        headers[WEIGHT_PATH_HEADER] = weight_path
    body = {"error": {"message": message, "type": "engine_unavailable", "code": 503, "state": state}}
    return JSONResponse(body, status_code=503, headers=headers)


def engine_failed(message: str, status_code: int, weight_path: str | None) -> JSONResponse:
    """502 (the engine died while answering) or 504 (it did not answer in time), in the OpenAI error shape. The
    request is not sent again: the engine may have begun it."""
    headers = {WEIGHT_PATH_HEADER: weight_path} if weight_path else {}
    body = {"error": {"message": message, "type": "engine_error", "code": status_code}}
    return JSONResponse(body, status_code=status_code, headers=headers)


# What vLLM answers (500) for a request its engine core can no longer serve: a dead engine core, or one being shut
# down (vllm/v1/engine/exceptions.py, EngineDeadError)
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue"
MAX_ERROR_BODY = 1 << 16  # of an engine's 5xx answer read to tell a dead engine's


def _vllm_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return text[:300]


class NotSent(Exception):
    """The engine never read the request: its socket refused the connection, or was closed with the request unread.
    The request may wait for the next engine and be sent to it."""


def _reset_unread(exc: BaseException) -> bool:
    """Whether a transport error is the engine's Unix socket closed with this request unread. Linux's AF_UNIX
    (net/unix/af_unix.c, unix_release_sock) resets the peer (ECONNRESET; EPIPE for a write) only when the closing
    end still held unread data or had not yet accepted the connection; an engine that read the request and died
    meanwhile closes with nothing unread, and the proxy reads an end of file (RemoteProtocolError) instead. So a
    reset means the engine never read the whole request and cannot have begun it. Every request to the engine goes
    over its Unix socket (server/supervisor/sockets.EngineTransport)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _noop(*_: object) -> None:
    pass


class EngineWatch(Protocol):
    """Who is told how forwarded requests wait on the engine (EngineSupervisor: a wedge with requests waiting)."""

    def waiting(self, delta: int) -> None: ...  # +1 a request begins to wait for the engine's next bytes, -1 it stops

    def progressed(self) -> None: ...  # bytes of an answer arrived


class _Unwatched:
    def waiting(self, delta: int) -> None:
        pass

    def progressed(self) -> None:
        pass


UNWATCHED = _Unwatched()


def sse_error(message: str) -> bytes:
    """A server-sent event in the OpenAI error shape: what OpenAI clients raise from when a stream fails."""
    error = {"error": {"message": message, "type": "engine_error", "code": 502}}
    return f"data: {json.dumps(error)}\n\n".encode()


async def _relay(
    upstream: httpx.Response,
    on_answer: Callable[[], None],
    on_failure: Callable[[str], None],
    what: str,
    watch: EngineWatch = UNWATCHED,
) -> AsyncIterator[bytes]:
    """The engine's bytes as they come; `on_answer` once the first arrives (or the body ends empty), `on_failure`
    when the engine breaks off mid-response (it died, or was stopped as unresponsive). That ends the stream, not the
    server; an event stream ends with an error event, so that the client does not take it for a complete answer."""
    answered = False
    chunks = upstream.aiter_raw()
    try:
        while True:
            watch.waiting(1)
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            finally:
                watch.waiting(-1)
            watch.progressed()
            if not answered:
                answered = True
                on_answer()
            yield chunk
    except httpx.HTTPError as exc:
        log.warning("engine response broke off: %s", exc)
        why = f"{what} broke off: {type(exc).__name__}: {exc}"
        on_failure(why)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            yield sse_error(f"the engine's answer broke off ({type(exc).__name__}): the engine stopped while "
                            "answering; this request was not sent again")
        return
    if not answered:
        on_answer()


class ForwardedResponse(StreamingResponse):
    """The engine's answer streamed to the client: each write to the client must be taken within
    `send_timeout_s` (one that stops reading is cut off), and the engine's response is closed however the stream
    ends, so that its connection goes back to the pool."""

    def __init__(
        self, content: AsyncIterator[bytes], *, status_code: int, upstream: httpx.Response, send_timeout_s: float
    ) -> None:
        super().__init__(content, status_code=status_code)
        self.upstream = upstream
        self.send_timeout_s = send_timeout_s

    async def stream_response(self, send: Send) -> None:
        async def bounded(message: Message) -> None:
            await asyncio.wait_for(send(message), self.send_timeout_s)

        try:
            await bounded({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await bounded({"type": "http.response.body", "body": chunk, "more_body": True})
            await bounded({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:
            log.warning("client took nothing for %g s: its stream cut off", self.send_timeout_s)
        finally:
            with anyio.CancelScope(shield=True):  # a client that went away cancels the stream
                await self.body_iterator.aclose()
                await self.upstream.aclose()


async def forward(
    request: Request,
    path: str,
    *,
    client: httpx.AsyncClient,
    engine_url: str,
    api_key: str,
    weight_path: str,
    state: Callable[[], str],
    send_timeout_s: float = 60.0,
    on_answer: Callable[[], None] = _noop,
    on_failure: Callable[[str], None] = _noop,
    watch: EngineWatch = UNWATCHED,
) -> Response:
    """The request sent on to the engine with the engine's key and its answer streamed back; 400 for a path that
    is not forwarded (engine_path). Raises NotSent when the engine's socket refuses the connection, or is closed
    with the request unread (_reset_unread): the engine never read it. A request the engine read is never sent
    again: 502 when the engine died before it answered (a broken connection, or vLLM's own 500 for a dead or
    stopping engine core), 504 when it did not answer within the read timeout
    (`state` says the engine's state then), 503 when no connection to it came free in time (this server's load).

    What the engine did is reported for its liveness: `on_answer()` once the first byte of an answer that is not
    a server error arrives, `on_failure(why)` for a timeout, a broken connection or a 5xx (not for a wait for a
    free connection to it: that is this server's load, not the engine's health)."""
    try:
        url = httpx.URL(f"{engine_url}/v1/{engine_path(path)}")
    except UnsafePath as exc:
        return bad_request(str(exc))
    if request.url.query:
        url = url.copy_with(query=request.url.query.encode("latin-1"))
    raw = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
    headers = [*end_to_end(raw, _REQUEST_DROP), ("authorization", f"Bearer {api_key}")]
    outgoing = client.build_request(request.method, url, headers=headers, content=await request.body())
    what = f"a forwarded {request.method} /v1/{path}"
    watch.waiting(1)
    try:
        upstream = await client.send(outgoing, stream=True)
    except httpx.ConnectError as exc:
        raise NotSent(f"{what}: the engine's socket refused it: {exc}") from exc
    except (httpx.ReadError, httpx.WriteError) as exc:
        if not _reset_unread(exc):
            on_failure(f"{what} did not answer: {type(exc).__name__}")
            return engine_failed(f"the engine stopped before it answered ({type(exc).__name__}: {exc}; engine "
                                 f"state: {state()}); this request was not sent again", 502, weight_path)  # fmt: skip
        raise NotSent(f"{what}: the engine's socket was closed with the request unread") from exc
    except httpx.PoolTimeout:
        return engine_unavailable("engine did not answer: PoolTimeout", state(), weight_path)
    except httpx.TimeoutException as exc:
        on_failure(f"{what} did not answer: {type(exc).__name__}")
        return engine_failed(f"the engine did not answer in time ({type(exc).__name__}; engine state: {state()}); "
                             "this request was not sent again", 504, weight_path)  # fmt: skip
    except httpx.HTTPError as exc:
        on_failure(f"{what} did not answer: {type(exc).__name__}")
        return engine_failed(f"the engine stopped before it answered ({type(exc).__name__}: {exc}; engine state: "
                             f"{state()}); this request was not sent again", 502, weight_path)  # fmt: skip
    finally:
        watch.waiting(-1)
    watch.progressed()
    if upstream.status_code >= 500:
        on_failure(f"{what} answered {upstream.status_code}")
        on_answer = _noop
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                body = await upstream.aread()
            except httpx.HTTPError:
                body = b""
            finally:
                await upstream.aclose()
            text = body[:MAX_ERROR_BODY].decode("utf-8", "replace")
            engine_state = state()
            if ENGINE_DEAD_MESSAGE in text or engine_state != "ready":
                return engine_failed(f"the engine stopped before it answered (it answered {upstream.status_code}: "
                                     f"{_vllm_message(text)}; engine state: {engine_state}); this request was not "
                                     "sent again", 502, weight_path)  # fmt: skip
            response = Response(body, status_code=upstream.status_code)
            passed = end_to_end(upstream.headers.multi_items(), _RESPONSE_DROP | {WEIGHT_PATH_HEADER.lower(),
                                                                                 "content-length"})  # fmt: skip
            response.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in passed]
            response.raw_headers += [(b"content-length", str(len(response.body)).encode()),
                                     (WEIGHT_PATH_HEADER.lower().encode("latin-1"), weight_path.encode("latin-1"))]
            return response
    passed = end_to_end(upstream.headers.multi_items(), _RESPONSE_DROP | {WEIGHT_PATH_HEADER.lower()})
    response = ForwardedResponse(
        _relay(upstream, on_answer, on_failure, what, watch),
        status_code=upstream.status_code,
        upstream=upstream,
        send_timeout_s=send_timeout_s,
    )
    # Set as a list: a dict would merge repeated headers (set-cookie) into one
    response.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in passed]
    response.raw_headers.append((WEIGHT_PATH_HEADER.lower().encode("latin-1"), weight_path.encode("latin-1")))
    return response
