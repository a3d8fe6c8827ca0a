"""Two replicas of the fleet planner sharing one real PostgreSQL server (Debian's packages, started here in a
temporary directory on a free loopback port): what one is sent, the other lists and plans from; the same record
sent to both at once is stored once; replicas starting together both create-or-find the table."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from benchmarks.postgres import PostgresMissing, temporary_postgres
from server.app import create_app
from server.calibrations import CalibrationStore, database_url, metadata
from server.settings import Settings
from tests.server.conftest import uvicorn_on_loopback
from tests.server.test_calibrations import SPR, SPR_CPUINFO, ZEN5, ZEN5_CPUINFO, body

pytestmark = pytest.mark.slow  # starts a PostgreSQL server (a few seconds)


def missing(reason: str) -> None:
    """In CI, and wherever scripts/setup would have installed PostgreSQL (Debian, root), a missing server is a
    failure; elsewhere a skip that says why."""
    if os.environ.get("CI") or (Path("/etc/debian_version").exists() and os.geteuid() == 0):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A PostgreSQL server of this module's own (benchmarks/postgres.py); yields its URL."""
    try:
        server = temporary_postgres()
        url = server.__enter__()
    except PostgresMissing as exc:
        missing(str(exc))
    try:
        yield url
    finally:
        server.__exit__(None, None, None)


@pytest.fixture
def database(postgres: str) -> Iterator[str]:
    """The server's URL, with no calibrations table before the test and none left after it."""
    engine = sa.create_engine(database_url(postgres))
    metadata.drop_all(engine)
    try:
        yield postgres
    finally:
        metadata.drop_all(engine)
        engine.dispose()


@pytest.fixture
def replicas(database: str, tmp_path: Path, monkeypatch) -> Iterator[tuple[str, str]]:
    """Two planners on loopback, as behind a load balancer: same database, nothing else shared."""
    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(tmp_path / "cache"))  # no host-cached records
    with (
        uvicorn_on_loopback(create_app(Settings(calibration_db=database))) as first,
        uvicorn_on_loopback(create_app(Settings(calibration_db=database))) as second,
    ):
        yield first, second


def listed(url: str) -> list[str]:
    response = httpx.get(f"{url}/calibrations", timeout=30)
    assert response.status_code == 200, response.text
    return [summary["digest"] for summary in response.json()]


def calibration(url: str, cpuinfo: str) -> dict | None:
    response = httpx.post(f"{url}/plan", json={"device": {"cpuinfo": cpuinfo}}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["calibration"]


def test_a_record_posted_to_one_replica_is_listed_by_the_other_and_changes_its_plan(replicas):
    first, second = replicas
    assert calibration(second, ZEN5_CPUINFO) is None
    assert httpx.post(f"{first}/calibrations", json=body(ZEN5), timeout=30).status_code == 201
    assert listed(second) == [ZEN5.digest]
    assert calibration(second, ZEN5_CPUINFO)["digest"] == ZEN5.digest
    assert calibration(second, SPR_CPUINFO) is None


def test_the_same_record_posted_to_both_replicas_at_once_is_stored_once(replicas):
    first, second = replicas
    targets = [first, second] * 4
    together = threading.Barrier(len(targets))

    def post(url: str) -> int:
        with httpx.Client(timeout=60) as client:
            together.wait()
            return client.post(f"{url}/calibrations", json=body(SPR)).status_code

    with ThreadPoolExecutor(len(targets)) as pool:
        statuses = list(pool.map(post, targets))
    assert sorted(statuses) == [200] * (len(targets) - 1) + [201]
    assert listed(first) == listed(second) == [SPR.digest]


def test_replicas_starting_together_both_find_or_create_the_table(database):
    stores = [CalibrationStore(database) for _ in range(4)]
    together = threading.Barrier(len(stores))

    def start(store: CalibrationStore) -> list[str]:
        together.wait()
        store.open()
        return [summary.digest for summary in store.summaries()]

    try:
        with ThreadPoolExecutor(len(stores)) as pool:
            assert list(pool.map(start, stores)) == [[]] * len(stores)
    finally:
        for store in stores:
            store.close()


def test_boxes_reporting_through_two_replicas_under_load_lose_nothing_and_duplicate_nothing():
    """benchmarks/fleet_load.py at a small scale: two replica processes on a PostgreSQL of their own, 60 boxes of 3
    CPU models (so each key passes its bound of KEEP_PER_KEY), every tenth posting to both replicas at once."""
    from benchmarks.fleet_load import main as fleet_load

    try:
        result = fleet_load(["--clients", "8", "--boxes", "60", "--cpu-models", "3", "--seconds", "2"])
    except PostgresMissing as exc:
        missing(str(exc))
    boxes, store, plans = result["boxes_report"], result["store"], result["plans"]
    assert boxes["posts"] == 66 and boxes["errors"] == 0, boxes
    assert store["expected"] == 3 * store["bound"] and store["rows"] == store["expected"], store
    assert store["lost"] == store["unexpected"] == store["duplicated"] == 0, store
    assert store["most_per_key"] == store["bound"] and store["most_per_key_during"] <= store["bound"], store
    assert plans["errors"] == 0 and plans["requests"] >= 8, plans
    assert plans["ranked_from_a_stored_record"] == plans["requests"]  # every plan read the store and used it
