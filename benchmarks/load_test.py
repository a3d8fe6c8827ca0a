"""Bounded load on loopback: /plan under many concurrent clients, and the engine through the wrapper with more
concurrent streaming completions than max_num_seqs.

    .venv/bin/python -m benchmarks.load_test [--clients 32] [--seconds 60]            # /plan on a planning server
    .venv/bin/python -m benchmarks.load_test --engine http://127.0.0.1:8080 --streams 8  # a running edge-serve

/plan: a real uvicorn process (the planning app), --clients keep-alive clients each posting this host's cpuinfo
in a loop for --seconds; every response that is not 200, and every transport error, counts as an error.
Engine: --streams streaming completions of --tokens tokens at once; each stream's time to first token and to the
end, whether it completed, and how many tokens came. Streams beyond max_num_seqs wait in vLLM's queue, which shows
as a longer time to first token for the later ones. Loopback only; stops by itself.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.plan_latency import free_port, local_device, percentiles, start_server


def plan_load(clients: int, seconds: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}/plan"
    body = {"device": local_device(), "priority": "speed"}
    server = start_server(port)
    stop = time.monotonic() + seconds
    errors: list[str] = []
    lock = threading.Lock()

    def client_loop(_: int) -> list[float]:
        times = []
        with httpx.Client(timeout=60) as client:
            while time.monotonic() < stop:
                start = time.perf_counter()
                try:
                    response = client.post(url, json=body)
                    ok = response.status_code == 200
                    why = f"{response.status_code}"
                except httpx.HTTPError as error:
                    ok, why = False, type(error).__name__
                times.append(time.perf_counter() - start)
                if not ok:
                    with lock:
                        errors.append(why)
        return times

    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            samples = [t for times in pool.map(client_loop, range(clients)) for t in times]
        wall = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(timeout=30)
    return {"clients": clients, "seconds": round(wall, 1), "requests": len(samples), "errors": len(errors),
            "error_kinds": sorted(set(errors)), "req_per_s": round(len(samples) / wall, 1),
            **percentiles(samples)}  # fmt: skip


def engine_load(base: str, streams: int, tokens: int) -> dict:
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    go = threading.Barrier(streams)

    def one(i: int) -> dict:
        go.wait()
        start = time.perf_counter()
        first, chunks, done = None, 0, False
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    first = first or time.perf_counter() - start
                    chunks += 1
        except httpx.HTTPError as error:
            return {"stream": i, "completed": False, "error": type(error).__name__}
        return {"stream": i, "completed": done and chunks >= tokens, "tokens": chunks,
                "ttft_s": round(first or 0, 3), "total_s": round(time.perf_counter() - start, 3)}  # fmt: skip

    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(one, range(streams)))
    ttft = sorted(r["ttft_s"] for r in results if r.get("completed"))
    return {"streams": streams, "tokens_each": tokens, "completed": sum(r.get("completed", False) for r in results),
            "lost": sum(not r.get("completed", False) for r in results), "ttft_s_sorted": ttft,
            "runs": results}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--engine", metavar="URL", help="a running edge-serve: load its engine instead of /plan")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    result = (engine_load(args.engine, args.streams, args.tokens) if args.engine
              else plan_load(args.clients, args.seconds))  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
