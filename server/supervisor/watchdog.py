"""The watchdog: the engine's direct child, which ends the engine's whole process group when the wrapper dies.

It is shipped to `python -c` as the source of one function (WATCHDOG_SOURCE), so that function imports what it
uses inside itself, from the standard library alone: it stays resident beside the engine (~12 MB,
docs/reports/2026-11-30-service-faults.md).
"""

from __future__ import annotations

import inspect
import os
import sys
import textwrap
from collections.abc import Sequence


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
