"""The forwarded stream's own bounds: a client that stops reading is cut off and the engine's connection freed."""

from __future__ import annotations

import asyncio

import pytest

from server.proxy import ForwardedResponse


class Upstream:
    """The part of an httpx.Response a ForwardedResponse uses: closing it returns its connection to the pool."""

    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_a_client_that_stops_reading_is_cut_off_and_the_engine_connection_freed():
    chunks_sent = []

    async def endless():
        while True:
            yield b"data: {}\n\n"

    async def receive():
        await asyncio.Event().wait()  # the client never sends anything more, nor goes away

    async def send(message):
        if message["type"] == "http.response.body" and len(chunks_sent) == 2:
            await asyncio.Event().wait()  # it takes the first part of the body, then reads nothing more
        chunks_sent.append(message)

    upstream = Upstream()
    response = ForwardedResponse(endless(), status_code=200, upstream=upstream, send_timeout_s=0.05)
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    await asyncio.wait_for(response(scope, receive, send), timeout=30)  # a hang guard, not a speed requirement
    assert upstream.closed and [m["type"] for m in chunks_sent] == ["http.response.start", "http.response.body"]
