"""EngineSupervisor: starts the engine under its watchdog, watches its health and liveness, restarts it with
exponential backoff when it stops serving, and stops it (server/supervisor/__init__.py: how the parts fit)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import signal
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import httpx

from edge.paths import resolve
from edge.plan.schema import Plan
from server.settings import Settings
from server.supervisor.command import (
    EngineRefused,
    check_plan_runnable,
    engine_command,
    engine_environment,
    short_model_name,
    vllm_launcher,
)
from server.supervisor.probes import ProbeFailure, generation_probe, health_probe
from server.supervisor.processes import (
    EngineProcess,
    any_stopped,
    describe_exit,
    engine_child,
    group_members,
    group_snapshot,
    leader_exit,
    process_start_time,
    signal_group,
    terminate,
)
from server.supervisor.run_dir import (
    engine_record,
    record_path,
    remember_engine_env,
    run_dir_of,
    sweep_left_engines,
    write_record,
)
from server.supervisor.sockets import (
    ENGINE_URL,
    engine_client,
    fresh_socket_path,
    not_our_engine,
    remove_socket,
    socket_dir,
    socket_path_problem,
)
from server.supervisor.status import EngineState, EngineStatus, StopKind
from server.supervisor.watchdog import watchdog_argv

log = logging.getLogger("edge.engine")

# A stopped engine process is unresponsive once seen stopped at this many probes in a row (a job-control stop that
# is continued at once is not a fault)
STOPPED_PROBES = 2
# An unresponsive engine is stopped with this grace, not stop_grace_s: a wedged engine does not shut down cleanly,
# and requests are waiting for its restart
UNRESPONSIVE_GRACE_S = 3.0
# How long an engine whose forwarded requests failed is given to show it has exited (its watchdog polls its child
# every 0.1 s) before it is found unresponsive instead
EXIT_GRACE_S = 1.0
# How long the watchdog of an engine whose process is gone is given to end what that engine left and exit: its
# probes and requests failed because it died, which is an exit, not a wedge (a busy 2-core box takes seconds to
# free a dead engine core's memory)
GONE_GRACE_S = 10.0


class EarlyStart(Protocol):
    """An engine started before its plan was made (server/supervisor/early.EarlyEngine), for the first start to take."""

    started_at: float  # time.monotonic()

    async def adopt(
        self, command: Sequence[str], env: Mapping[str, str], argv: Sequence[str], api_key: str
    ) -> EngineProcess | None: ...

    def discard(self) -> None: ...


def backoff_delay(failures: int, *, initial: float, cap: float, jitter: float = 0.0, rng=random) -> float:
    """Delay before restart `failures` (1-based): initial * 2^(failures-1), capped, +- jitter fraction."""
    assert failures >= 1, f"failures counts from 1, got {failures}"
    delay = min(cap, initial * 2 ** (failures - 1))
    if jitter:
        delay *= 1.0 + rng.uniform(-jitter, jitter)
    return min(cap, max(0.0, delay))


class EngineSupervisor:
    """Start, watch, restart and stop one engine command. Driven by the app's lifespan (asyncio)."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        settings: Settings | None = None,
        health_path: str = "/health",
        log_prefix: str = "[vllm]",
        served_model_name: str | None = None,
        early: EarlyStart | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.command = list(command)  # argv without --uds, which each start chooses
        self.api_key = ""  # a fresh random one for each start, in the engine's environment (VLLM_API_KEY)
        self.plan_env = dict(env or {})
        self.env = engine_environment(os.environ, self.plan_env)
        self._early = early  # the first start's engine, importing vLLM since before the plan was made
        self.health_path = health_path
        self.log_prefix = log_prefix
        self.served_model_name = served_model_name
        self.run_dir = run_dir_of(self.settings)
        if problem := socket_path_problem(self.run_dir):
            raise EngineRefused(problem)
        self.socket_path: Path | None = None  # a fresh one in socket_dir(run_dir) for each start
        self._state: EngineState = "stopped"
        self._changed = asyncio.Event()  # set, and replaced, on every change of state
        self.generation = 0  # how many times an engine became ready: a request tells one engine from the next
        self.restarts = 0
        self.restart_reasons: Counter[str] = Counter()
        self.last_error: str | None = None
        self.probe_failures = 0  # in a row, now
        self.probes_failed: Counter[str] = Counter()  # ever, by probe ("health", "generation", "traffic", "stopped")
        self.probes_answered = 0  # ever
        self.probes_busy = 0  # ever: probes that timed out on an engine that computed meanwhile (not failures)
        self.last_probe_error: str | None = None
        self.swept: list[str] = []  # engines of dead wrappers stopped at start
        self.delays: list[float] = []  # every backoff delay taken, in order
        self.log_tail: deque[str] = deque(maxlen=self.settings.log_tail_lines)
        self._proc: EngineProcess | None = None
        self._engine_pid: int | None = None
        self._record: Path | None = None
        self._started_at: float | None = None
        self._ready_at: float | None = None
        self._last_ready_wall: float | None = None
        self._last_traffic_at = 0.0
        self._last_generation_at = 0.0
        self._suspect = False  # a forwarded request failed since the last generation probe: one is due now
        self._liveness_wake = asyncio.Event()
        self._busy_since: float | None = None  # when probes began to time out on an engine that computes
        self._members: list[int] = []  # the engine's processes when it became ready
        self._awaiting = 0  # forwarded requests waiting for the engine's next bytes now
        self._quiet_since = time.monotonic()  # the later of: the last bytes from the engine, since when some wait
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
        settings: Settings | None = None,
        force: bool = False,
        executable: Sequence[str] | None = None,
        early: EarlyStart | None = None,
    ) -> EngineSupervisor:
        check_plan_runnable(plan, force=force)
        settings = settings or Settings()
        served = settings.served_model_name or short_model_name(plan, model_dir)
        command = engine_command(plan, model_dir, executable=executable, served_model_name=served)
        env = {name: resolve(value) if name == "VLLM_CACHE_ROOT" else value for name, value in plan.vllm.env.items()}
        return cls(command, env=env, settings=settings, served_model_name=served, early=early)

    # -- public ------------------------------------------------------------------------------------------

    @property
    def argv(self) -> list[str]:
        """The engine's command line for the socket of this start (vLLM's `serve` flags; never the key)."""
        assert self.socket_path is not None, "each start chooses the engine's socket: none was started yet"
        return [*self.command, "--uds", os.fspath(self.socket_path)]

    @property
    def engine_url(self) -> str:
        """What requests to the engine name; they go over `socket_path` (server/supervisor/sockets.EngineTransport)."""
        return ENGINE_URL

    @property
    def engine_headers(self) -> dict[str, str]:
        """What a request to the engine's /v1 carries: its key."""
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    @property
    def engine_pid(self) -> int | None:
        """The engine under the watchdog (found once it has started)."""
        leader = self.pid
        if leader is None:
            return None
        if self._engine_pid is None or process_start_time(self._engine_pid) is None:
            self._engine_pid = engine_child(leader)
        return self._engine_pid

    @property
    def is_ready(self) -> bool:
        return self.state == "ready"

    @property
    def state(self) -> EngineState:
        return self._state

    @state.setter
    def state(self, value: EngineState) -> None:
        if value != self._state:
            self._state = value
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    @property
    def serving(self) -> bool:
        """Whether an engine is ready or on its way to be: not stopped, not stopping."""
        return not self._stopping and self.state != "stopped"

    async def state_change(self, timeout: float) -> None:
        """Return at the next change of state, or after timeout seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), max(0.0, timeout))

    def engine_stopped(self) -> bool:
        """Whether a process of the ready engine is stopped (SIGSTOP) now: a request sent to it would only wait
        to fail when it is found unresponsive. Read per request from the processes the engine had when it became
        ready; a stopped one wakes the liveness probe."""
        if not self.is_ready or not any_stopped(self._members):
            return False
        self._liveness_wake.set()
        return True

    def waiting(self, delta: int) -> None:
        """server.proxy.EngineWatch: a forwarded request begins (+1) or stops (-1) waiting for the engine's bytes."""
        if delta > 0 and self._awaiting == 0:
            self._quiet_since = time.monotonic()
        self._awaiting += delta

    def progressed(self) -> None:
        """server.proxy.EngineWatch: bytes of an answer arrived from the engine."""
        self._quiet_since = time.monotonic()

    def _stalled(self, cpu_used: float, over_s: float) -> ProbeFailure | None:
        """Requests wait for the engine, none has had a byte for `liveness_stall_s`, and the engine used no CPU
        (less than `liveness_busy_cpu` of a core) over the last `over_s`: a wedged engine core, even one whose
        API still answers /health (two-process mode). A long prefill computes; a queued request waits behind
        others that compute and answer."""
        quiet = time.monotonic() - self._quiet_since
        if not self._awaiting or quiet < self.settings.liveness_stall_s:
            return None
        if over_s <= 0 or cpu_used >= self.settings.liveness_busy_cpu * over_s:
            return None
        return ProbeFailure("stall", f"{self._awaiting} forwarded requests waited {quiet:.1f} s for the engine's "
                            f"answer, and it used {cpu_used:.2f} CPU s in {over_s:.1f} s")  # fmt: skip

    def note_traffic(self) -> None:
        """A forwarded request got the first byte of an answer that is not a server error: the engine generates,
        and is not idle (no generation probe needed). A request merely sent proves nothing: a wedged engine core
        takes requests and never answers them."""
        self._last_traffic_at = time.monotonic()
        self.probe_failures = 0

    def note_forward_failure(self, error: str) -> None:
        """A forwarded request timed out, broke off or got a 5xx: counted as a failed liveness probe ("traffic"),
        and a generation probe is due at once, whatever the traffic."""
        if not self.is_ready:
            return
        self.probe_failures += 1
        self.probes_failed["traffic"] += 1
        self.last_probe_error = error
        self._suspect = True
        self._liveness_wake.set()
        log.warning("forwarded request failed (%d of %d): %s", self.probe_failures, self.settings.liveness_failures,
                    error)  # fmt: skip

    def status(self) -> EngineStatus:
        now = time.monotonic()
        running = self.pid is not None and self._started_at is not None
        wait = self._next_restart_at - now if self._next_restart_at is not None else None
        return EngineStatus(
            state=self.state,
            pid=self.pid,
            engine_pid=self.engine_pid,
            served_model_name=self.served_model_name,
            uptime_s=round(now - self._started_at, 3) if running else None,
            ready_since_s=round(now - self._ready_at, 3) if self.is_ready and self._ready_at else None,
            last_ready_at=self._last_ready_wall,
            restarts=self.restarts,
            restart_reasons=dict(self.restart_reasons),
            last_error=self.last_error,
            probe_failures=self.probe_failures,
            last_probe_error=self.last_probe_error,
            next_restart_in_s=round(max(0.0, wait), 3) if wait is not None else None,
            engine_url=self.engine_url,
            engine_socket=os.fspath(self.socket_path) if self.socket_path is not None else None,
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
        """SIGTERM to the engine's process group (through its watchdog), SIGKILL after the grace period; state
        becomes stopped."""
        self._stopping = True
        self._wake.set()
        if self._early is not None:  # stopped before its first start
            self._early.discard()
        if self._proc is not None:
            await terminate(self._proc, self.settings.stop_grace_s)
        if self._task is not None:
            await self._task
            self._task = None
        self.state = "stopped"
        self._ready.clear()

    # -- the loop ----------------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            self.swept = await sweep_left_engines(self.run_dir, self.settings.stop_grace_s)
        except OSError as exc:  # an unreadable run directory costs the sweep, not the engine
            log.warning("engines or sockets left by earlier wrappers not all looked for in %s: %s", self.run_dir, exc)
        failures = 0
        while not self._stopping:
            proc = await self._spawn()
            if proc is None:  # the command itself could not be started
                kind, why = "could-not-start", self.last_error
            else:
                kind, why = await self._watch(proc)
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
            self.restart_reasons[kind] += 1
            self.state = "restarting"
        self.state = "stopped"

    async def _spawn(self) -> EngineProcess | None:
        """Start the engine on a socket and with a key of its own: a fresh socket path in the private socket
        directory (socket_dir: the run directory, where it fits) and a fresh key each time, the key in its
        environment (an argv is readable by every user, /proc/PID/environ only by this one)."""
        try:
            self.socket_path = fresh_socket_path(socket_dir(self.run_dir))
        except OSError as exc:  # another user's directory, a link, a read-only cache: nowhere safe to listen
            self.last_error = f"no private directory for the engine's socket: {exc}"
            return None
        self.api_key = secrets.token_urlsafe(32)
        log.info("starting engine: %s", " ".join(self.argv))
        self.log_tail.clear()
        self._engine_pid = None
        early, self._early = self._early, None
        if early is not None and (proc := await early.adopt(self.command, self.env, self.argv, self.api_key)):
            self._proc = proc
            self._started_at = early.started_at
            self._write_record(proc.pid)
            return proc
        try:
            proc = await asyncio.create_subprocess_exec(
                *watchdog_argv(self.argv, grace_s=self.settings.stop_grace_s),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                stdin=asyncio.subprocess.DEVNULL,
                env={**self.env, "VLLM_API_KEY": self.api_key},
                start_new_session=True,  # its own process group: vLLM's workers are signalled with it
                limit=1 << 20,
            )
        except OSError as exc:
            self.last_error = f"could not start {self.argv[0]!r}: {exc}"
            return None
        self._proc = proc
        self._started_at = time.monotonic()
        self._write_record(proc.pid)
        return proc

    def _write_record(self, leader: int) -> None:
        """The pid file: the next wrapper of this cache directory stops this engine if this wrapper dies first."""
        record = engine_record(leader, self.argv, self.socket_path)
        if record is None:  # gone already: nothing to record
            return
        self._record = record_path(self.run_dir, leader)
        try:
            write_record(self._record, record)
        except OSError as exc:  # a read-only cache costs the sweep, not the engine
            log.warning("engine pid file %s not written: %s", self._record, exc)

    async def _watch(self, proc: EngineProcess) -> tuple[StopKind, str]:
        """Pump the logs, wait for health, then watch liveness until death. Returns why the engine stopped serving
        (a kind and the words)."""
        assert proc.stdout is not None and proc.stderr is not None
        pumps = [asyncio.create_task(self._pump(stream)) for stream in (proc.stdout, proc.stderr)]
        exited = asyncio.create_task(leader_exit(proc))
        kind: StopKind
        try:
            healthy = await self._wait_healthy(proc, exited)
            if self._stopping:  # stop() may have run while this process was being spawned
                await terminate(proc, self.settings.stop_grace_s)
                kind, why = "exited", "stopped on request"
            elif isinstance(healthy, str):
                kind, why = "socket-taken", healthy
                await terminate(proc, self.settings.stop_grace_s)
            elif healthy:
                self._became_ready(proc)
                unresponsive = await self._stay_live(exited)
                if unresponsive is None:
                    kind, why = "exited", describe_exit(await exited)
                else:
                    self.state = "unresponsive"
                    self._ready.clear()
                    self.last_error = unresponsive
                    log.warning("engine unresponsive (%s): stopping it", unresponsive)
                    await terminate(proc, min(UNRESPONSIVE_GRACE_S, self.settings.stop_grace_s))
                    kind, why = "unresponsive", unresponsive
            elif exited.done():
                kind, why = "exited-before-ready", f"{describe_exit(proc.returncode)} before it became ready"
            else:
                kind, why = "not-ready-in-time", f"not ready within {self.settings.ready_timeout_s:g} s"
                await terminate(proc, self.settings.stop_grace_s)
        finally:
            # The leader is gone, its workers may not be: nothing of a dead engine may keep memory or a socket.
            signal_group(proc.pid, signal.SIGKILL)
            if self.socket_path is not None:
                remove_socket(self.socket_path)  # vLLM leaves it; the next start listens on a fresh one
            if self._record is not None:
                self._record.unlink(missing_ok=True)
                self._record = None
            await asyncio.wait(pumps, timeout=5.0)
            for pump in pumps:
                pump.cancel()
        tail = " | ".join(list(self.log_tail)[-5:])
        return kind, f"{why}; last log lines: {tail}" if tail else why

    def _became_ready(self, proc: EngineProcess) -> None:
        self.generation += 1
        self.state = "ready"
        self._ready_at = self._last_traffic_at = time.monotonic()
        self._suspect = False
        self._last_ready_wall = time.time()
        self.probe_failures = 0
        self._ready.set()
        self._members = group_members(proc.pid)
        self._write_record(proc.pid)  # now with vLLM's engine core and workers
        if self.command[: len(launcher := vllm_launcher())] == launcher:  # vLLM's, not a stand-in
            remember_engine_env(self.run_dir, self.plan_env)
        log.info("engine ready on %s (pid %d, engine pid %s)", self.socket_path, proc.pid, self.engine_pid)

    async def _wait_healthy(self, proc: EngineProcess, exited: asyncio.Task) -> bool | str:
        """True once the engine answers its health check and proves to be ours; False when it exited or was not
        ready in time; why, when what answers on its socket is not this engine."""
        assert self.socket_path is not None
        deadline = time.monotonic() + self.settings.ready_timeout_s
        url = self.engine_url + self.health_path
        async with engine_client(self.socket_path, timeout=min(5.0, self.settings.ready_timeout_s)) as client:
            while not self._stopping and time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):  # no socket yet, or vLLM bound it and is still loading
                    if (await client.get(url)).status_code == 200:
                        if proc.returncode is not None:
                            return False
                        return await not_our_engine(client, self.socket_path, proc.pid, self.engine_headers) or True
                await asyncio.wait({exited}, timeout=self.settings.health_poll_s)
                if exited.done():
                    return False
        return False

    # -- liveness ----------------------------------------------------------------------------------------

    async def _stay_live(self, exited: asyncio.Task) -> str | None:
        """Probe the ready engine until it exits (None) or is unresponsive (why): a process of it stopped at
        STOPPED_PROBES probes in a row, or `liveness_failures` failed probes in a row. A probe that timed out while
        the engine used CPU is not a failure until the engine has been busy without answering for
        `liveness_busy_s` (engine_busy)."""
        settings = self.settings
        assert self.socket_path is not None and self._proc is not None
        leader, stopped_seen, self._busy_since = self._proc.pid, 0, None
        engine = self.engine_pid
        last = (group_snapshot(leader).cpu_s, time.monotonic())  # the CPU time and when, at the last probe
        async with engine_client(self.socket_path) as client:
            while True:
                woken = asyncio.create_task(self._liveness_wake.wait())  # by a failed forwarded request
                await asyncio.wait({exited, woken}, timeout=settings.liveness_interval_s,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                woken.cancel()
                self._liveness_wake.clear()
                if exited.done() or self._stopping:
                    await exited
                    return None
                if self.probe_failures >= settings.liveness_failures:
                    # Forwarded requests fail together when the engine dies: one that died is reported as exited
                    await asyncio.wait({exited}, timeout=EXIT_GRACE_S)
                    return await self._unless_gone(exited, engine, self.last_probe_error)
                before = group_snapshot(leader)
                cpu_used, over_s = before.cpu_s - last[0], time.monotonic() - last[1]
                last = (before.cpu_s, time.monotonic())
                if before.stopped:
                    stopped_seen += 1
                    self.probes_failed["stopped"] += 1
                    self.last_probe_error = f"engine process {', '.join(map(str, before.stopped))} is stopped (state T)"
                    log.warning("%s (%d of %d probes)", self.last_probe_error, stopped_seen, STOPPED_PROBES)
                    if stopped_seen >= STOPPED_PROBES:
                        return f"unresponsive: {self.last_probe_error} at {stopped_seen} probes in a row"
                    continue
                stopped_seen = 0
                started = time.monotonic()
                failed = await self._probe(client) or self._stalled(cpu_used, over_s)
                if failed is None:
                    self.probe_failures, self._busy_since = 0, None
                    self.probes_answered += 1
                    continue
                if failed.timed_out and self._engine_busy(leader, before.cpu_s, started, failed):
                    continue
                self.probe_failures += 1
                self.probes_failed[failed.probe] += 1
                self.last_probe_error = failed.error
                log.warning("engine liveness probe failed (%d of %d): %s", self.probe_failures,
                            settings.liveness_failures, failed.error)  # fmt: skip
                if self.probe_failures >= settings.liveness_failures:
                    return await self._unless_gone(exited, engine, failed.error)

    async def _unless_gone(self, exited: asyncio.Task, engine: int | None, last_error: str | None) -> str | None:
        """Why the engine is unresponsive after `liveness_failures` failed probes, or None when it has exited: its
        watchdog is gone, or the engine process under it is (killed: the probes failed because it died), and then
        the watchdog is given GONE_GRACE_S to end the rest and exit."""
        if not exited.done() and engine is not None and process_start_time(engine) is None:
            self.state = "crashed"  # not ready while its watchdog ends the rest: nothing is served meanwhile
            self._ready.clear()
            await asyncio.wait({exited}, timeout=GONE_GRACE_S)
        if exited.done():
            return None
        return f"unresponsive: {self.probe_failures} liveness probes failed in a row, the last: {last_error}"

    def _engine_busy(self, leader: int, cpu_before: float, started: float, failed: ProbeFailure) -> bool:
        """Whether a probe that timed out met an engine that computes (its processes used at least
        `liveness_busy_cpu` of a core meanwhile) and has not been busy without answering for `liveness_busy_s`:
        then it is not a failed probe. A wedged engine (a deadlock, a stopped thread) uses no CPU."""
        settings = self.settings
        now = time.monotonic()
        used = group_snapshot(leader).cpu_s - cpu_before
        if not settings.liveness_busy_cpu or used < settings.liveness_busy_cpu * (now - started):
            return False
        self._busy_since = self._busy_since or started
        busy = now - self._busy_since
        if busy >= settings.liveness_busy_s:
            log.warning("engine busy without answering for %.0f s (liveness_busy_s): %s", busy, failed.error)
            return False
        log.info("%s, but the engine computes (%.2f CPU s in %.2f s): busy, not wedged", failed.error, used,
                 now - started)  # fmt: skip
        self.probes_busy += 1
        return True

    async def _probe(self, client: httpx.AsyncClient) -> ProbeFailure | None:
        """One liveness probe: /health, then a one-token generation when the engine has been idle and none ran
        recently, or a forwarded request failed since the last. None when it answered; else the probe and what
        went wrong (server/supervisor/probes.py)."""
        settings = self.settings
        failed = await health_probe(client, self.health_path, settings.liveness_timeout_s)
        if failed is not None:
            return failed
        now = time.monotonic()
        interval = settings.liveness_generation_interval_s
        if not interval:
            return None
        idle = now - self._last_traffic_at >= settings.liveness_idle_s
        if not self._suspect and (not idle or now - self._last_generation_at < interval):
            return None
        timeout = settings.liveness_generation_timeout_s
        failed = await generation_probe(client, self.served_model_name, self.engine_headers, timeout)
        if failed is None:
            self._last_generation_at = time.monotonic()
            self._suspect = False
        return failed

    # -- logs and stopping -------------------------------------------------------------------------------

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
