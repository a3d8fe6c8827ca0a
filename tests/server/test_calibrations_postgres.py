"""Two replicas of the fleet planner sharing one real PostgreSQL server (Debian's packages, started here in a
temporary directory on a free loopback port): what one is sent, the other lists and plans from; the same record
sent to both at once is stored once; replicas starting together both create-or-find the table."""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from server.app import create_app
from server.calibrations import CalibrationStore, database_url, metadata
from server.settings import Settings
from tests.server.conftest import free_port, uvicorn_on_loopback
from tests.server.test_calibrations import SPR, SPR_CPUINFO, ZEN5, ZEN5_CPUINFO, body

pytestmark = pytest.mark.slow  # starts a PostgreSQL server (a few seconds)

SETUP_HINT = "scripts/setup installs them on Debian/Ubuntu when run as root (apt-get install postgresql)"


def postgres_bindir() -> Path | None:
    """Debian's /usr/lib/postgresql/<major>/bin (the newest), else wherever PATH has pg_ctl."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    pg_ctl = shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl and (Path(pg_ctl).parent / "initdb").exists() else None


def missing(reason: str) -> None:
    """In CI, and wherever scripts/setup would have installed PostgreSQL (Debian, root), a missing server is a
    failure; elsewhere a skip that says why."""
    if os.environ.get("CI") or (Path("/etc/debian_version").exists() and os.geteuid() == 0):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}: {done.stdout}{done.stderr}"


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A PostgreSQL server of this module's own; yields its URL. It refuses to run as root: as root, it runs as
    the `postgres` user, in a directory owned by it."""
    bindir = postgres_bindir()
    if bindir is None:
        missing(f"PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql/*/bin or on "
                f"PATH; {SETUP_HINT}")  # fmt: skip
    as_root = os.geteuid() == 0
    if as_root and shutil.which("runuser") is None:
        missing("running as root, and runuser (util-linux) is missing: PostgreSQL cannot run as root")
    as_postgres = ["runuser", "-u", "postgres", "--"] if as_root else []
    workdir = Path(tempfile.mkdtemp(prefix="edge-select-postgres-"))
    password = secrets.token_hex(16)
    (workdir / "password").write_text(password)
    if as_root:
        for path in (workdir, workdir / "password"):
            shutil.chown(path, "postgres", "postgres")
    data, port = workdir / "data", free_port()
    try:
        run([*as_postgres, str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-E", "UTF8",
             "--auth=scram-sha-256", f"--pwfile={workdir / 'password'}", "--no-sync"])  # fmt: skip
        # loopback only, and the socket in our own directory (the packaged /var/run/postgresql may not exist)
        options = f"-h 127.0.0.1 -p {port} -k {workdir} -c fsync=off"
        run([*as_postgres, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(workdir / "server.log"), "-w",
             "-t", "60", "-o", options, "start"])  # fmt: skip
        try:
            yield f"postgresql://postgres:{password}@127.0.0.1:{port}/postgres"
        finally:
            run([*as_postgres, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


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
