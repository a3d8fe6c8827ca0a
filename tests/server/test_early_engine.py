"""The early engine (server/supervisor/early.py): started before the plan is made, taken by the supervisor only when
the plan's environment is the one it was started in. Run against the STAND-IN engine (tests/server/
standin_engine.py) through kernels/vllm_plugin/early_start.py, the module that runs vLLM's server the same way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from server import cli
from server.supervisor.command import vllm_launcher
from server.supervisor.early import EarlyEngine, early_argv
from server.supervisor.processes import group_members
from server.supervisor.run_dir import EARLY_ENV_RECORD, recalled_engine_env, remember_engine_env
from server.supervisor.supervisor import EngineSupervisor
from tests.server.conftest import engine_request, fast_settings, smollm2_plan, standin
from tests.server.test_supervisor import alive

pytestmark = pytest.mark.anyio

PLAN_ENV = {"EDGE_TEST_PLAN": "a", "OMP_NUM_THREADS": "1"}


def supervisor_with(early: EarlyEngine | None, run_dir: Path, plan_env: dict[str, str]) -> EngineSupervisor:
    command = [*standin(), "--model", "/models/SmolLM2-135M-Instruct"]
    return EngineSupervisor(command, env=plan_env, settings=fast_settings(run_dir=str(run_dir)), early=early)


def early_standin(run_dir: Path) -> EarlyEngine:
    early = EarlyEngine.start(run_dir, grace_s=3.0, launcher=standin())
    assert early is not None
    return early


def test_the_plan_environment_recorded_is_the_one_recalled(tmp_path):
    remember_engine_env(tmp_path, PLAN_ENV)
    assert recalled_engine_env(tmp_path) == PLAN_ENV
    assert (tmp_path / EARLY_ENV_RECORD).stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("text", ["", "{", '{"plan_env": 3}', '{"plan_env": {"A": 1}}', '{"other": {}}'])
def test_an_unreadable_record_recalls_nothing(tmp_path, text):
    (tmp_path / EARLY_ENV_RECORD).write_text(text)
    assert recalled_engine_env(tmp_path) is None


def test_a_record_is_never_read_through_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"plan_env": PLAN_ENV}))
    (tmp_path / EARLY_ENV_RECORD).symlink_to(elsewhere)
    assert recalled_engine_env(tmp_path) is None


def test_without_a_recorded_environment_there_is_no_early_engine(tmp_path):
    assert EarlyEngine.start(tmp_path, grace_s=3.0, launcher=standin()) is None


def test_vllms_server_is_imported_ahead_by_the_early_start_module():
    assert early_argv(vllm_launcher()) == [sys.executable, "-m", "kernels.vllm_plugin.early_start"]
    assert early_argv(standin())[-2:] == ["--script", standin()[1]]


async def test_an_early_engine_started_in_the_plans_environment_is_the_engine_that_serves(tmp_path, caplog):
    caplog.set_level("INFO", logger="edge.engine")
    remember_engine_env(tmp_path, PLAN_ENV)
    early = early_standin(tmp_path)
    supervisor = supervisor_with(early, tmp_path, PLAN_ENV)
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        assert supervisor.pid == early.pid
        # the arguments and the per-start key came on its input: it serves on this start's socket, with its key
        assert any(f"listening on unix:{supervisor.socket_path}" in line for line in supervisor.log_tail)
        assert engine_request(supervisor, "GET", "/v1/models").status_code == 401
        assert engine_request(supervisor, "GET", "/v1/models", headers=supervisor.engine_headers).status_code == 200
        assert "it imported vLLM while edge-serve planned" in caplog.text
    finally:
        await supervisor.stop()
    assert not alive(early.pid)


async def test_an_early_engine_whose_environment_the_plan_changed_is_killed_and_the_engine_started_afresh(
    tmp_path, caplog
):
    caplog.set_level("INFO", logger="edge.engine")
    remember_engine_env(tmp_path, PLAN_ENV)
    early = early_standin(tmp_path)
    supervisor = supervisor_with(early, tmp_path, {**PLAN_ENV, "EDGE_TEST_PLAN": "b"})
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        assert supervisor.pid != early.pid
        assert not alive(early.pid)
        assert "early engine not used (its plan's environment changed)" in caplog.text
    finally:
        await supervisor.stop()


async def test_an_early_engine_is_not_taken_for_another_command(tmp_path):
    remember_engine_env(tmp_path, PLAN_ENV)
    early = early_standin(tmp_path)
    interpreter, script = standin()
    command = [interpreter, "-X", "utf8", script, "--model", "/models/SmolLM2-135M-Instruct"]  # the same server
    supervisor = EngineSupervisor(command, env=PLAN_ENV, settings=fast_settings(run_dir=str(tmp_path)), early=early)
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
        assert supervisor.pid != early.pid and not alive(early.pid)
    finally:
        await supervisor.stop()


def test_an_early_engine_not_taken_is_killed_with_everything_it_started(tmp_path):
    remember_engine_env(tmp_path, PLAN_ENV)
    early = early_standin(tmp_path)
    eventually_sync(lambda: len(group_members(early.pid)) >= 2)  # the watchdog has started the early start module
    members = group_members(early.pid)
    early.discard()
    assert not any(alive(pid) for pid in [early.pid, *members])
    early.discard()  # twice is harmless


def test_an_early_engine_whose_input_ends_exits_without_serving():
    """The go line never comes: edge-serve is gone, or chose to start the engine afresh."""
    done = subprocess.run(early_argv(standin()), input=b"", capture_output=True, timeout=60)
    assert done.returncode == 0 and b"listening" not in done.stderr + done.stdout


async def test_a_stand_in_engine_that_became_ready_leaves_no_recorded_environment(tmp_path):
    """Only vLLM's own server is started early: its environment is recorded when it becomes ready."""
    supervisor = supervisor_with(None, tmp_path, PLAN_ENV)
    await supervisor.start()
    try:
        assert await supervisor.wait_ready(30)
    finally:
        await supervisor.stop()
    assert recalled_engine_env(tmp_path) is None


def test_a_conversion_about_to_run_kills_the_early_engine_and_one_reused_does_not(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    plan = smollm2_plan()
    plan = plan.model_copy(update={"quantization_config": {"quant_method": "cpu_int4", "group_size": 32}})
    called: list[str] = []
    converter = [sys.executable, "-c", "import sys, os; os.makedirs(sys.argv[2], exist_ok=True)"]
    cli.convert(plan, model, converter, before_converting=lambda: called.append("first"))
    cli.convert(plan, model, converter, before_converting=lambda: called.append("second"))
    assert called == ["first"]


def eventually_sync(condition, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
