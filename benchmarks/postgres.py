"""A PostgreSQL server of one's own, in a temporary directory on a free loopback port, for the fleet store's tests
and benchmarks (Debian's packages: `apt-get install postgresql`, which scripts/setup runs on Debian as root).
As root, it runs as the `postgres` user, in a directory owned by it (the server refuses to run as root)."""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

SETUP_HINT = "scripts/setup installs them on Debian/Ubuntu when run as root (apt-get install postgresql)"


class PostgresMissing(RuntimeError):
    """No PostgreSQL server can be started here; the message says what is missing."""


def bindir() -> Path | None:
    """Debian's /usr/lib/postgresql/<major>/bin (the newest), else wherever PATH has pg_ctl."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    pg_ctl = shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl and (Path(pg_ctl).parent / "initdb").exists() else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stdout}{done.stderr}")


@contextlib.contextmanager
def temporary_postgres(max_connections: int = 100) -> Iterator[str]:
    """A fresh server, stopped and removed on the way out; yields its URL (postgresql://postgres:...@127.0.0.1)."""
    where = bindir()
    if where is None:
        raise PostgresMissing(f"PostgreSQL server binaries (initdb, pg_ctl) not found under "
                              f"/usr/lib/postgresql/*/bin or on PATH; {SETUP_HINT}")  # fmt: skip
    as_root = os.geteuid() == 0
    if as_root and shutil.which("runuser") is None:
        raise PostgresMissing("running as root, and runuser (util-linux) is missing: PostgreSQL cannot run as root")
    as_postgres = ["runuser", "-u", "postgres", "--"] if as_root else []
    workdir = Path(tempfile.mkdtemp(prefix="edge-select-postgres-"))
    password = secrets.token_hex(16)
    (workdir / "password").write_text(password)
    if as_root:
        for path in (workdir, workdir / "password"):
            shutil.chown(path, "postgres", "postgres")
    data, port = workdir / "data", _free_port()
    try:
        _run([*as_postgres, str(where / "initdb"), "-D", str(data), "-U", "postgres", "-E", "UTF8",
              "--auth=scram-sha-256", f"--pwfile={workdir / 'password'}", "--no-sync"])  # fmt: skip
        # loopback only, and the socket in our own directory (the packaged /var/run/postgresql may not exist)
        options = f"-h 127.0.0.1 -p {port} -k {workdir} -c fsync=off -c max_connections={max_connections}"
        _run([*as_postgres, str(where / "pg_ctl"), "-D", str(data), "-l", str(workdir / "server.log"), "-w",
              "-t", "60", "-o", options, "start"])  # fmt: skip
        try:
            yield f"postgresql://postgres:{password}@127.0.0.1:{port}/postgres"
        finally:
            _run([*as_postgres, str(where / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
