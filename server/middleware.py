"""ASGI guards in front of the app: the bearer token, the request body limit, and the paths forwarded to the
engine."""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.proxy import UnsafePath, bad_request, engine_path

# What the report token may do: post a calibration record, nothing else (not even read them back).
REPORT_ONLY = frozenset({("POST", "/calibrations")})


class BearerToken:
    """401 unless `Authorization: Bearer <token>`, with the API token or the report token; 403 for the report
    token anywhere but REPORT_ONLY. Checked before anything reads the body; health stays open for probes and load
    balancers (`open_paths`, matched exactly).

    The request's `scope["state"]["token_role"]` says which token it carried: "api" or "report" (handlers read
    it, taking "api" when it is absent: a server without a token)."""

    def __init__(
        self, app: ASGIApp, token: str, open_paths: frozenset[str], report_token: str | None = None
    ) -> None:
        self.app = app
        self.expected = {"api": f"Bearer {token}".encode()}
        if report_token:
            self.expected["report"] = f"Bearer {report_token}".encode()
        self.open_paths = open_paths

    def role(self, given: bytes) -> str | None:
        """The role of the token given, or None; every token is compared, in constant time, whichever matches."""
        matched = [role for role, expected in self.expected.items() if hmac.compare_digest(given, expected)]
        return "api" if "api" in matched else next(iter(matched), None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        role = self.role(dict(scope["headers"]).get(b"authorization", b""))
        if role is None:
            response = JSONResponse(
                {"detail": "missing or wrong bearer token"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        elif role == "report" and (scope["method"], scope["path"]) not in REPORT_ONLY:
            response = JSONResponse(
                {"detail": f"the report token may only POST /calibrations, not {scope['method']} {scope['path']}"},
                status_code=403,
            )
        else:
            state = {**scope.get("state", {}), "token_role": role}
            await self.app({**scope, "state": state}, receive, send)
            return
        await response(scope, receive, send)


class BodyLimit:
    """413 for a body over max_bytes, whether declared (Content-Length) or streamed (chunked).

    The body is read here, up to the limit, and replayed to the app: the app never sees a partial body, and
    nothing past the limit is read into memory.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> JSONResponse:
        return JSONResponse({"detail": f"request body over the limit of {self.max_bytes} bytes"}, status_code=413)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await JSONResponse({"detail": "Content-Length is not a number"}, status_code=400)(scope, receive, send)
                return
            if int(declared) > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as streaming responses expect

        await self.app(scope, replay, send)


class ForwardedPaths:
    """400 for a /v1/ path that server.proxy.engine_path refuses (a dot segment, a control character), before
    routing: the router does not match a path holding a newline (its pattern's `.` stops there) and would answer
    404 instead of saying why."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            try:
                engine_path(scope["path"].removeprefix("/v1/"))
            except UnsafePath as exc:
                await bad_request(str(exc))(scope, receive, send)
                return
        await self.app(scope, receive, send)
