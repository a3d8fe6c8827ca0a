"""The launcher's first and second run on this box: wall time from `deploy/edge-up` to a ready engine.

The first run starts from nothing (a new virtual environment and an empty cache directory, both under WORKDIR);
the second reuses both, as an operator's second start would. Each run is stopped (SIGTERM to its process group)
once `/readyz` answers 200 and one completion came back through the wrapper.

    python3 benchmarks/edge_up_times.py WORKDIR [--port 8090]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
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


def one_run(workdir: Path, port: int, log: Path, timeout_s: float = 3600) -> dict:
    env = {**os.environ, "EDGE_VENV": str(workdir / "venv"), "EDGE_SELECT_CACHE_DIR": str(workdir / "cache")}
    start = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen([str(REPO / "deploy" / "edge-up"), "--port", str(port)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while not _ready(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"edge-up exited with {proc.returncode}; see {log}")
                if time.monotonic() - start > timeout_s:
                    raise TimeoutError(f"not ready after {timeout_s} s; see {log}")
                time.sleep(2)
            ready_s = time.monotonic() - start
            text = _complete(port)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=120)
    return {"ready_s": round(ready_s, 1), "completion": text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--port", type=int, default=8090)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=False)  # the first run must start from nothing
    log = args.workdir / "edge-up.log"
    first = one_run(args.workdir, args.port, log)
    print(json.dumps({"run": "first", **first}), flush=True)
    second = one_run(args.workdir, args.port, log)
    print(json.dumps({"run": "second", **second}), flush=True)
    print(json.dumps({"second_over_first": round(second["ready_s"] / first["ready_s"], 3)}))


if __name__ == "__main__":
    main()
