"""The plan's C++ wrapper for the compiled model (edge.engine_config.COMPILED_WRAPPER_ARGS) as vLLM's own OpenAI
server parses it, and the plugin's off switch (kernels/vllm_plugin/compiled_wrapper.py), which must change vLLM's
compile-cache key with the options it changes.

Each case runs in a fresh interpreter: the switch patches vLLM's CompilationConfig for the rest of its process, and
vLLM loads the plugin (entry point) as its server's parser is built, as it does in a served engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge.engine_config import COMPILED_WRAPPER_ARGS, COMPILED_WRAPPER_ENV
from kernels.vllm_plugin.compiled_wrapper import SWITCH, drop_cpp_wrapper, python_wrapper_asked

ROOT = Path(__file__).resolve().parents[2]

# vLLM's server parser on the given args; prints the parsed inductor options and the compilation config's hash (a
# factor of vLLM's compile-cache key).
PARSE = """
import json, sys
from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
config = args.compilation_config
print(json.dumps({"inductor": config.inductor_compile_config, "hash": config.compute_hash()}))
"""


def parse(args: list[str], **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != SWITCH} | env
    done = subprocess.run([sys.executable, "-c", PARSE, json.dumps(args)], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def parsed() -> dict[str, dict]:
    return {
        "plan": parse(COMPILED_WRAPPER_ARGS),
        "switched": parse(COMPILED_WRAPPER_ARGS, **{SWITCH: "python"}),
        "vllm": parse([]),
    }


def test_vllms_server_takes_the_plans_cpp_wrapper(parsed):
    assert parsed["plan"]["inductor"]["cpp_wrapper"] is True
    assert parsed["plan"]["inductor"]["cpp_wrapper_build_separate"] is True  # the wrapper at -O1, apart
    assert COMPILED_WRAPPER_ENV == {"VLLM_USE_LAYERNAME": "0"}  # the layer name as a string the C++ wrapper passes


def test_the_off_switch_compiles_as_vllm_ships_and_keys_the_cache_apart(parsed):
    """Switched off, the options are vLLM's own and so is the cache key: a cache compiled with the C++ wrapper is
    never loaded without it, nor the other way round."""
    assert "cpp_wrapper" not in parsed["switched"]["inductor"]
    assert parsed["switched"]["inductor"] == parsed["vllm"]["inductor"]
    assert parsed["switched"]["hash"] == parsed["vllm"]["hash"] != parsed["plan"]["hash"]


def test_the_switch_reads_its_value(monkeypatch):
    for value, asked in (("python", True), (" Python ", True), ("", False), ("cpp", False), ("0", False)):
        monkeypatch.setenv(SWITCH, value)
        assert python_wrapper_asked() is asked
    monkeypatch.delenv(SWITCH)
    assert python_wrapper_asked() is False
    options = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True, "size_asserts": False}
    assert drop_cpp_wrapper(options) and options == {"size_asserts": False}
    assert not drop_cpp_wrapper(options)
