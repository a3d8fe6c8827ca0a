"""The engine's processes, read from /proc and ended: a process group, signalled at once, whose processes are named
by pid and start time (a pid is reused), never by name."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("edge.engine")


class EngineProcess(Protocol):
    """What the supervisor uses of a started engine's watchdog: asyncio's Process, or an early engine it adopted
    (server/supervisor/early.AdoptedProcess)."""

    pid: int
    stdout: asyncio.StreamReader | None
    stderr: asyncio.StreamReader | None

    @property
    def returncode(self) -> int | None: ...


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'killed by signal SIGKILL' (asyncio reports death by signal N as -N)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}"
    return f"exit code {returncode}"


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


@dataclass(frozen=True)
class GroupSnapshot:
    """A process group at one moment: the CPU time its live members have used, and which of them are stopped."""

    cpu_s: float  # user + system time of the live members, seconds (all their threads)
    stopped: tuple[int, ...]  # members stopped by a signal (state T: SIGSTOP, SIGTSTP); not a tracer's stop (t)


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def group_snapshot(pgid: int) -> GroupSnapshot:
    """The group's CPU time and stopped members, from /proc/PID/stat (utime and stime, fields 14 and 15). A
    process that computes adds CPU time; one that waits on a lock, or is stopped, adds none."""
    ticks, stopped = 0, []
    for pid in group_members(pgid):
        fields = _stat_fields(pid)
        if fields is None or len(fields) < 13:
            continue
        ticks += int(fields[11]) + int(fields[12])
        if fields[0] == "T":
            stopped.append(pid)
    return GroupSnapshot(ticks / CLOCK_TICKS, tuple(stopped))


def any_stopped(pids: Sequence[int]) -> bool:
    """Whether one of these processes is stopped by a signal (state T): a few /proc reads, cheap per request."""
    return any((fields := _stat_fields(pid)) is not None and fields[0] == "T" for pid in pids)


def engine_child(leader: int) -> int | None:
    """The engine process under its watchdog: the leader's child in the leader's group."""
    for pid in group_members(leader):
        fields = _stat_fields(pid)
        if fields is not None and int(fields[1]) == leader:
            return pid
    return None


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


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


async def leader_exit(proc: EngineProcess, poll_s: float = 0.05) -> int:
    """The engine leader's exit status, once it has exited.

    Not proc.wait(): asyncio's wait() also waits for the child's pipes to close, and a worker orphaned by a
    killed leader holds them open (seen with the stand-in's worker: wait() hung until the worker died).
    """
    while proc.returncode is None:
        await asyncio.sleep(poll_s)
    return proc.returncode


async def terminate(proc: EngineProcess, grace_s: float) -> None:
    """SIGTERM to the watchdog, which passes it on to the group, and SIGCONT to the group (a stopped process
    acts on SIGTERM only once continued); SIGKILL whatever of it is left after the grace period."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(pgid, signal.SIGTERM)
    signal_group(pgid, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(leader_exit(proc), grace_s)
    while _group_alive(pgid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if _group_alive(pgid):
        log.warning("engine group %d still alive after %g s: SIGKILL", pgid, grace_s)
        signal_group(pgid, signal.SIGKILL)
    await leader_exit(proc)


async def end_processes(pids: Sequence[int], grace_s: float, leader: int) -> None:
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
