"""The first engine of an edge-serve, started before its plan is made: it imports vLLM while edge-serve plans.

A warm start of the default model spent ~8 s of ~14 s in the engine importing vLLM's OpenAI server, after
edge-serve's own ~1.8 s of imports, probe, plan and up-to-date check (2026-12-03, 2 cores of an AMD EPYC Zen 5).
The two can overlap, but the engine's environment must be final before it imports: OpenMP reads
OMP_NUM_THREADS when torch loads it, and vLLM reads some of its variables at import. So the early engine starts
with the plan environment of this run directory's last vLLM engine that became ready
(run_dir.remember_engine_env), and the supervisor takes it (adopt) only when the new plan's environment is
the same and its command is vLLM's server under this interpreter. Otherwise it is killed and the engine starts
afresh, as without one: a changed plan costs the CPU of an import cut short, nothing else.

It runs `kernels.vllm_plugin.early_start` under the same watchdog as any engine, in a session of its own, and gets
its arguments and per-start key on its standard input once they are known. Until it is adopted it belongs to
edge-serve's main(), which kills it on every other way out (discard); the watchdog kills it if edge-serve dies.
A conversion about to run kills it too: the converter's memory peak should not share the box with an idle import.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from server.supervisor.command import engine_environment, vllm_launcher
from server.supervisor.processes import group_members
from server.supervisor.run_dir import recalled_engine_env
from server.supervisor.watchdog import watchdog_argv

EARLY_MODULE = "kernels.vllm_plugin.early_start"
DISCARD_WAIT_S = 5.0  # for SIGKILLed processes to be gone: a process in uninterruptible sleep dies when it wakes
log = logging.getLogger("edge.engine")


class AdoptedProcess:
    """An early engine's watchdog as the supervisor watches a started one (processes.EngineProcess)."""

    def __init__(self, popen: subprocess.Popen, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdout, self.stderr = stdout, stderr

    @property
    def returncode(self) -> int | None:
        """As asyncio reports it: None while it runs, -N when signal N ended it."""
        return self._popen.poll()


async def _reader(pipe: IO[bytes]) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20, loop=loop)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe)
    return reader


def early_argv(launcher: Sequence[str]) -> list[str]:
    """What imports `launcher`'s server ahead: vLLM's server module (vllm_launcher()), or a script run by this
    interpreter (the tests' stand-in engine)."""
    if list(launcher) == vllm_launcher():
        return [sys.executable, "-m", EARLY_MODULE]
    interpreter, script = launcher  # anything else is refused by unpacking: an assert with a better message
    assert interpreter == sys.executable, f"expected a script run by {sys.executable}, got {launcher}"
    return [sys.executable, "-m", EARLY_MODULE, "--script", script]


class EarlyEngine:
    def __init__(self, popen: subprocess.Popen, env: Mapping[str, str], launcher: Sequence[str]) -> None:
        self._popen = popen
        self.env = dict(env)
        self.launcher = list(launcher)
        self.started_at = time.monotonic()
        self._taken = False

    @property
    def pid(self) -> int:
        """Its watchdog's: the process group's."""
        return self._popen.pid

    @classmethod
    def start(cls, run_dir: Path, *, grace_s: float, launcher: Sequence[str] | None = None) -> EarlyEngine | None:
        """An engine importing vLLM (or `launcher`'s server) in the environment of the last one that became
        ready here; None when none did (or it cannot be started: the supervisor will say why when it starts the
        engine itself)."""
        plan_env = recalled_engine_env(run_dir)
        if plan_env is None:
            return None
        launcher = vllm_launcher() if launcher is None else list(launcher)
        env = engine_environment(os.environ, plan_env)
        argv = watchdog_argv(early_argv(launcher), grace_s=grace_s)
        try:
            popen = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                start_new_session=True,  # its own process group, as every engine's
            )  # fmt: skip
        except OSError as exc:
            log.warning("no early engine: %s", exc)
            return None
        return cls(popen, env, launcher)

    async def adopt(
        self, command: Sequence[str], env: Mapping[str, str], argv: Sequence[str], api_key: str
    ) -> AdoptedProcess | None:
        """This engine, running `argv` (the engine's command and its socket) with `api_key`, when it was started
        as `command` with `env` would be; else None, and it is killed."""
        launcher = self.launcher
        same = list(command[: len(launcher)]) == launcher and dict(env) == self.env
        if not same or self._popen.poll() is not None:
            why = "its plan's environment changed" if not same else "it exited"
            log.info("early engine not used (%s): starting the engine afresh", why)
            self.discard()
            return None
        go = {"argv": list(argv[len(launcher) :]), "env": {"VLLM_API_KEY": api_key}}
        assert self._popen.stdin is not None and self._popen.stdout is not None and self._popen.stderr is not None
        try:
            self._popen.stdin.write(json.dumps(go).encode() + b"\n")
            self._popen.stdin.close()
        except OSError as exc:  # it died between the poll and the write
            log.info("early engine not used (%s): starting the engine afresh", exc)
            self.discard()
            return None
        self._taken = True
        log.info("engine started %.1f s ago: it imported vLLM while edge-serve planned",
                 time.monotonic() - self.started_at)  # fmt: skip
        return AdoptedProcess(self._popen, await _reader(self._popen.stdout), await _reader(self._popen.stderr))

    def discard(self) -> None:
        """Kill it, unless the supervisor took it: it has imported, or is importing, nothing but vLLM."""
        if self._taken:
            return
        self._taken = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._popen.pid, signal.SIGKILL)
        self._popen.wait()
        deadline = time.monotonic() + DISCARD_WAIT_S  # its memory is free once this returns (a conversion is next)
        while group_members(self._popen.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        for pipe in (self._popen.stdin, self._popen.stdout, self._popen.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
