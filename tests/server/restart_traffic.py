"""Client traffic through an engine crash, for the slow tests with the REAL vLLM (one- and two-process): a stream
and a plain completion in flight when the engine is killed, and a completion sent every half second from the kill
until the engine has been ready again for a few more. Every request sent after the kill must be served (they wait
for the restart: server/routes/proxy.py); the two in flight must end with the errors a client can tell from an
answer (an error event, a 502 naming the engine), and must not be sent again."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

LONG = 400  # tokens: seconds of generation on one core, so both are still running when the engine is killed
SEND_EVERY_S = 0.5
AFTER_READY = 3  # requests sent after the engine is ready again


@dataclass
class CrashTraffic:
    stream_events: list[str] = field(default_factory=list)
    in_flight: httpx.Response | None = None
    after_kill: list[tuple[float, int, str]] = field(default_factory=list)  # (seconds after the kill, status, text)
    restart_s: float = 0.0


def _completion(model: str, max_tokens: int, **more: object) -> dict:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **more}  # fmt: skip


def through_a_crash(
    url: str, model: str, engine_pid: int, ready: Callable[[], bool], guard_s: float = 300
) -> CrashTraffic:
    """Kill `engine_pid` (SIGKILL) with a stream and a completion in flight; send completions until `ready()` has
    held for AFTER_READY more; return what every client got."""
    out = CrashTraffic()
    streaming = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=_completion(model, LONG, stream=True),
                          timeout=guard_s) as response:  # fmt: skip
            for line in response.iter_lines():
                if line.startswith("data: "):
                    out.stream_events.append(line)
                    streaming.set()

    def plain() -> None:
        out.in_flight = httpx.post(f"{url}/v1/completions", json=_completion(model, LONG), timeout=guard_s)

    holders = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for holder in holders:
        holder.start()
    assert streaming.wait(guard_s), "the stream sent nothing"
    time.sleep(1.0)  # the plain completion is in the engine too
    os.kill(engine_pid, signal.SIGKILL)
    killed = time.monotonic()

    def send(at: float) -> None:
        answer = httpx.post(f"{url}/v1/completions", json=_completion(model, 4), timeout=guard_s)
        out.after_kill.append((at, answer.status_code, answer.text[:300]))

    senders, ready_seen, down_seen = [], 0, False
    while ready_seen < AFTER_READY:
        assert time.monotonic() - killed < guard_s, "the engine was not ready again before the hang guard"
        up = ready()
        down_seen = down_seen or not up
        if up and down_seen:  # ready again: not the killed engine, which /readyz may name ready for a moment
            ready_seen += 1
            out.restart_s = out.restart_s or time.monotonic() - killed
        sender = threading.Thread(target=send, args=(time.monotonic() - killed,))
        sender.start()
        senders.append(sender)
        time.sleep(SEND_EVERY_S)
    for thread in [*holders, *senders]:
        thread.join(guard_s)
    return out


def check(out: CrashTraffic) -> None:
    """What the issue asks of a restart: 0 requests lost after the crash, clear errors for the two in flight."""
    assert out.stream_events and "data: [DONE]" not in out.stream_events
    error = json.loads(out.stream_events[-1][6:])["error"]
    assert error["type"] == "engine_error" and "the engine stopped while answering" in error["message"], error
    assert out.in_flight is not None and out.in_flight.status_code == 502, out.in_flight
    message = out.in_flight.json()["error"]["message"]
    assert "the engine stopped before it answered" in message and "not sent again" in message, message
    lost = [(at, status, text) for at, status, text in out.after_kill if status != 200]
    assert not lost, f"{len(lost)} of {len(out.after_kill)} requests sent after the kill were not served: {lost}"
    assert len(out.after_kill) >= AFTER_READY + 2
