"""Fixtures shared by the kernels tests: vLLM layers built without an engine, the tokenizer generated GGUFs carry."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def single_rank_vllm(tmp_path_factory):
    """vLLM's unquantized layers ask for the tensor-parallel group even on one rank: make a 1-rank world."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(VllmConfig()):
        store = tmp_path_factory.mktemp("dist") / "store"
        parallel_state.init_distributed_environment(1, 0, f"file://{store}", 0, "gloo")
        parallel_state.initialize_model_parallel(1, 1)
        yield
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


@pytest.fixture(scope="module")
def tokenizer_source() -> Path:
    """The default model's GGUF, whose tokenizer the generated GGUFs of these tests carry."""
    from edge.errors import InputError
    from kernels.source.default_model import source_gguf

    try:
        return source_gguf()
    except InputError as missing:
        pytest.skip(f"the default model's GGUF (its tokenizer) is not installed: {missing}")


def engine_child(script: str, out: Path, args: list[str], env: dict[str, str], timeout: int = 1800) -> dict:
    """Run a slow test's module as its own engine process (`python SCRIPT ARGS`: the plugin installs once per
    process) and read back the JSON it wrote to `out`."""
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())
