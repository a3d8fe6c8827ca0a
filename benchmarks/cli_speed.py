"""Wall time of `edge-select` on this host against the floors it cannot beat (interpreter, pydantic import).

Interleaved rounds, medians and ratios. The layout cache is warmed first (the first probe on a host measures
the tinygemm block with torch in a subprocess, once).

    .venv/bin/python -m benchmarks.cli_speed [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
VARIANTS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "import pydantic": [sys.executable, "-c", "import pydantic"],
    "edge-select (text)": [str(BIN / "edge-select")],
    "edge-select --json": [str(BIN / "edge-select"), "--json"],
}


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    rounds = parser.parse_args().rounds
    wall(VARIANTS["edge-select --json"])  # warms the layout cache
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, cmd in VARIANTS.items():
            times[name].append(wall(cmd))
    floor = statistics.median(times["python -c pass"])
    print(f"{'variant':24} {'median s':>9} {'min s':>7} {'x python':>9}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:24} {median:9.3f} {min(values):7.3f} {median / floor:9.1f}")


if __name__ == "__main__":
    main()
