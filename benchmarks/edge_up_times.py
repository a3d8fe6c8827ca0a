"""The launcher's first and second run on this box: wall time from `deploy/edge-up` to a ready engine.

The first run starts from nothing (a new virtual environment and an empty cache directory, both under WORKDIR);
the second reuses both, as an operator's second start would. Each run is stopped (SIGTERM to its process group)
once `/readyz` answers 200 and one completion came back through the wrapper.

    python3 benchmarks/edge_up_times.py WORKDIR [--port 8090]

Warm starts per serving mode (`--warm`): the environment, the converted model and each mode's compile cache
already present (this checkout's .venv, or EDGE_VENV, and EDGE_SELECT_CACHE_DIR or the default cache); one start
per mode and pass, interleaved, with a first unmeasured start of each mode that fills its compile cache. Reports
each mode's median seconds to /readyz 200:

    python3 benchmarks/edge_up_times.py --warm [--modes one-process,two-process,three-process] [--passes 3]
        [--port 8090] [--early on|off|both]

`--early both` starts each mode with and without the early engine (server/supervisor/early.py: vLLM imported while
edge-serve plans; EDGE_EARLY_ENGINE=0 turns it off), interleaved, and reports each variant's median and the
ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _complete(port: int) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models")
    with urllib.request.urlopen(request, timeout=60) as response:
        model = json.load(response)["data"][0]["id"]
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "model": model}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)["choices"][0]["text"]


def one_run(
    workdir: Path | None,
    port: int,
    log: Path,
    timeout_s: float = 3600,
    mode: str | None = None,
    env_extra: dict[str, str] | None = None,
) -> dict:
    """One start of deploy/edge-up (under WORKDIR's venv and cache; None: the current ones), `mode` its serving
    mode (None: the plan's), to /readyz 200 and one completion; then SIGTERM to its process group."""
    env = dict(os.environ) | (env_extra or {})
    if workdir is not None:
        env |= {"EDGE_VENV": str(workdir / "venv"), "EDGE_SELECT_CACHE_DIR": str(workdir / "cache")}
    argv = [str(REPO / "deploy" / "edge-up"), "--port", str(port), *(["--serving-mode", mode] if mode else [])]
    start = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while not _ready(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"edge-up exited with {proc.returncode}; see {log}")
                if time.monotonic() - start > timeout_s:
                    raise TimeoutError(f"not ready after {timeout_s} s; see {log}")
                time.sleep(0.2)
            ready_s = time.monotonic() - start
            text = _complete(port)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=120)
    return {"ready_s": round(ready_s, 1), "completion": text}


EARLY = {"on": {"EDGE_EARLY_ENGINE": "1"}, "off": {"EDGE_EARLY_ENGINE": "0"}}


def warm(modes: list[str], passes: int, port: int, early: str = "on") -> None:
    import statistics
    import tempfile

    log = Path(tempfile.mkdtemp(prefix="edge-up-times-")) / "edge-up.log"
    for mode in modes:  # fills each mode's compile cache (its environment differs, so does its cache)
        one_run(None, port, log, mode=mode)
    settings = ["on", "off"] if early == "both" else [early]
    variants = [(mode, setting) for mode in modes for setting in settings]
    name = {v: v[0] if early != "both" else f"{v[0]}, early engine {v[1]}" for v in variants}
    runs: dict[str, list[float]] = {name[v]: [] for v in variants}
    for p in range(passes):
        order = variants[p % len(variants) :] + variants[: p % len(variants)]  # who goes first rotates
        for v in order:
            # an early engine takes the environment of the last engine that became ready: with several modes,
            # an unmeasured start of its own mode comes first
            if len(modes) > 1 and v[1] == "on":
                one_run(None, port, log, mode=v[0], env_extra=EARLY["off"])
            runs[name[v]].append(one_run(None, port, log, mode=v[0], env_extra=EARLY[v[1]])["ready_s"])
            print(json.dumps({"pass": p + 1, "variant": name[v], "ready_s": runs[name[v]][-1]}), flush=True)
    sys.path.insert(0, str(REPO))  # run as a script: the repository's own packages
    from edge.device.cpuinfo import host_model_name

    medians = {m: {"median": statistics.median(r), "runs": r} for m, r in runs.items()}
    out = {"cpu": host_model_name(), "log": str(log), "warm_start_s": medians}
    if early == "both":
        out["on_over_off"] = {mode: round(medians[name[(mode, "on")]]["median"]
                                          / medians[name[(mode, "off")]]["median"], 3) for mode in modes}  # fmt: skip
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir", type=Path, nargs="?")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--warm", action="store_true", help="warm starts per serving mode (docstring)")
    parser.add_argument("--modes", default="one-process,two-process,three-process")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--early", choices=["on", "off", "both"], default="on",
                        help="with (on), without (off) or both ways: the early engine (docstring)")  # fmt: skip
    args = parser.parse_args()
    if args.warm:
        warm(args.modes.split(","), args.passes, args.port, args.early)
        return
    if args.workdir is None:
        parser.error("WORKDIR is needed without --warm")
    args.workdir.mkdir(parents=True, exist_ok=False)  # the first run must start from nothing
    log = args.workdir / "edge-up.log"
    first = one_run(args.workdir, args.port, log)
    print(json.dumps({"run": "first", **first}), flush=True)
    second = one_run(args.workdir, args.port, log)
    print(json.dumps({"run": "second", **second}), flush=True)
    print(json.dumps({"second_over_first": round(second["ready_s"] / first["ready_s"], 3)}))


if __name__ == "__main__":
    main()
