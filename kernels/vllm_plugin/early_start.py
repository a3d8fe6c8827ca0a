"""`python -m kernels.vllm_plugin.early_start [--script PATH]`: vLLM's OpenAI server, imported before its
arguments are known.

A warm start of the default model spends ~8 s of its ~14 s importing vLLM's OpenAI server
(`python -X importtime`, 2026-12-03, 2 cores of an AMD EPYC Zen 5), and edge-serve needs ~1.8 s of its own
(imports, probe, plan, the converter's up-to-date check) before it knows the engine's command. edge-serve starts
this module first (server/supervisor/early.py), in the environment the engine will have, and plans while it imports.

Then it reads one JSON line on its standard input, {"argv": [...], "env": {...}}: the server's arguments (the
model, the socket) and what the environment lacked at import (the engine's per-start key). It runs the server
module as `python -m` would, as `__main__` with that argv. End of input instead (edge-serve chose to start the
engine afresh, or is gone) ends it without serving. `--script PATH` runs the script PATH the same way instead
(the tests' stand-in engine).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import sys

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", help="run this script instead of vLLM's OpenAI server module")
    script = parser.parse_args(argv).script
    if script is None:
        importlib.import_module(SERVER_MODULE)
    else:
        runpy.run_path(script, run_name="__early_start__")  # its imports; its __main__ block waits for the go
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    go = json.loads(line)
    os.environ.update(go["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)  # as an engine started afresh: nothing reads its input
    os.dup2(devnull, 0)
    os.close(devnull)
    if script is not None:
        sys.argv = [script, *go["argv"]]
        runpy.run_path(script, run_name="__main__")
        return 0
    del sys.modules[SERVER_MODULE]  # `python -m` runs the module as __main__ without importing it by name first
    sys.argv = [sys.argv[0], *go["argv"]]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
