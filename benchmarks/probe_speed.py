"""How long learning this host takes: our /proc/cpuinfo parse vs py-cpuinfo's full scan, and probe() with a
cold layout cache (measures the tinygemm block in a subprocess that imports torch), a warm cache, and no
measurement at all; plus a fresh Python process that probes (what `edge-select` pays before planning).

Variants are interleaved round by round so drift on this shared 2-core box hits them alike; medians reported.

    .venv/bin/python benchmarks/probe_speed.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(rounds: int, scratch: Path) -> dict[str, list[float]]:
    import cpuinfo  # py-cpuinfo

    from edge.device import layout_cache
    from edge.device.cpuinfo import cpu_flags, parse_cpuinfo
    from edge.device.probe import probe
    from edge.device.runtime import installed_version

    torch = installed_version("torch")
    warm_dir = scratch / "warm"
    flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    record, reason = layout_cache.measure()
    if record is None or torch is None:
        sys.exit(f"cannot fill the warm cache: {reason or 'torch is not installed'}")
    layout_cache.store(warm_dir / layout_cache.CACHE_FILE, layout_cache.cache_key(torch[1], flags), record)
    warm_env = {"EDGE_SELECT_CACHE_DIR": str(warm_dir)}
    fresh_process = [sys.executable, "-c", "from edge.device.probe import probe; probe()"]

    variants: dict[str, Callable[[], object]] = {
        "parse /proc/cpuinfo (ours)": lambda: parse_cpuinfo(Path("/proc/cpuinfo").read_text()),
        "py-cpuinfo get_cpu_info()": cpuinfo.get_cpu_info,
        "probe(), no layout measurement": lambda: probe(measure_layout=False, env={}),
        "probe(), warm layout cache": lambda: probe(env=warm_env),
        "probe(), cold layout cache": lambda: probe(
            env={"EDGE_SELECT_CACHE_DIR": tempfile.mkdtemp(dir=scratch)}
        ),
        "fresh python: import + probe(), warm": lambda: subprocess.run(
            fresh_process, check=True, env={"EDGE_SELECT_CACHE_DIR": str(warm_dir), "PATH": "/usr/bin:/bin"}
        ),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():  # one warm-up each (page cache, imports)
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(timed(fn))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="probe-speed-") as scratch:
        samples = run(args.rounds, Path(scratch))
    ours = statistics.median(samples["parse /proc/cpuinfo (ours)"])
    print(f"{args.rounds} interleaved rounds, median (min-max), ms; ratio to our /proc/cpuinfo parse")
    for name, values in samples.items():
        median = statistics.median(values)
        print(
            f"  {name:40s} {median * 1e3:10.2f}  ({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})"
            f"  x{median / ours:,.0f}"
        )


if __name__ == "__main__":
    main()
