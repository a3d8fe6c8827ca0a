"""/plan latency and throughput on loopback: one device per request, and POST /plan/batch with 100 devices.

The server is a real uvicorn process (planning-only app, access log off); the client is this process (httpx,
keep-alive). Single and batch requests are interleaved round by round so both see the same machine state.
Bounded: --rounds rounds of --singles single requests and one batch each, after a warm-up; then a concurrent
phase (--threads clients, --concurrent requests in all) for throughput under load.

  .venv/bin/python benchmarks/plan_latency.py [--rounds 30] [--singles 10] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

BATCH_SIZE = 100


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_device() -> dict:
    """This host as its /proc/cpuinfo and /proc/meminfo text: what fleet tooling would send about a box."""
    return {"cpuinfo": Path("/proc/cpuinfo").read_text(), "meminfo": Path("/proc/meminfo").read_text()}


def fleet(n: int) -> list[dict]:
    """n hand-written device descriptions across ISA classes, core counts and memory sizes (deterministic)."""
    isas = [
        ("x86_64", ["avx2", "fma", "f16c"]),
        ("x86_64", ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni"]),
        ("x86_64", ["avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]),
        ("aarch64", ["asimd", "asimddp", "sve", "i8mm", "bf16"]),
    ]
    devices = []
    for i in range(n):
        arch, isa = isas[i % len(isas)]
        profile = {"name": f"box-{i}", "arch": arch, "isa": isa, "cores": 2 << (i % 4), "memory": f"{4 << (i % 5)}GiB"}
        devices.append({"profile": profile})
    return devices


def percentiles(samples_s: list[float]) -> dict:
    ordered = sorted(samples_s)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {
        "n": len(ordered),
        "p50_ms": round(1e3 * statistics.median(ordered), 3),
        "p90_ms": round(1e3 * at(0.90), 3),
        "p99_ms": round(1e3 * at(0.99), 3),
        "max_ms": round(1e3 * ordered[-1], 3),
        "mean_ms": round(1e3 * statistics.fmean(ordered), 3),
    }


def timed_post(client: httpx.Client, url: str, body: dict) -> float:
    start = time.perf_counter()
    response = client.post(url, json=body)
    elapsed = time.perf_counter() - start
    assert response.status_code == 200, f"{url}: {response.status_code} {response.text[:300]}"
    return elapsed


def start_server(port: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The planning app in a uvicorn process of its own on loopback, with `env` added to this environment."""
    argv = [sys.executable, "-m", "uvicorn", "--factory", "server.app:create_app", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", "--no-access-log"]  # fmt: skip
    server = subprocess.Popen(argv, cwd=Path(__file__).parents[1], env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise SystemExit("the server did not start")
        time.sleep(0.1)


def run(args: argparse.Namespace) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    single_body = {"device": local_device(), "priority": "speed"}
    batch_body = {"devices": fleet(BATCH_SIZE), "priority": "speed"}
    server = start_server(port)
    try:
        with httpx.Client(timeout=120) as client:
            batch = client.post(f"{base}/plan/batch", json=batch_body).json()
            assert batch["planned"] == BATCH_SIZE, f"batch planned {batch['planned']}/{BATCH_SIZE}"
            for _ in range(args.warmup):
                timed_post(client, f"{base}/plan", single_body)
            timed_post(client, f"{base}/plan/batch", batch_body)
            singles, batches = [], []
            for _ in range(args.rounds):
                singles += [timed_post(client, f"{base}/plan", single_body) for _ in range(args.singles)]
                batches.append(timed_post(client, f"{base}/plan/batch", batch_body))

        def client_loop(requests: int) -> list[float]:  # one keep-alive client per thread
            with httpx.Client(timeout=120) as client:
                return [timed_post(client, f"{base}/plan", single_body) for _ in range(requests)]

        shares = [args.concurrent // args.threads] * args.threads
        start = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            concurrent = [t for times in pool.map(client_loop, shares) for t in times]
        wall = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=30)
    single_stats, batch_stats = percentiles(singles), percentiles(batches)
    return {
        "single_device": {**single_stats, "sequential_req_per_s": round(1e3 / single_stats["mean_ms"], 1)},
        "batch_100": {
            **batch_stats,
            "devices_per_s": round(BATCH_SIZE * 1e3 / batch_stats["p50_ms"], 1),
            "ms_per_device": round(batch_stats["p50_ms"] / BATCH_SIZE, 3),
        },
        "concurrent_single": {
            "threads": args.threads,
            "requests": len(concurrent),
            "wall_s": round(wall, 3),
            "req_per_s": round(len(concurrent) / wall, 1),
            **percentiles(concurrent),
        },
        "setup": {
            "rounds": args.rounds,
            "singles_per_round": args.singles,
            "warmup": args.warmup,
            "response_bytes_single": len(json.dumps(batch["results"][0]["plan"])),
        },  # fmt: skip
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--singles", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--concurrent", type=int, default=200)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = run(args)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
