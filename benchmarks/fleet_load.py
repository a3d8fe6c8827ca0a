"""The fleet side under load (issue 46): two planner replicas, each its own uvicorn process, sharing one real
PostgreSQL server (benchmarks/postgres.py), as behind a load balancer. Loopback only; stops by itself.

    .venv/bin/python -m benchmarks.fleet_load [--clients 50] [--boxes 1000] [--cpu-models 20] [--seconds 30]
                                               [--json FILE]

1. Boxes report: --boxes boxes of --cpu-models CPU models each POST /calibrations their record, --clients at a
   time, to one replica or the other; a tenth of them post it again to the other replica at the same moment (a box
   retrying through the load balancer). Then the store is read straight from PostgreSQL: every record must be
   there that the store's bound keeps (the newest KEEP_PER_KEY of each key, server/calibrations.py), none twice,
   and no key past its bound, then or at any of the reads a watcher made while the boxes reported.
2. Plans: --clients keep-alive clients POST /plan for --seconds, alternating replicas, each a device of one of the
   reported CPU models (so every plan reads the store); requests per second, p50 and p99.
Every response that is not the expected status, and every transport error, is counted as an error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import sqlalchemy as sa

from benchmarks.host import cpu_model_name
from benchmarks.plan_latency import free_port, percentiles, start_server
from benchmarks.postgres import temporary_postgres
from edge.device.calibration import CalibrationRecord, KernelResult, KernelTime
from edge.device.cpuinfo import parse_cpuinfo
from server.calibrations import KEEP_PER_KEY, calibrations, database_url, newest_per_key

ROOT = Path(__file__).parents[1]
SHAPES = [(576, 576), (1536, 576), (576, 1536)]  # the default model's linear shapes (N, K)


def box_records(boxes: int, cpu_models: int) -> list[CalibrationRecord]:
    """One record per box: this host's ISA flags under `cpu_models` model names, each measured at its own minute."""
    host = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    start = datetime(2026, 12, 1, tzinfo=UTC)
    records = []
    for box in range(boxes):
        per_mac_ns = 0.3 + 0.001 * box
        times = [KernelTime(n=n, k=k, m=m, ms=per_mac_ns * n * k * (1 if m == 1 else 40) / 1e6, calls=20)
                 for n, k in SHAPES for m in (1, 512)]  # fmt: skip
        records.append(CalibrationRecord(
            cpu_model=f"Fleet CPU {box % cpu_models:02d}", isa_flags=host.isa.value, isa_class="fleet", cores=2,
            threads=2, torch_version="2.13.0+cpu", vllm_version="0.28.0", native_library="_C", group_size=64,
            kernels=[KernelResult(kernel="tinygemm", status="ok", times=times)],
            measured_at=(start + timedelta(minutes=box)).isoformat(), duration_s=41.0))  # fmt: skip
    return records


def replica(port: int, database: str, cache: Path) -> subprocess.Popen:
    return start_server(port, {"EDGE_CALIBRATION_DB": database, "EDGE_SELECT_CACHE_DIR": str(cache)})


class BoundWatch:
    """The most records any key held, read from PostgreSQL every few milliseconds while the boxes report: the
    store's bound must hold all along, not only once the last add has pruned."""

    def __init__(self, database: str) -> None:
        self.engine = sa.create_engine(database_url(database))
        self.peak = 0
        self.reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BoundWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.engine.dispose()

    def _run(self) -> None:
        query = sa.select(sa.func.count()).select_from(calibrations).group_by(calibrations.c.key)
        while not self._stop.is_set():
            try:
                with self.engine.connect() as connection:
                    counts = connection.execute(query).scalars().all()
            except sa.exc.ProgrammingError:  # no table yet
                counts = []
            self.peak = max([self.peak, *counts])
            self.reads += 1
            self._stop.wait(0.005)


def report_boxes(urls: list[str], records: list[CalibrationRecord], clients: int) -> dict:
    """Every box posts its record; every tenth posts it to both replicas at once."""
    local = threading.local()
    times: list[float] = []
    statuses: dict[str, int] = {}
    lock = threading.Lock()

    def post(url: str, body: dict) -> None:
        client = getattr(local, "client", None) or httpx.Client(timeout=60)
        local.client = client
        started = time.perf_counter()
        try:
            outcome = str(client.post(f"{url}/calibrations", json=body).status_code)
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        with lock:
            times.append(time.perf_counter() - started)
            statuses[outcome] = statuses.get(outcome, 0) + 1

    def box(index: int) -> None:
        body = json.loads(records[index].model_dump_json())
        if index % 10 == 0:  # the same record to both replicas at once
            with ThreadPoolExecutor(2) as both:
                list(both.map(lambda url: post(url, body), urls))
        else:
            post(urls[index % len(urls)], body)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(box, range(len(records))))
    wall = time.perf_counter() - started
    posts = sum(statuses.values())
    return {"boxes": len(records), "posts": posts, "seconds": round(wall, 2), "req_per_s": round(posts / wall, 1),
            "statuses": statuses, "errors": posts - statuses.get("201", 0) - statuses.get("200", 0),
            **percentiles(times)}  # fmt: skip


def check_store(database: str, records: list[CalibrationRecord]) -> dict:
    """What PostgreSQL holds against what the store's bound keeps of what the boxes sent."""
    engine = sa.create_engine(database_url(database))
    try:
        with engine.connect() as connection:
            rows = connection.execute(sa.select(calibrations.c.digest, calibrations.c.key)).all()
    finally:
        engine.dispose()
    stored = [row.digest for row in rows]
    per_key: dict[str, int] = {}
    for row in rows:
        per_key[row.key] = per_key.get(row.key, 0) + 1
    expected = {record.digest for record in newest_per_key(records)}
    return {"rows": len(stored), "expected": len(expected), "lost": len(expected - set(stored)),
            "unexpected": len(set(stored) - expected), "duplicated": len(stored) - len(set(stored)),
            "keys": len(per_key), "most_per_key": max(per_key.values(), default=0), "bound": KEEP_PER_KEY}  # fmt: skip


def plan_load(urls: list[str], cpu_models: int, clients: int, seconds: float) -> dict:
    host = Path("/proc/cpuinfo").read_text()
    first_model = next(line for line in host.splitlines() if line.startswith("model name")).split(":", 1)[1].strip()
    stop = time.monotonic() + seconds
    errors: list[str] = []
    lock = threading.Lock()
    calibrated = [0]

    def client_loop(index: int) -> list[float]:
        url = urls[index % len(urls)]
        cpuinfo = host.replace(first_model, f"Fleet CPU {index % cpu_models:02d}")  # a reported CPU model
        body = {"device": {"cpuinfo": cpuinfo}, "priority": "speed"}
        samples = []
        with httpx.Client(timeout=60) as client:
            while time.monotonic() < stop:
                started = time.perf_counter()
                try:
                    response = client.post(f"{url}/plan", json=body)
                    why = None if response.status_code == 200 else str(response.status_code)
                    ranked = why is None and response.json().get("calibration") is not None
                except httpx.HTTPError as exc:
                    why, ranked = type(exc).__name__, False
                samples.append(time.perf_counter() - started)
                with lock:
                    calibrated[0] += ranked
                    if why:
                        errors.append(why)
        return samples

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        samples = [t for times in pool.map(client_loop, range(clients)) for t in times]
    wall = time.perf_counter() - started
    return {"clients": clients, "seconds": round(wall, 1), "requests": len(samples), "errors": len(errors),
            "error_kinds": sorted(set(errors)), "ranked_from_a_stored_record": calibrated[0],
            "req_per_s": round(len(samples) / wall, 1), **percentiles(samples)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--boxes", type=int, default=1000)
    parser.add_argument("--cpu-models", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    records = box_records(args.boxes, args.cpu_models)
    with temporary_postgres(max_connections=200) as database, tempfile.TemporaryDirectory() as cache:
        ports = [free_port(), free_port()]
        servers = [replica(port, database, Path(cache) / str(port)) for port in ports]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        try:
            with BoundWatch(database) as watch:
                boxes = report_boxes(urls, records, args.clients)
            store = {**check_store(database, records), "most_per_key_during": watch.peak, "bound_reads": watch.reads}
            plans = plan_load(urls, args.cpu_models, args.clients, args.seconds)
        finally:
            for server in servers:
                server.terminate()
                server.wait(timeout=30)
    result = {"command": "python -m benchmarks.fleet_load " + " ".join(argv if argv is not None else sys.argv[1:]),
              "cpu": cpu_model_name(),
              "replicas": 2, "boxes_report": boxes, "store": store, "plans": plans}  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
