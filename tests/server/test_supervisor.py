"""The engine supervisor, run against the STAND-IN engine (tests/server/standin_engine.py) as a real child."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from server.supervisor.command import EngineRefused, engine_argv, vllm_launcher
from server.supervisor.processes import describe_exit, group_members, process_cmdline, process_start_time
from server.supervisor.run_dir import EngineRecord, write_record
from server.supervisor.sockets import LONGEST_SOCKET_NAME, MAX_SOCKET_PATH_BYTES, socket_dir
from server.supervisor.supervisor import EngineSupervisor, backoff_delay
from tests.server.conftest import eventually, fast_settings, smollm2_plan, standin

REPO = Path(__file__).parents[2]

pytestmark = pytest.mark.anyio


def supervisor_for(*flags: str, **settings) -> EngineSupervisor:
    return EngineSupervisor.for_plan(
        smollm2_plan(),
        "/models/SmolLM2-135M-Instruct",
        settings=fast_settings(**settings),
        executable=standin(*flags),
    )


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie nobody reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def worker_pid(supervisor: EngineSupervisor) -> int:
    lines = [line for line in supervisor.log_tail if line.startswith("stand-in worker pid ")]
    assert lines, f"the stand-in did not report its worker: {list(supervisor.log_tail)}"
    return int(lines[-1].rsplit(" ", 1)[1])


def test_engine_command_is_vllm_serve_with_the_plan_args_on_a_unix_socket():
    plan = smollm2_plan()
    argv = engine_argv(plan, "/m", socket_path="/cache/run/engine-1-0a1b2c3d.sock")
    launcher = vllm_launcher()
    assert argv == [*launcher, "--model", "/m", *plan.vllm.args, "--uds", "/cache/run/engine-1-0a1b2c3d.sock"]
    assert launcher[-2:] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[:-2] == plan.vllm.command("/m", launcher)  # built in one place, the plan's
    assert "--host" not in argv and "--port" not in argv  # no TCP port at all


def test_engine_serves_the_model_under_its_short_name_and_its_path():
    plan = smollm2_plan()
    command = EngineSupervisor.for_plan(plan, "/cache/converted/SmolLM2-135M-Instruct-bf16-bdf0e2de72f9").command
    names = command[command.index("--served-model-name") + 1 :]
    assert names == ["SmolLM2-135M-Instruct-bf16", "/cache/converted/SmolLM2-135M-Instruct-bf16-bdf0e2de72f9"]
    assert command[: command.index("--served-model-name")] == plan.vllm.command(names[1], vllm_launcher())


def test_a_served_model_name_set_by_the_user_replaces_the_short_name():
    supervisor = EngineSupervisor.for_plan(smollm2_plan(), "/m", settings=fast_settings(served_model_name="smollm2"))
    command = supervisor.command
    assert command[command.index("--served-model-name") + 1 :] == ["smollm2", "/m"]
    assert supervisor.status().served_model_name == "smollm2"


def test_plan_env_is_added_to_the_engine_environment():
    supervisor = supervisor_for()
    assert supervisor.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert supervisor.env["EDGE_TEST_MARKER"] == "from-plan"
    assert supervisor.env["PATH"] == os.environ["PATH"]


def test_plan_over_its_memory_budget_is_refused():
    with pytest.raises(EngineRefused, match="over the memory budget"):
        EngineSupervisor.for_plan(smollm2_plan(fits=False), "/m")


def test_plan_over_its_memory_budget_starts_when_forced():
    supervisor = EngineSupervisor.for_plan(smollm2_plan(fits=False), "/m", force=True)
    assert supervisor.state == "stopped"
    assert supervisor.command[: len(vllm_launcher()) + 2] == [*vllm_launcher(), "--model", "/m"]


def test_export_only_plan_is_refused_even_when_forced():
    plan = smollm2_plan().model_copy(update={"path": "export-only", "vllm": None})
    with pytest.raises(EngineRefused, match="nothing to serve"):
        EngineSupervisor.for_plan(plan, "/m", force=True)


def test_backoff_doubles_from_initial_and_stops_at_the_cap():
    delays = [backoff_delay(n, initial=1.0, cap=10.0) for n in range(1, 7)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_backoff_jitter_stays_within_its_fraction_and_under_the_cap():
    rng = random.Random(7)
    delays = [backoff_delay(3, initial=1.0, cap=10.0, jitter=0.25, rng=rng) for _ in range(200)]
    assert all(3.0 <= d <= 5.0 for d in delays)
    assert len(set(delays)) > 1
    assert all(backoff_delay(9, initial=1.0, cap=10.0, jitter=0.25, rng=rng) <= 10.0 for _ in range(50))


def test_exit_is_described_by_code_or_signal_name():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by signal SIGKILL"


async def test_engine_is_starting_until_its_health_answers_then_ready():
    supervisor = supervisor_for("--ready-after", "1.0")
    await supervisor.start()
    try:
        await eventually(lambda: supervisor.pid is not None)
        assert supervisor.state == "starting"
        assert await supervisor.wait_ready(30)
        status = supervisor.status()
        assert status.state == "ready" and status.pid == supervisor.pid and status.restarts == 0
        assert any(f"listening on unix:{supervisor.socket_path}" in line for line in supervisor.log_tail)
    finally:
        await supervisor.stop()


async def test_engine_killed_with_sigkill_is_restarted_and_ready_again():
    supervisor = supervisor_for()
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        first_pid = supervisor.pid
        os.kill(first_pid, signal.SIGKILL)
        await eventually(lambda: supervisor.state in ("crashed", "restarting"))
        await eventually(lambda: supervisor.restarts == 1 and supervisor.state == "ready")
        assert supervisor.pid != first_pid
        assert supervisor.last_error.startswith("killed by signal SIGKILL")
    finally:
        await supervisor.stop()


async def test_engine_that_keeps_dying_restarts_with_growing_backoff():
    supervisor = supervisor_for("--exit-after", "0", "--exit-code", "3")
    await supervisor.start()
    try:
        await eventually(lambda: len(supervisor.delays) >= 5)
        assert supervisor.delays[:5] == [0.05, 0.1, 0.2, 0.4, 0.4]
        assert supervisor.state in ("crashed", "restarting")
        assert "exit code 3 before it became ready" in supervisor.last_error
    finally:
        await supervisor.stop()
    assert supervisor.state == "stopped"


async def test_crash_reason_carries_the_engines_last_log_lines():
    supervisor = supervisor_for("--exit-after", "0", "--exit-code", "7")
    await supervisor.start()
    try:
        await eventually(lambda: supervisor.last_error is not None)
        assert "exit code 7" in supervisor.last_error
        assert "stand-in will exit with code 7" in supervisor.last_error
    finally:
        await supervisor.stop()


async def test_engine_not_ready_in_time_is_killed_and_started_again():
    supervisor = supervisor_for("--ready-after", "600", ready_timeout_s=0.5)
    await supervisor.start()
    try:
        await eventually(lambda: supervisor.restarts >= 1)
        assert "not ready within 0.5 s" in supervisor.last_error
    finally:
        await supervisor.stop()


async def test_command_that_cannot_start_is_retried_not_fatal():
    supervisor = EngineSupervisor(["/nonexistent/vllm", "serve"], settings=fast_settings())
    await supervisor.start()
    try:
        await eventually(lambda: len(supervisor.delays) >= 2)
        assert "could not start '/nonexistent/vllm'" in supervisor.last_error
    finally:
        await supervisor.stop()


async def test_stop_ends_the_whole_process_group():
    supervisor = supervisor_for("--spawn-worker")
    await supervisor.start()
    assert await supervisor.wait_ready(30)
    leader, worker = supervisor.pid, worker_pid(supervisor)
    assert alive(worker) and worker in group_members(leader)
    await supervisor.stop()
    assert supervisor.state == "stopped" and supervisor.pid is None
    assert group_members(leader) == [] and not alive(worker)


async def test_stop_escalates_to_sigkill_when_the_engine_ignores_sigterm():
    supervisor = supervisor_for("--ignore-sigterm", stop_grace_s=0.5)
    await supervisor.start()
    assert await supervisor.wait_ready(30)
    proc = supervisor._proc
    await supervisor.stop()
    assert proc.returncode == -signal.SIGKILL


async def test_workers_of_a_dead_engine_do_not_outlive_it():
    supervisor = supervisor_for("--spawn-worker")
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        orphan = worker_pid(supervisor)
        os.kill(supervisor.pid, signal.SIGKILL)
        await eventually(lambda: supervisor.restarts == 1 and supervisor.state == "ready")
        assert not alive(orphan)
    finally:
        await supervisor.stop()


async def test_dead_engine_is_crashed_during_its_backoff_and_stop_cuts_the_wait_short():
    supervisor = supervisor_for("--exit-after", "0", backoff_initial_s=3600, backoff_max_s=3600)
    await supervisor.start()
    await eventually(lambda: supervisor.state == "crashed")
    status = supervisor.status()
    assert status.pid is None and status.last_error and 0 < status.next_restart_in_s <= 3600
    await supervisor.stop()  # does not sit out the hour
    assert supervisor.state == "stopped" and supervisor.restarts == 0


# -- no orphans: the engine's tree dies with its wrapper, and the next wrapper stops what a dead one left -----

WRAPPER = """
import asyncio, json, sys
from server.supervisor.supervisor import EngineSupervisor
from tests.server.conftest import fast_settings, smollm2_plan, standin

async def main():
    supervisor = EngineSupervisor.for_plan(smollm2_plan(), "/m", settings=fast_settings(run_dir=sys.argv[1]),
                                           executable=standin("--spawn-worker"))
    await supervisor.start()
    assert await supervisor.wait_ready(30)
    worker = [line for line in supervisor.log_tail if line.startswith("stand-in worker pid ")][-1].split()[-1]
    print(json.dumps({"leader": supervisor.pid, "engine": supervisor.engine_pid, "worker": int(worker),
                      "socket": str(supervisor.socket_path)}), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def start_wrapper(run_dir: Path) -> tuple[subprocess.Popen, dict[str, int]]:
    """A process that supervises the stand-in (with a worker) and then only waits: a wrapper to kill."""
    wrapper = subprocess.Popen([sys.executable, "-c", WRAPPER, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                               text=True)  # fmt: skip
    line = wrapper.stdout.readline()
    assert line, f"the wrapper exited {wrapper.wait()} before its engine was ready"
    pids = json.loads(line)
    wrapper.engine_socket = Path(pids.pop("socket"))
    return wrapper, {name: (pid, process_start_time(pid)) for name, pid in pids.items()}


def still_running(pids: dict) -> list[str]:
    """Which of the named processes still run: the same pid with the same start time (never by name)."""
    return [name for name, (pid, start) in pids.items() if start is not None and process_start_time(pid) == start]


def wait_gone(pids: dict, guard_s: float = 30.0) -> float:
    started = time.monotonic()
    while still_running(pids):
        assert time.monotonic() - started < guard_s, f"still running: {still_running(pids)}"
        time.sleep(0.02)
    return time.monotonic() - started


def kill_wrapper(wrapper: subprocess.Popen) -> None:
    wrapper.kill()
    wrapper.wait()


def test_the_engine_tree_dies_with_a_wrapper_killed_with_sigkill(tmp_path):
    wrapper, pids = start_wrapper(tmp_path)
    assert still_running(pids) == ["leader", "engine", "worker"]
    kill_wrapper(wrapper)
    wait_gone(pids)
    assert list(tmp_path.glob("engine-*.json"))  # the wrapper died without removing its pid file


async def test_a_new_supervisor_stops_the_engine_a_dead_wrapper_left(tmp_path):
    """A watchdog that cannot act (stopped) when its wrapper dies leaves the engine running; the next supervisor
    of the same run directory finds it by its pid file and stops it before starting its own."""
    wrapper, pids = start_wrapper(tmp_path)
    os.kill(pids["leader"][0], signal.SIGSTOP)
    kill_wrapper(wrapper)
    time.sleep(0.5)
    assert still_running(pids) == ["leader", "engine", "worker"]  # left behind
    record = EngineRecord.model_validate_json(next(tmp_path.glob("engine-*.json")).read_text())
    assert record.leader_pid == pids["leader"][0] and record.leader_start == pids["leader"][1]
    assert {pid for pid, _ in pids.values()} <= set(record.members)

    supervisor = supervisor_for(run_dir=str(tmp_path))
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        assert still_running(pids) == []  # stopped before the new engine started
        assert len(supervisor.swept) == 1 and f"engine of wrapper {record.wrapper_pid}" in supervisor.swept[0]
        assert [path.name for path in tmp_path.glob("engine-*.json")] == [f"engine-{os.getpid()}-{supervisor.pid}.json"]
    finally:
        await supervisor.stop()


def record_for(tmp_path: Path, *, wrapper: tuple[int, int], leader: tuple[int, int], cmdline: str | None = None
               ) -> Path:  # fmt: skip
    path = tmp_path / f"engine-{wrapper[0]}-{leader[0]}.json"
    cmdlines = {leader[0]: cmdline} if cmdline is not None else {}
    write_record(path, EngineRecord(wrapper_pid=wrapper[0], wrapper_start=wrapper[1], leader_pid=leader[0],
                                    leader_start=leader[1], members={leader[0]: leader[1]}, argv=["x"],
                                    cmdlines=cmdlines))  # fmt: skip
    return path


def a_dead_process() -> tuple[int, int]:
    done = subprocess.Popen(["true"])
    start = process_start_time(done.pid) or 1
    done.wait()
    return done.pid, start


async def test_the_sweep_leaves_the_engine_of_a_wrapper_still_running_alone(tmp_path):
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        me = (os.getpid(), process_start_time(os.getpid()))
        path = record_for(tmp_path, wrapper=me, leader=(other.pid, process_start_time(other.pid)))
        supervisor = supervisor_for(run_dir=str(tmp_path))
        await supervisor.start()
        await supervisor.wait_ready(30)
        await supervisor.stop()
        assert other.poll() is None and path.exists() and supervisor.swept == []
    finally:
        other.kill()
        other.wait()


async def test_the_sweep_never_stops_a_process_that_only_shares_a_recorded_pid(tmp_path):
    """The recorded leader's pid now names another process (another start time): it is not the engine."""
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        path = record_for(tmp_path, wrapper=a_dead_process(), leader=(other.pid, process_start_time(other.pid) - 1))
        supervisor = supervisor_for(run_dir=str(tmp_path))
        await supervisor.start()
        await supervisor.wait_ready(30)
        await supervisor.stop()
        assert other.poll() is None and supervisor.swept == []
        assert not path.exists()  # the record of a dead wrapper goes, whatever it named
    finally:
        other.kill()
        other.wait()


async def test_an_engine_under_way_is_recorded_and_its_record_removed_when_it_stops(tmp_path):
    supervisor = supervisor_for("--spawn-worker", run_dir=str(tmp_path))
    await supervisor.start()
    assert await supervisor.wait_ready(30)
    record = EngineRecord.model_validate_json(next(tmp_path.glob("engine-*.json")).read_text())
    assert (record.wrapper_pid, record.leader_pid) == (os.getpid(), supervisor.pid)
    assert record.leader_start == process_start_time(supervisor.pid)
    assert set(group_members(supervisor.pid)) <= set(record.members)  # engine and worker, once ready
    assert record.socket == str(supervisor.socket_path) and supervisor.socket_path.is_socket()
    await supervisor.stop()
    assert not list(tmp_path.glob("engine-*.json")) and not list(tmp_path.glob("*.sock"))


async def test_the_socket_a_killed_wrapper_left_is_removed_by_the_next_one(tmp_path):
    """The engine dies with its wrapper, but its socket file stays (vLLM never removes it); the next wrapper of the
    run directory removes it, with the pid file that names it, before its own engine listens on a fresh one."""
    wrapper, pids = start_wrapper(tmp_path)
    left = wrapper.engine_socket
    kill_wrapper(wrapper)
    wait_gone(pids)
    assert left.is_socket() and left.parent == tmp_path
    supervisor = supervisor_for(run_dir=str(tmp_path))
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        assert not left.exists() and list(tmp_path.glob("*.sock")) == [supervisor.socket_path]
    finally:
        await supervisor.stop()
    assert not list(tmp_path.glob("*.sock"))


def bound_socket(path: Path) -> None:
    """A socket file at `path`, as an engine that died leaves it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))


@pytest.mark.parametrize("run_dir_depth", ["short", "too deep for a socket path"])
async def test_a_socket_no_record_names_is_removed_once_its_wrapper_is_gone(tmp_path, short_tempdir, run_dir_depth):
    """A wrapper killed before it wrote its pid file leaves a socket no record names: the pid in its name tells
    whose it was; gone, it is removed, still running, it is left alone. So in the run directory, and so in the
    directory under the temp directory that a run directory too deep for a socket path has its sockets in."""
    run_dir = tmp_path if run_dir_depth == "short" else too_deep(tmp_path)
    sockets = socket_dir(run_dir)
    assert (sockets == run_dir) == (run_dir_depth == "short")
    other = subprocess.Popen(["sleep", "60"])
    try:
        stale, kept = sockets / f"engine-{a_dead_process()[0]}-00000000.sock", sockets / f"engine-{other.pid}-1.sock"
        bound_socket(stale)
        bound_socket(kept)
        supervisor = supervisor_for(run_dir=str(run_dir))
        await supervisor.start()
        try:
            assert await supervisor.wait_ready(30)
            assert not stale.exists() and kept.is_socket()
        finally:
            await supervisor.stop()
    finally:
        other.kill()
        other.wait()


# -- a run directory too deep for a socket path: its sockets go under the temp directory ----------------------


@pytest.fixture
def short_tempdir(monkeypatch) -> Path:
    """A temp directory of the test's own, short, for this process (tempfile) and the wrappers it starts (TMPDIR):
    the fallback socket directories of the tests never mix with the real temp directory's."""
    path = Path(tempfile.mkdtemp(prefix="es-"))
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield path
    shutil.rmtree(path)


def too_deep(parent: Path, letter: str = "d") -> Path:
    """A run directory of 80 bytes: 2 too many for engine-<pid>-XXXXXXXX.sock in it to fit a socket's path."""
    return parent / (letter * (MAX_SOCKET_PATH_BYTES - 1 - LONGEST_SOCKET_NAME + 2 - len(str(parent)) - 1))


def test_a_run_directory_keeps_its_sockets_while_their_path_fits_and_moves_them_a_byte_beyond(tmp_path,
                                                                                            short_tempdir):  # fmt: skip
    fits = tmp_path / ("d" * (MAX_SOCKET_PATH_BYTES - 1 - LONGEST_SOCKET_NAME - len(str(tmp_path)) - 1))
    beyond = fits.with_name(fits.name + "d")
    assert len(os.fsencode(fits)) == 78 and socket_dir(fits) == fits  # beside the pid files
    assert socket_dir(beyond).parent == short_tempdir / f"edge-select-{os.getuid()}"


async def test_a_run_directory_too_deep_for_a_socket_path_serves_from_a_private_directory_under_the_temp_dir(
    tmp_path, short_tempdir
):
    deep = too_deep(tmp_path)
    supervisor = supervisor_for(run_dir=str(deep))
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        path = supervisor.socket_path
        assert path.is_socket() and len(os.fsencode(path)) <= MAX_SOCKET_PATH_BYTES
        assert path.parent.parent == short_tempdir / f"edge-select-{os.getuid()}"
        for directory in (path.parent, path.parent.parent):  # both levels: 0700, this user's, not links
            info = directory.lstat()
            assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        record = EngineRecord.model_validate_json(next(deep.glob("engine-*.json")).read_text())
        assert record.socket == str(path)  # the pid file stays in the run directory and names the socket
    finally:
        await supervisor.stop()
    assert not path.exists() and not list(deep.glob("engine-*"))


def test_a_run_directory_maps_to_one_socket_directory_and_another_to_another(tmp_path, short_tempdir):
    deep, other = too_deep(tmp_path, "d"), too_deep(tmp_path, "e")
    assert socket_dir(deep) == socket_dir(deep) != socket_dir(other)
    assert socket_dir(tmp_path / "x" / ".." / deep.name) == socket_dir(deep)  # however its path is written
    assert socket_dir(deep).parent == socket_dir(other).parent == short_tempdir / f"edge-select-{os.getuid()}"


@pytest.mark.parametrize("planted", ["another user's directory", "a link"])
async def test_a_temp_directory_parent_another_user_made_or_linked_is_refused_naming_it(tmp_path, short_tempdir,
                                                                                       planted):  # fmt: skip
    """The temp directory is shared: another user may make <tmp>/edge-select-<uid> first, or a link there, to have
    the engine listen where they reach it. The engine is not started, and last_error names the directory."""
    parent = short_tempdir / f"edge-select-{os.getuid()}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if planted == "a link":
        parent.symlink_to(elsewhere)
    elif os.getuid() != 0:
        pytest.skip("making a directory another user's needs root (chown)")
    else:
        parent.mkdir(mode=0o700)
        os.chown(parent, 65534, 65534)
    supervisor = supervisor_for(run_dir=str(too_deep(tmp_path)))
    await supervisor.start()
    try:
        await eventually(lambda: len(supervisor.delays) >= 1)
        assert f"socket directory {parent} " in supervisor.last_error and supervisor.pid is None
        assert "belongs to uid 65534" in supervisor.last_error or "symlink" in supervisor.last_error
    finally:
        await supervisor.stop()
    assert list(elsewhere.iterdir()) == [] and (parent.is_symlink() or list(parent.iterdir()) == [])


async def test_the_socket_a_killed_wrapper_left_under_the_temp_directory_is_removed_by_the_next_one(
    tmp_path, short_tempdir
):
    """The next wrapper of the same run directory finds the fallback directory again (by the run directory's path)
    and removes the socket a killed one left there, with the pid file that names it."""
    deep = too_deep(tmp_path)
    wrapper, pids = start_wrapper(deep)
    left = wrapper.engine_socket
    kill_wrapper(wrapper)
    wait_gone(pids)
    assert left.is_socket() and left.parent == socket_dir(deep) != deep
    supervisor = supervisor_for(run_dir=str(deep))
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        assert not left.exists() and list(left.parent.glob("*.sock")) == [supervisor.socket_path]
    finally:
        await supervisor.stop()
    assert not list(left.parent.glob("*.sock"))


def test_a_run_directory_too_deep_for_a_socket_path_even_under_the_temp_directory_is_refused_naming_both(
    tmp_path, short_tempdir, monkeypatch
):
    deep = too_deep(tmp_path)
    longest_tmp = MAX_SOCKET_PATH_BYTES - 1 - LONGEST_SOCKET_NAME - len(f"/edge-select-{os.getuid()}/") - 16
    deep_tmp = short_tempdir / ("t" * (longest_tmp - len(str(short_tempdir))))  # 1 byte too many
    monkeypatch.setattr(tempfile, "tempdir", str(deep_tmp))
    with pytest.raises(EngineRefused) as refused:
        supervisor_for(run_dir=str(deep))
    message = str(refused.value)
    assert f"run directory {str(deep)!r}" in message and f"{deep_tmp}/edge-select-{os.getuid()}/" in message
    assert "over the 107 a Unix socket's path may hold" in message and "at most 78 bytes" in message
    assert f"temp directory of at most {longest_tmp} bytes" in message and "TMPDIR" in message
    monkeypatch.setattr(tempfile, "tempdir", str(deep_tmp)[:-1])
    supervisor_for(run_dir=str(deep))  # a byte shorter: accepted


def test_a_socket_path_of_107_bytes_binds_and_one_of_109_does_not(tmp_path):
    """The limit the run directory's length is checked against is the kernel's (sun_path: 108 bytes)."""
    longest = tmp_path / ("s" * (MAX_SOCKET_PATH_BYTES - len(str(tmp_path)) - 1))
    assert len(os.fsencode(longest)) == MAX_SOCKET_PATH_BYTES
    bound_socket(longest)
    with pytest.raises(OSError, match="too long"):
        bound_socket(tmp_path / ("s" * (MAX_SOCKET_PATH_BYTES + 2 - len(str(tmp_path)) - 1)))


async def test_the_sweep_never_signals_a_process_whose_command_line_is_not_the_one_recorded(tmp_path):
    """Same pid, same start time, our user's, but another command line than the pid file says: not the engine
    (a forged or stale record), left alone; with the recorded command line it is stopped."""
    others = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2)]
    try:
        forged, real = others
        record_for(tmp_path, wrapper=a_dead_process(), leader=(forged.pid, process_start_time(forged.pid)),
                   cmdline="sleep\x0061\x00")  # fmt: skip
        record_for(tmp_path, wrapper=a_dead_process(), leader=(real.pid, process_start_time(real.pid)),
                   cmdline=process_cmdline(real.pid))  # fmt: skip
        supervisor = supervisor_for(run_dir=str(tmp_path))
        await supervisor.start()
        await supervisor.wait_ready(30)
        await supervisor.stop()
        assert forged.poll() is None and len(supervisor.swept) == 1 and f"pids {real.pid}" in supervisor.swept[0]
        assert real.wait(timeout=30) is not None
    finally:
        for other in others:
            other.kill()
            other.wait()


def test_the_run_directory_is_made_private_and_a_pid_file_is_never_written_through_a_link(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    os.chmod(run_dir, 0o755)
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    path = run_dir / "engine-1-2.json"
    path.with_suffix(".partial").symlink_to(victim)
    write_record(path, EngineRecord(wrapper_pid=1, wrapper_start=1, leader_pid=2, leader_start=2, members={},
                                    argv=["x"]))  # fmt: skip
    assert victim.read_text() == "untouched" and not path.is_symlink()
    assert (run_dir.stat().st_mode & 0o777) == 0o700 and (path.stat().st_mode & 0o777) == 0o600


async def test_a_pid_file_that_is_a_link_is_removed_unread(tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "engine-1-2.json").symlink_to(elsewhere)
    supervisor = supervisor_for(run_dir=str(run_dir))
    await supervisor.start()
    await supervisor.wait_ready(30)
    await supervisor.stop()
    assert not (run_dir / "engine-1-2.json").is_symlink() and elsewhere.read_text() == "{}"
