"""Only the wrapper talks to the engine: `/v1/*` alone is forwarded, with the engine's own key (fresh for each
start, in its environment, never its argv), over a Unix socket made afresh for each start in a directory only this
user may enter, and checked to be the engine's (SO_PEERCRED); the engine holds no TCP port; the API process's
secrets stay out of the engine's environment. Run against the STAND-IN engine, which guards /v1 with VLLM_API_KEY
and binds --uds as vLLM does."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from server.app import create_app
from server.proxy import UnsafePath, engine_path
from server.supervisor.supervisor import EngineSupervisor
from tests.server.conftest import (
    STANDIN,
    engine_request,
    eventually,
    fast_settings,
    free_port,
    smollm2_plan,
    standin,
    uvicorn_on_loopback,
)

MODEL_DIR = "/models/SmolLM2-135M-Instruct"
TOKEN = "s3cret"


def raw_get(url: str, target: str) -> tuple[int, bytes]:
    """GET with the request target sent exactly as written (httpx would resolve its dot segments first)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("GET", target, headers={"Authorization": f"Bearer {TOKEN}"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def wait_until(predicate, guard_s: float = 30.0) -> None:
    """Hang guard only, not a speed requirement."""
    deadline = time.monotonic() + guard_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached before the hang guard"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def served():
    """uvicorn + the app + the stand-in; yields (url, supervisor)."""
    plan = smollm2_plan()
    settings = fast_settings(api_token=TOKEN, log_tail_lines=100_000)  # every line the engine logs, for sent_to_engine
    supervisor = EngineSupervisor.for_plan(plan, MODEL_DIR, settings=settings, executable=standin())
    with uvicorn_on_loopback(create_app(settings, supervisor=supervisor, plan=plan, model_dir=MODEL_DIR)) as url:
        wait_until(lambda: httpx.get(f"{url}/readyz").status_code == 200)
        yield url, supervisor


def sent_to_engine(supervisor: EngineSupervisor, request) -> list[str]:
    """The engine's log lines for the requests it received while `request()` ran, its liveness probes aside."""
    before = len(supervisor.log_tail)
    request()
    return [line for line in list(supervisor.log_tail)[before:] if "GET /health auth=none" not in line]


@pytest.mark.parametrize(
    ("target", "why"),
    [(t, b"dot segment") for t in ("/v1/../metrics", "/v1/%2e%2e/metrics", "/v1/%2E%2e/tokenize", "/v1/..%2fdocs",
                                   "/v1/models/../../health", "/v1/./models", "/v1/.%2E/.%2e/metrics")]
    + [(t, b"control character") for t in ("/v1/models%0d%0aX-Injected:%20yes", "/v1/%00", "/v1/models%7f")],
)  # fmt: skip
def test_a_dot_segment_or_a_control_character_never_reaches_the_engine_and_is_a_400(served, target, why):
    url, supervisor = served
    answers = []
    assert sent_to_engine(supervisor, lambda: answers.append(raw_get(url, target))) == []
    status, body = answers[0]
    assert status == 400 and why in body


def test_a_forwarded_path_reaches_the_engine_as_sent(served):
    url, supervisor = served
    answers = []
    seen = sent_to_engine(supervisor, lambda: answers.append(raw_get(url, "/v1/models?limit=1")))
    assert answers[0][0] == 200 and len(seen) == 1 and "GET /v1/models?limit=1 auth=engine-key" in seen[0]


def test_an_encoded_question_mark_stays_part_of_the_path():
    assert engine_path("models%3F?x") == "models%253F%3Fx"  # a literal % and ? the client encoded stay encoded


def test_a_dot_segment_is_refused_however_it_ends():
    for path in ("..", "a/..", "a/./b", "."):
        with pytest.raises(UnsafePath, match="dot segment"):
            engine_path(path)
    assert engine_path("a/...b/c.d") == "a/...b/c.d"  # dots inside a segment are a name, not a dot segment


def test_the_engine_refuses_v1_without_its_key_and_the_wrapper_adds_it(served):
    url, supervisor = served
    assert engine_request(supervisor, "GET", "/v1/models").status_code == 401
    assert engine_request(supervisor, "GET", "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}
                          ).status_code == 401  # fmt: skip
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


@pytest.mark.anyio
async def test_each_start_gets_a_fresh_socket_and_a_fresh_key_kept_out_of_its_argv():
    supervisor = EngineSupervisor.for_plan(smollm2_plan(), MODEL_DIR, settings=fast_settings(), executable=standin())
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        first = (supervisor.socket_path, supervisor.api_key, supervisor.engine_pid)
        with open(f"/proc/{first[2]}/cmdline", "rb") as f:
            assert first[1].encode() not in f.read()
        os.kill(supervisor.pid, signal.SIGKILL)
        await eventually(lambda: supervisor.restarts == 1 and supervisor.is_ready)
        assert supervisor.socket_path != first[0] and supervisor.api_key != first[1]
        assert not first[0].exists()  # the dead engine's socket is gone with it
        assert engine_request(supervisor, "GET", "/v1/models", headers={"Authorization": f"Bearer {first[1]}"}
                              ).status_code == 401  # fmt: skip
    finally:
        await supervisor.stop()
    assert not supervisor.socket_path.exists()  # and so is the last one's, once stopped


@pytest.mark.anyio
async def test_the_api_processes_secrets_never_reach_the_engines_environment(monkeypatch):
    secrets = {
        "EDGE_API_TOKEN": "api-secret",
        "EDGE_REPORT_TOKEN": "report-secret",
        "EDGE_CALIBRATION_DB": "postgresql://edge:db-secret@db:5432/edge",
        "VLLM_API_KEY": "inherited",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    supervisor = EngineSupervisor.for_plan(smollm2_plan(), MODEL_DIR, settings=fast_settings(), executable=standin())
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        with open(f"/proc/{supervisor.engine_pid}/environ", "rb") as f:
            environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if item)
    finally:
        await supervisor.stop()
    assert not {b"EDGE_API_TOKEN", b"EDGE_REPORT_TOKEN", b"EDGE_CALIBRATION_DB"} & set(environ)
    assert environ[b"VLLM_API_KEY"] == supervisor.api_key.encode() != b"inherited"
    assert environ[b"EDGE_TEST_MARKER"] == b"from-plan"  # the plan's environment does reach it


def listening_tcp_inodes() -> set[str]:
    """The socket inodes of every TCP socket listening on this host (state 0A in /proc/net/tcp and tcp6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    inodes.add(fields[9])
    return inodes


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process `pid` holds open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed while we looked
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def test_a_process_holding_the_old_port_never_receives_a_prompt():
    """Another local process listens on a loopback port first and serves anyone (a stand-in without a key, as the
    squatter of a port chosen by bind-and-release would): the engine listens on no TCP port at all, so every
    prompt reaches the engine over its socket, with its key, and the squatter sees nothing."""
    port = free_port()
    squatter = subprocess.Popen([sys.executable, STANDIN, "--model", "squat", "--port", str(port)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "VLLM_API_KEY": ""})  # fmt: skip
    try:
        wait_until(lambda: _answers(f"http://127.0.0.1:{port}/health"))
        plan = smollm2_plan()
        settings = fast_settings(api_token=TOKEN, log_tail_lines=100_000)
        supervisor = EngineSupervisor.for_plan(plan, MODEL_DIR, settings=settings, executable=standin())
        app = create_app(settings, supervisor=supervisor, plan=plan, model_dir=MODEL_DIR)
        with uvicorn_on_loopback(app) as url:
            wait_until(lambda: httpx.get(f"{url}/readyz").status_code == 200)
            assert "--port" not in supervisor.argv and supervisor.argv[-2:] == ["--uds", str(supervisor.socket_path)]
            assert not socket_inodes(supervisor.engine_pid) & listening_tcp_inodes()  # no TCP port to squat
            body = {"model": MODEL_DIR, "prompt": "my secret prompt", "max_tokens": 2}
            seen = sent_to_engine(supervisor, lambda: [
                httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
                           ).raise_for_status() for _ in range(3)])  # fmt: skip
    finally:
        squatter.terminate()
        squatted = squatter.communicate(timeout=30)[0]
    assert len(seen) == 3 and all("POST /v1/completions auth=engine-key" in line for line in seen)
    requests = [line for line in squatted.splitlines() if line.startswith("INFO stand-in ")]
    assert requests and all(" GET /health auth=none " in line for line in requests)  # this test's own checks only


@pytest.mark.anyio
async def test_a_process_listening_on_the_engines_socket_first_never_becomes_the_engine():
    """A process of this user binds the engine's fresh socket path before the engine does (the stand-in binds
    after 2 s, as vLLM takes seconds to start): /health answers there, but the listener is not of the engine's
    process group (SO_PEERCRED), so it never sees /v1, the key or a prompt; the next start, on a fresh socket,
    is the engine."""
    supervisor = EngineSupervisor.for_plan(smollm2_plan(), MODEL_DIR, settings=fast_settings(),
                                           executable=standin("--bind-after", "2"))  # fmt: skip
    await supervisor.start()
    squatter = None
    try:
        await eventually(lambda: supervisor.pid is not None and supervisor.socket_path is not None)
        taken = supervisor.socket_path
        squatter = subprocess.Popen([sys.executable, STANDIN, "--model", "squat", "--uds", str(taken)],
                                    stdout=subprocess.PIPE, text=True, env={**os.environ, "VLLM_API_KEY": ""})
        await eventually(lambda: supervisor.restart_reasons["socket-taken"] == 1 and supervisor.is_ready)
        assert f"socket {taken} is listened on by pid {squatter.pid}, not by the engine" in supervisor.last_error
        assert supervisor.socket_path != taken and supervisor.restarts == 1
    finally:
        await supervisor.stop()
        if squatter is not None:
            squatter.terminate()
    squatted = squatter.communicate(timeout=30)[0]
    assert "GET /health auth=none" in squatted  # it answered the health check...
    assert "/v1/" not in squatted and "auth=engine-key" not in squatted and "auth=other" not in squatted  # ...only


@pytest.fixture
def world_passable_run_dir():
    """A run directory whose parent any user may pass through (0755): only the run directory itself and the
    socket's own mode keep another user out."""
    parent = Path(tempfile.mkdtemp(prefix="edge-uds-"))
    parent.chmod(0o755)
    yield parent / "run"
    subprocess.run(["rm", "-rf", str(parent)], check=True)


def connects_as(uid: int, path: Path) -> int:
    """0 when a process of user `uid` (no supplementary groups) can connect to the Unix socket `path`, else the
    errno its connect failed with (13: EACCES). Forked, so the test's own process keeps its user."""
    child = os.fork()
    if child == 0:
        code = 255
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(path))
            code = 0
        except OSError as exc:
            code = exc.errno or 255
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


@contextlib.asynccontextmanager
async def ready_standin(run_dir):
    """A supervisor of the stand-in engine in `run_dir`, ready; stopped on the way out."""
    supervisor = EngineSupervisor.for_plan(smollm2_plan(), MODEL_DIR, settings=fast_settings(run_dir=str(run_dir)),
                                           executable=standin())  # fmt: skip
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        yield supervisor
    finally:
        await supervisor.stop()


@pytest.mark.anyio
async def test_the_engine_socket_is_not_reachable_by_other_users(world_passable_run_dir):
    """The socket lies in the run directory, which is this user's and 0700, and is itself 0600 (connecting needs
    write permission): the directory alone, and the socket's mode alone, keep every other user out."""
    run_dir = world_passable_run_dir
    supervisor = EngineSupervisor.for_plan(smollm2_plan(), MODEL_DIR, settings=fast_settings(run_dir=str(run_dir)),
                                           executable=standin())  # fmt: skip
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        path = supervisor.socket_path
        directory, sock = run_dir.lstat(), path.lstat()
        assert path.parent == run_dir and len(os.fsencode(path)) <= 107
        assert stat.S_ISDIR(directory.st_mode) and stat.S_IMODE(directory.st_mode) == 0o700
        assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o600
        assert directory.st_uid == sock.st_uid == os.getuid()
    finally:
        await supervisor.stop()


@pytest.mark.anyio
@pytest.mark.skipif(os.getuid() != 0, reason="connecting as another user needs root (setuid)")
async def test_another_user_cannot_connect_to_the_engine_socket(world_passable_run_dir):
    nobody = 65534
    run_dir = world_passable_run_dir
    async with ready_standin(run_dir) as supervisor:
        path = supervisor.socket_path
        assert connects_as(nobody, path) == 13  # EACCES: the run directory is 0700
        run_dir.chmod(0o755)
        assert connects_as(nobody, path) == 13  # EACCES: the socket is 0600, even in an open directory
        path.chmod(0o666)
        assert connects_as(nobody, path) == 0  # the control: with both opened, that user does connect


@pytest.mark.anyio
async def test_a_run_directory_that_is_a_link_is_never_listened_in(tmp_path):
    """A link where the run directory should be (planted to move the socket somewhere others reach) is refused:
    the engine is not started, and why is in last_error."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(elsewhere)
    supervisor = EngineSupervisor.for_plan(smollm2_plan(), MODEL_DIR,
                                           settings=fast_settings(run_dir=str(tmp_path / "run")),
                                           executable=standin())  # fmt: skip
    await supervisor.start()
    try:
        await eventually(lambda: len(supervisor.delays) >= 1)
        assert "no private directory for the engine's socket" in supervisor.last_error
        assert "symlink" in supervisor.last_error and supervisor.pid is None
    finally:
        await supervisor.stop()
    assert supervisor.restart_reasons.get("socket-taken", 0) == 0 and list(elsewhere.iterdir()) == []


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.HTTPError:
        return False
