"""/v1/* (not in the OpenAPI document): the engine's OpenAI-compatible API, forwarded by server.proxy once the
engine is ready; always a 503 in the OpenAI error shape on a planning-only server.

A request that arrives while the engine is starting or restarting waits for it (as Ollama's wait while a model
loads), instead of a 503 that a fleet client would retry blind into the restart: up to `restart_wait_s` (60 s by
default; a client may ask for less with `X-Edge-Max-Wait: <seconds>`), at most `restart_queue` requests at once,
and only while its client stays connected. Past the bound or the deadline, or when the server is stopping, it gets
503 with Retry-After. It waits too when it meets the engine stopped (SIGSTOP, read from /proc per request), which
would take it and never answer, and when the engine's socket refused it or was closed with it unread (the engine
died as it was sent): the engine never read it. One the engine read is never sent again (server/proxy.py: 502,
504, or an error event).

Read from `request.app.state`: `supervisor`, `weight_path`, `settings`, `http` (the client the lifespan opens),
`metrics`, `engine_waits`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.metrics import ServiceMetrics
from server.proxy import NotSent, bad_request, engine_unavailable, forward
from server.settings import Settings
from server.supervisor.supervisor import EngineSupervisor

router = APIRouter()
log = logging.getLogger("edge.proxy")
MAX_WAIT_HEADER = "X-Edge-Max-Wait"
# A request the engine's socket refused while the supervisor still counts that engine ready is sent again after
# this long, if no other engine became ready meanwhile (a refusal that was not the engine's death)
RESEND_UNSENT_S = 1.0


class EngineWaits:
    """The requests waiting for an engine: bounded in number, each until its deadline or its client leaves."""

    def __init__(self, settings: Settings, metrics: ServiceMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.waiting = 0

    async def wait(
        self, request: Request, supervisor: EngineSupervisor, deadline: float, not_generation: int | None
    ) -> Response | None:
        """None once an engine is ready to take the request (not the one of `not_generation`, which refused it,
        unless RESEND_UNSENT_S passed with that one still ready); else the response that ends the request."""
        weight_path = request.app.state.weight_path
        if not supervisor.serving:
            self.metrics.refused.labels("stopping").inc()
            return engine_unavailable(f"engine is not serving (state: {supervisor.state})", supervisor.state,
                                      weight_path)  # fmt: skip
        if self.waiting >= self.settings.restart_queue:
            self.metrics.refused.labels("queue_full").inc()
            return engine_unavailable(
                f"engine is not ready (state: {supervisor.state}) and {self.waiting} requests already wait for it "
                f"(restart_queue {self.settings.restart_queue})", supervisor.state, weight_path,
                retry_after_s=self._retry_after(supervisor))  # fmt: skip
        left = deadline - time.monotonic()
        if left <= 0:
            return self._too_late(supervisor, weight_path)
        await request.body()  # read now: what is received next is the client's going away
        gone = asyncio.create_task(request.receive())
        ready = asyncio.create_task(self._engine_for(supervisor, deadline, not_generation))
        self.waiting += 1
        self.metrics.waiting.inc()
        try:
            done, _ = await asyncio.wait({gone, ready}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.waiting -= 1
            self.metrics.waiting.dec()
            for task in (gone, ready):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if ready in done and ready.result():
            return None
        if gone in done:
            self.metrics.abandoned.inc()
            log.info("a request waiting for the engine was given up by its client")
            return engine_unavailable("the client went away while the request waited", supervisor.state,
                                      weight_path)  # fmt: skip
        if not supervisor.serving:
            self.metrics.refused.labels("stopping").inc()
            return engine_unavailable(f"engine is not serving (state: {supervisor.state})", supervisor.state,
                                      weight_path)  # fmt: skip
        return self._too_late(supervisor, weight_path)

    @staticmethod
    async def _engine_for(supervisor: EngineSupervisor, deadline: float, not_generation: int | None) -> bool:
        """True once an engine is ready for the request: not the one of `not_generation`, which did not read it,
        unless that one is still ready RESEND_UNSENT_S later (a refusal that was not its death); False at the
        deadline or when the supervisor stops."""
        resend_at = time.monotonic() + RESEND_UNSENT_S
        while True:
            now = time.monotonic()
            if (supervisor.is_ready and (supervisor.generation != not_generation or now >= resend_at)
                    and not supervisor.engine_stopped()):
                return True
            if not supervisor.serving or now >= deadline:
                return False
            until = min(deadline, resend_at) if supervisor.is_ready and now < resend_at else deadline
            await supervisor.state_change(until - now)

    def _too_late(self, supervisor: EngineSupervisor, weight_path: str | None) -> Response:
        self.metrics.refused.labels("deadline").inc()
        return engine_unavailable(f"engine is not ready (state: {supervisor.state}) and did not become ready while "
                                  "the request waited", supervisor.state, weight_path,
                                  retry_after_s=self._retry_after(supervisor))  # fmt: skip

    def _retry_after(self, supervisor: EngineSupervisor) -> int:
        """When to try again: the next restart's delay when one is pending, else 5 s."""
        wait = supervisor.status().next_restart_in_s
        return max(1, math.ceil(wait)) + 5 if wait else 5


def max_wait(request: Request, settings: Settings) -> float | Response:
    """How long this request may wait for the engine: restart_wait_s, or less when the client asks."""
    asked = request.headers.get(MAX_WAIT_HEADER)
    if asked is None:
        return settings.restart_wait_s
    try:
        seconds = float(asked)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        return bad_request(f"header {MAX_WAIT_HEADER}: {asked!r} is not a number of seconds >= 0")
    return min(seconds, settings.restart_wait_s)


@router.api_route(
    "/v1/{path:path}",
    methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
    include_in_schema=False,
)
async def v1(path: str, request: Request) -> Response:
    state = request.app.state
    supervisor: EngineSupervisor | None = state.supervisor
    if supervisor is None:
        return engine_unavailable("this server only plans: no engine is running", None, None)
    wait = max_wait(request, state.settings)
    if isinstance(wait, Response):
        return wait
    deadline = time.monotonic() + wait
    waits: EngineWaits = state.engine_waits
    metrics: ServiceMetrics = state.metrics
    refused_by: int | None = None  # the engine (its generation) whose socket refused this request
    waited = False
    while True:
        if supervisor.engine_stopped():  # it would take the request and never answer: wait for the next engine
            refused_by = supervisor.generation
        if not supervisor.is_ready or refused_by is not None:
            if not waited:
                waited = True
                metrics.waited.inc()
            if (ended := await waits.wait(request, supervisor, deadline, refused_by)) is not None:
                return ended
        generation = supervisor.generation
        try:
            response = await forward(
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
                watch=supervisor,
            )
        except NotSent as exc:
            log.info("%s; it waits for the engine", exc)
            refused_by = generation
            continue
        if waited and response.status_code < 500:
            metrics.served_after_wait.inc()
        return response
