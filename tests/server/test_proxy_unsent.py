"""Which requests the proxy may send to the next engine: those the engine never read. On the engine's Unix socket,
Linux resets the client only when the engine's end closed with the request unread (or never accepted it); an
engine that read the request and died leaves an end of file. Real AF_UNIX sockets, no engine: the kernel's
behaviour that server/proxy._reset_unread rests on, and what forward() makes of each."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import httpx
import pytest
from starlette.requests import Request

from server.proxy import NotSent, forward

BODY = b'{"prompt": "hi", "max_tokens": 1}'


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def client_request() -> Request:
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]}

    async def receive():
        return {"type": "http.request", "body": BODY, "more_body": False}

    return Request(scope, receive)


async def forwarded(path: Path) -> object:
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(path)), timeout=10) as client:
        try:
            return await forward(client_request(), "completions", client=client, engine_url="http://localhost",
                                 api_key="k", weight_path="bf16", state=lambda: "ready")  # fmt: skip
        except NotSent as exc:
            return exc


def listening(path: Path) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    return listener


@pytest.mark.anyio
async def test_a_request_waiting_to_be_accepted_when_the_engine_dies_was_never_read_and_is_not_sent(tmp_path):
    listener = listening(tmp_path / "engine.sock")
    attempt = asyncio.create_task(forwarded(tmp_path / "engine.sock"))
    await asyncio.sleep(0.3)  # connected (in the backlog) and written; never accepted
    listener.close()
    assert isinstance(await attempt, NotSent)


@pytest.mark.anyio
async def test_a_request_accepted_but_unread_when_the_engine_dies_is_not_sent(tmp_path):
    listener = listening(tmp_path / "engine.sock")
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    attempt = asyncio.create_task(forwarded(tmp_path / "engine.sock"))
    await asyncio.sleep(0.3)
    accepted[0].close()  # dies with the request in its receive buffer
    listener.close()
    assert isinstance(await attempt, NotSent)


@pytest.mark.anyio
async def test_a_request_the_engine_read_before_it_died_is_a_502_not_sent_again(tmp_path):
    listener = listening(tmp_path / "engine.sock")

    def read_then_die() -> None:
        conn, _ = listener.accept()
        seen = b""
        while not seen.endswith(BODY):
            seen += conn.recv(65536)
        conn.close()  # read it all, then died before answering

    threading.Thread(target=read_then_die, daemon=True).start()
    response = await forwarded(tmp_path / "engine.sock")
    listener.close()
    assert response.status_code == 502
    assert b"the engine stopped before it answered" in response.body and b"not sent again" in response.body
