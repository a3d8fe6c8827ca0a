"""The engine's liveness probes, over its socket: its health check, and a one-token generation (a wedged engine core
still answers /health). Each returns None when the engine answered, else a ProbeFailure: the probe, what went wrong,
and whether it was a timeout (an engine that computes may be slow to answer; one that fails at once is not). An
answer in the 4xx range is an answer (the engine is alive; the probe is at fault)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import NamedTuple

import httpx

from server.supervisor.sockets import ENGINE_URL

log = logging.getLogger("edge.engine")


class ProbeFailure(NamedTuple):
    probe: str  # "health", "generation"
    error: str
    timed_out: bool = False


async def health_probe(client: httpx.AsyncClient, health_path: str, timeout: float) -> ProbeFailure | None:
    try:
        health = await client.get(ENGINE_URL + health_path, timeout=timeout)
    except httpx.TimeoutException:
        return ProbeFailure("health", f"GET {health_path} did not answer within {timeout:g} s", timed_out=True)
    except httpx.HTTPError as exc:
        return ProbeFailure("health", f"GET {health_path} failed: {type(exc).__name__}: {exc}")
    if health.status_code >= 500:
        return ProbeFailure("health", f"GET {health_path} answered {health.status_code}")
    return None


async def generation_probe(
    client: httpx.AsyncClient, served_model_name: str | None, headers: Mapping[str, str], timeout: float
) -> ProbeFailure | None:
    body = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}
    if served_model_name:
        body["model"] = served_model_name
    try:
        answer = await client.post(ENGINE_URL + "/v1/completions", json=body, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        return ProbeFailure("generation", f"a one-token generation did not finish within {timeout:g} s", timed_out=True)
    except httpx.HTTPError as exc:
        return ProbeFailure("generation", f"a one-token generation failed: {type(exc).__name__}: {exc}")
    if answer.status_code >= 500:
        return ProbeFailure("generation", f"a one-token generation answered {answer.status_code}")
    if answer.status_code >= 400:
        log.warning("the generation probe was refused (%d): %s", answer.status_code, answer.text[:200])
    return None
