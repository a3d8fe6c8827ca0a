"""Shared pieces for the server tests: the stand-in engine, a plan for SmolLM2-135M, fast supervisor settings,
and a real uvicorn server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from edge.device.profile import DeviceProfile, Fact
from edge.model.reader import default_model
from edge.plan.schema import MemoryItem, MemoryLedger, Plan, VllmConfig
from server.settings import Settings

STANDIN = str(Path(__file__).with_name("standin_engine.py"))


SMOLLM2_CONFIG = Path(__file__).parents[1] / "edge" / "data" / "configs" / "smollm2-135m-instruct.json"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model directory holding the default model's config.json alone: enough to plan for, nothing to load."""
    directory = tmp_path / "SmolLM2-135M-Instruct"
    directory.mkdir()
    shutil.copy(SMOLLM2_CONFIG, directory / "config.json")
    return directory


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def standin(*flags: str) -> list[str]:
    """The executable part of the engine command, for the stand-in instead of `vllm serve`."""
    return [sys.executable, STANDIN, *flags]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_request(supervisor, method: str, path: str, **kwargs) -> httpx.Response:
    """A request straight to the supervisor's engine, over its Unix socket as the wrapper sends them."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(supervisor.socket_path)), timeout=30) as client:
        return client.request(method, f"{supervisor.engine_url}{path}", **kwargs)


def fast_settings(**overrides) -> Settings:
    """Supervisor timings scaled down for a stand-in that starts in well under a second."""
    values = dict(
        health_poll_s=0.05,
        ready_timeout_s=30.0,
        backoff_initial_s=0.05,
        backoff_max_s=0.4,
        backoff_jitter=0.0,
        stop_grace_s=3.0,
    )
    values.update(overrides)
    return Settings(**values)


def this_box() -> DeviceProfile:
    """A described device like this project's machines: 2 AVX2 cores of an AMD EPYC, 24 GiB."""
    given = "description"
    return DeviceProfile(
        described_by="json",
        name="avx2-box",
        arch=Fact(value="x86_64", source=given),
        isa=Fact(value=["avx2", "fma", "f16c"], source=given),
        logical_cpus=Fact(value=2, source=given),
        memory_total_bytes=Fact(value=24 << 30, source=given),
    )


def smollm2_plan(*, fits: bool = True) -> Plan:
    """A bf16 plan for the real SmolLM2-135M shapes, written out by hand so supervisor tests do not depend on
    the planner's choices. Only what the supervisor reads matters: vllm.args/env and memory.fits."""
    model = default_model()
    weights = 2 * model.total_params
    item = MemoryItem(
        kind="bf16-weights", name="weights (bf16)", bytes=weights, phase="resident", detail="2 bytes x total_params"
    )
    budget = weights // 2 if not fits else None
    return Plan(
        path="bf16",
        verified=False,
        verified_detail="test plan",
        device=this_box(),
        model=model,
        priority="speed",
        max_model_len=512,
        max_num_seqs=4,
        memory=MemoryLedger(resident_bytes=weights, peak_bytes=weights, budget_bytes=budget, fits=fits, items=[item]),
        quantization_config=None,
        vllm=VllmConfig(
            args=["--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "4"],
            env={"VLLM_CPU_KVCACHE_SPACE": "1", "EDGE_TEST_MARKER": "from-plan"},
        ),
        reasons=[],
        alternatives=[],
    )


async def eventually(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait for a condition. The timeout only guards against a hang; it is not a speed requirement."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached before the hang guard"
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def uvicorn_on_loopback(app) -> Iterator[str]:
    """A real uvicorn server in a thread (its own event loop, the app's lifespan included); yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
