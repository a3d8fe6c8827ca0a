"""Where the engine listens: a Unix socket in the run directory, never a TCP port.

A loopback port is anyone's: chosen by binding port 0 and releasing it, another local process could bind it before
vLLM did, answer /health and receive users' prompts. A socket file in a directory only this user may enter (the
run directory, 0700) is out of every other user's reach, and each start of the engine gets a fresh one. A run
directory whose path is too long for a socket's (sun_path) has its sockets in a private directory of its own under
the temp directory instead (socket_dir).

vLLM 0.28 listens there with `--uds PATH`, and then ignores --host and --port (entrypoints/openai/cli_args.py:261).
Its bind is plain (api_server.py:571 create_server_unix_socket, called at :613 before the model loads; listen()
comes once it is loaded): a file already at PATH fails it (address in use), the socket's mode follows the umask,
and nothing removes the file when vLLM exits (uvicorn is handed the bound socket, so its own unlink and chmod of
`uds` never run). Hence: the supervisor names a path nobody holds, narrows the socket to 0600 once it appears,
checks that the process listening on it is its engine (SO_PEERCRED), and removes it when the engine stops.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import socket
import stat
import struct
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx

from server.supervisor.processes import group_members

# What requests to the engine name: the socket, not the host, decides where they go.
ENGINE_URL = "http://localhost"
# sun_path holds 108 bytes, its closing NUL included (unix(7)).
MAX_SOCKET_PATH_BYTES = 107
SOCKET_GLOB = "engine-*.sock"
# pid_max is at most 2^22 (proc(5)): the longest name socket_name() makes.
LONGEST_SOCKET_NAME = len("engine-4194304-00000000.sock")


def socket_name() -> str:
    """engine-<this wrapper's pid>-<8 random hex digits>.sock: fresh for each start, and short."""
    return f"engine-{os.getpid()}-{secrets.token_hex(4)}.sock"


def fits_socket_path(directory: Path) -> bool:
    """Whether the longest name socket_name() makes, in `directory`, fits a Unix socket's path."""
    return len(os.fsencode(directory)) + 1 + LONGEST_SOCKET_NAME <= MAX_SOCKET_PATH_BYTES


def fallback_socket_dir(run_dir: Path) -> Path:
    """<temp dir>/edge-select-<uid>/<16 hex digits of the sha256 of the run directory's resolved path>: short,
    this user's, and the same for the same run directory, so the next edge-serve of this cache directory finds
    (and sweeps) the sockets a killed one left there."""
    digest = hashlib.sha256(os.fsencode(run_dir.resolve())).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"edge-select-{os.getuid()}" / digest


def socket_path_problem(run_dir: Path) -> str | None:
    """Why no engine socket for `run_dir` could be bound (its path would be too long both in the run directory and
    in its fallback directory under the temp directory), or None."""
    if fits_socket_path(run_dir):
        return None
    fallback = fallback_socket_dir(run_dir)
    if fits_socket_path(fallback):
        return None
    longest = len(os.fsencode(fallback)) + 1 + LONGEST_SOCKET_NAME
    spare = len(os.fsencode(fallback)) - len(os.fsencode(fallback.parent.parent))
    return (f"run directory {str(run_dir)!r}: the engine's socket fits neither there ({run_dir}/engine-PID-XXXXXXXX"
            f".sock) nor under the temp directory ({fallback}/engine-PID-XXXXXXXX.sock, up to {longest} bytes): "
            f"both are over the {MAX_SOCKET_PATH_BYTES} a Unix socket's path may hold; expected a run directory "
            f"of at most {MAX_SOCKET_PATH_BYTES - 1 - LONGEST_SOCKET_NAME} bytes or a temp directory of at most "
            f"{MAX_SOCKET_PATH_BYTES - 1 - LONGEST_SOCKET_NAME - spare} bytes: set EDGE_RUN_DIR (or "
            "EDGE_SELECT_CACHE_DIR), or TMPDIR, to a shorter one")  # fmt: skip


def private_dir(path: Path, what: str = "run directory") -> Path:
    """`path` made ours alone (0700): another user could otherwise plant or change pid files or sockets, or links
    where they are written. Raises OSError, naming it, for one that is a symlink or another user's."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise OSError(f"{what} {path} is not a directory (a symlink?): refusing to keep the engine's files there")
    if info.st_uid != os.getuid():
        raise OSError(f"{what} {path} belongs to uid {info.st_uid}, not this user ({os.getuid()})")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)
    return path


def socket_dir(run_dir: Path) -> Path:
    """Where the engine's sockets for `run_dir` go, made private (private_dir): the run directory itself when a
    socket's path there fits, beside the pid files; else its fallback_socket_dir, both levels of it 0700 and this
    user's (the temp directory is shared: another user may have made edge-select-<uid> first, or a link there),
    found again by the next wrapper of the same cache directory. Raises OSError naming the path refused."""
    private_dir(run_dir)
    if fits_socket_path(run_dir):
        return run_dir
    fallback = fallback_socket_dir(run_dir)
    if not fits_socket_path(fallback):
        raise OSError(socket_path_problem(run_dir))
    try:
        private_dir(fallback.parent, "socket directory")
        return private_dir(fallback, "socket directory")
    except OSError as exc:
        raise OSError(
            f"{exc} (the run directory {run_dir} is too long for a socket's path, so the engine's "
            "sockets go under the temp directory: set TMPDIR, or EDGE_RUN_DIR to a shorter one)"
        ) from exc


def fresh_socket_path(directory: Path) -> Path:
    """A path in `directory` (private already: socket_dir) that nothing holds now."""
    while True:
        path = directory / socket_name()
        if not os.path.lexists(path):
            return path


def wrapper_pid_of(path: Path) -> int | None:
    """The wrapper pid a socket's name carries (socket_name), or None for another name."""
    parts = path.name.removesuffix(".sock").split("-")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


class NotOurSocket(OSError):
    """The file at the engine's socket path is not a socket of this user's."""


def make_private(path: Path) -> None:
    """The engine's socket, checked (a socket, not a link, this user's) and narrowed to 0600: connecting needs
    write permission, so no other user could connect even were the directory opened (defence in depth; vLLM's
    bind leaves the mode to the umask). Raises NotOurSocket."""
    info = path.lstat()
    if not stat.S_ISSOCK(info.st_mode):
        raise NotOurSocket(f"{path} is not a socket (mode {stat.filemode(info.st_mode)})")
    if info.st_uid != os.getuid():
        raise NotOurSocket(f"{path} belongs to uid {info.st_uid}, not this user ({os.getuid()})")
    if stat.S_IMODE(info.st_mode) != 0o600:
        path.chmod(0o600)


def listener_pid(path: Path, timeout_s: float = 5.0) -> int | None:
    """The process that listens on the socket at `path` (SO_PEERCRED: the peer's credentials as at its listen()),
    or None when nothing accepts connections there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(os.fspath(path))
        except OSError:
            return None
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid


async def not_our_engine(client: httpx.AsyncClient, path: Path, group: int, headers: Mapping[str, str]) -> str | None:
    """Why what answers on the engine's socket `path` is not the engine the supervisor started (process group
    `group`, its key in `headers`), or None when it is.

    The socket must be a socket of this user's (then narrowed to 0600), listened on by a process of the
    engine's group (SO_PEERCRED), before anything but /health is sent to it. Then, as vLLM guards /v1 alone,
    ours refuses /v1 without its key and serves it with the key: asked without the key first, so that a
    server that serves anyone never sees the key."""
    taken = "another process made the engine's socket"
    try:
        make_private(path)
    except NotOurSocket as exc:
        return f"{exc}: {taken}"
    except OSError as exc:
        return f"socket {path}: {type(exc).__name__}: {exc}"
    listener = await asyncio.to_thread(listener_pid, path)
    if listener is None or listener not in group_members(group):
        return f"socket {path} is listened on by pid {listener}, not by the engine (group {group}): {taken}"
    url = ENGINE_URL + "/v1/models"
    try:
        without = await client.get(url)
        if without.status_code != 401:
            return (f"socket {path} answers /v1/models without the engine's key ({without.status_code}): "
                    f"{taken}")  # fmt: skip
        keyed = await client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        return f"socket {path}: /v1/models failed: {type(exc).__name__}: {exc}"
    if keyed.status_code != 200:
        return f"socket {path} refuses the engine's key ({keyed.status_code}): {taken}"
    return None


def remove_socket(path: Path) -> None:
    """The socket file gone, if it is one (never a file of another kind; a link is removed, not followed)."""
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


class EngineTransport(httpx.AsyncBaseTransport):
    """Requests to whichever start of the engine runs now, over its socket: one connection pool (with `limits`)
    per socket path, the pool of an engine that is gone closed once the next one's opens. A client built on it
    lives as long as the app, while the socket changes with each start of the engine."""

    def __init__(self, socket_path: Callable[[], Path | None], *, limits: httpx.Limits) -> None:
        self._socket_path = socket_path
        self._limits = limits
        self._path: Path | None = None
        self._pool: httpx.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = self._socket_path()
        if path is None:
            raise httpx.ConnectError("the engine has no socket: it was never started", request=request)
        if path != self._path or self._pool is None:
            old, self._path = self._pool, path
            self._pool = httpx.AsyncHTTPTransport(uds=os.fspath(path), limits=self._limits)
            if old is not None:
                await old.aclose()
        return await self._pool.handle_async_request(request)

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
            self._pool = None


def engine_client(path: Path, **kwargs) -> httpx.AsyncClient:
    """An httpx client for one start of the engine, over its socket (the supervisor's probes)."""
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=os.fspath(path)), **kwargs)
