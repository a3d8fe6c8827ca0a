"""The run directory (0700, this user's): a pid file for each running engine, so that the next wrapper of the same
cache directory stops an engine a previous one left (the sweep), and the environment the next early engine starts
with. A recorded process is recognised by pid and process start time, never by name.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel

from edge.paths import cache_dir
from server.settings import Settings
from server.supervisor.processes import (
    end_processes,
    group_members,
    owned_by_us,
    process_cmdline,
    process_start_time,
    still_ours,
)
from server.supervisor.sockets import SOCKET_GLOB, private_dir, remove_socket, socket_dir, wrapper_pid_of

log = logging.getLogger("edge.engine")


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


def engine_record(leader: int, argv: Sequence[str], socket: Path | None) -> EngineRecord | None:
    """The engine under the watchdog `leader`, as its pid file records it for this wrapper: the processes of its
    group now; None when the leader is gone already."""
    starts = {pid: process_start_time(pid) for pid in [leader, *group_members(leader)]}
    if starts[leader] is None:
        return None
    return EngineRecord(
        wrapper_pid=os.getpid(),
        wrapper_start=process_start_time(os.getpid()) or 0,
        leader_pid=leader,
        leader_start=starts[leader],
        members={pid: start for pid, start in starts.items() if start is not None},
        argv=list(argv),
        cmdlines={pid: cmdline for pid in starts if (cmdline := process_cmdline(pid)) is not None},
        socket=os.fspath(socket) if socket is not None else None,
    )


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


# What the next start's early engine (server/supervisor/early.py) is started with: the plan environment of the last
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
            await end_processes(pids, grace_s, record.leader_pid)
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
