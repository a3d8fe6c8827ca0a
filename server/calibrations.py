"""The fleet's calibration records (edge.device.calibration): what boxes posted to `POST /calibrations`, kept so that
`/plan` for a device of the same CPU ranks from its measured kernel times instead of the facts table.

SQLite in the cache directory by default (one API process); PostgreSQL given a URL (EDGE_CALIBRATION_DB,
`edge-serve --calibration-db`), so that replicas behind a load balancer share what any of them was sent.
A record is stored once, by its digest: posting it again, to any replica, at the same time or not, is a no-op.
Each record names the role of the token that posted it (`posted_by`); only the newest KEEP_PER_KEY records of a
key (same CPU, flags, torch, vLLM, native library) are kept, so that no key grows without bound.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
from pydantic import ValidationError
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

from edge.device.calibration import CalibrationRecord, measured_time
from edge.errors import InputError
from edge.paths import cache_dir
from server.schemas import CalibrationSummary
from server.store_error import StoreUnavailable

log = logging.getLogger(__name__)

SQLITE_FILE = "calibrations.sqlite"
KEEP_PER_KEY = 8  # records kept per key: the newest decides a plan; a few older ones show how it moved
URL_EXAMPLE = "postgresql://user:password@host:5432/database or sqlite:////path/to/calibrations.sqlite"

metadata = sa.MetaData()
calibrations = sa.Table(
    "calibrations",
    metadata,
    sa.Column("digest", sa.String(64), primary_key=True),  # CalibrationRecord.digest: this exact record
    sa.Column("key", sa.String(64), nullable=False, index=True),  # CPU, torch, vLLM, native library
    sa.Column("cpu_model", sa.Text, nullable=False, index=True),  # stripped, as edge.device.calibration's matches
    sa.Column("isa_flags", sa.JSON, nullable=False),
    sa.Column("model", sa.Text, nullable=True),
    sa.Column("measured_at", sa.String(64), nullable=False),  # ISO 8601, as the record states it
    sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("record", sa.Text, nullable=False),  # record.model_dump_json(): the digest is of exactly this text
    sa.Column("posted_by", sa.String(16), nullable=True),  # the token's role ("api", "report"); null: stored before
)


def _redacted(url: str) -> str:
    return re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", url)


def database_url(url: str | None = None) -> sa.URL:
    """The store's SQLAlchemy URL: `url` (PostgreSQL through psycopg 3), or SQLite in the cache directory."""
    if not url:
        path = cache_dir() / SQLITE_FILE
        return sa.URL.create("sqlite", database=str(path))
    try:
        parsed = sa.make_url(url)
    except ArgumentError:
        raise InputError("calibration_db", _redacted(url), f"a database URL such as {URL_EXAMPLE}") from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")  # SQLAlchemy's default PostgreSQL driver is psycopg2
    if parsed.get_backend_name() not in ("postgresql", "sqlite"):
        raise InputError("calibration_db", _redacted(url), f"a PostgreSQL or SQLite URL such as {URL_EXAMPLE}")
    return parsed



def _dialect_insert(backend: str):
    """The backend's INSERT, which takes ON CONFLICT DO NOTHING (PostgreSQL and SQLite, the two stores served)."""
    return postgresql.insert if backend == "postgresql" else sqlite.insert

class CalibrationStore:
    """Insert-if-absent and read; the table is created on first use (and by `open()`, on the app's start)."""

    def __init__(self, url: str | None = None) -> None:
        self.url = database_url(url)
        if self.url.get_backend_name() == "sqlite" and self.url.database:
            Path(self.url.database).parent.mkdir(parents=True, exist_ok=True)
        try:
            # pre-ping: a replica outlives a database restart without failing its next request
            self.engine = sa.create_engine(self.url, pool_pre_ping=True)
        except (ArgumentError, NoSuchModuleError) as err:
            raise InputError("calibration_db", self.url.render_as_string(hide_password=True), str(err)) from None
        self._created = False
        self._lock = threading.Lock()

    def describe(self) -> str:
        return self.url.render_as_string(hide_password=True)

    def open(self) -> None:
        """Create the table if it is not there. Replicas starting together may race to create it: the loser's
        CREATE fails on PostgreSQL's catalog, and the table is then there."""
        with self._lock:
            if self._created:
                return
            try:
                metadata.create_all(self.engine, checkfirst=True)
            except SQLAlchemyError as err:
                if not self._has_table():
                    raise StoreUnavailable(f"calibration store {self.describe()}: {err.__class__.__name__}: "
                                           f"{str(err).splitlines()[0]}") from err  # fmt: skip
            self._add_posted_by()
            self._created = True

    def _has_table(self) -> bool:
        try:
            return sa.inspect(self.engine).has_table(calibrations.name)
        except SQLAlchemyError:
            return False

    def _columns(self) -> set[str]:
        return {column["name"] for column in sa.inspect(self.engine).get_columns(calibrations.name)}

    def _add_posted_by(self) -> None:
        """A table created before records named their poster gets the column (null for the rows it has). Replicas
        may race to add it: the loser's ALTER fails, and the column is then there."""
        try:
            if "posted_by" in self._columns():
                return
            with self.engine.begin() as connection:
                connection.execute(sa.text(f"ALTER TABLE {calibrations.name} ADD COLUMN posted_by VARCHAR(16)"))
        except SQLAlchemyError as err:
            if "posted_by" not in self._columns():
                raise self._unavailable(err) from err

    def close(self) -> None:
        self.engine.dispose()

    def add(self, record: CalibrationRecord, posted_by: str = "api") -> bool:
        """Store the record, then drop its key's records past the newest KEEP_PER_KEY; False when a record with its
        digest was already there, or when it is older than the newest KEEP_PER_KEY of its key (not kept)."""
        self.open()
        row = dict(
            digest=record.digest, key=record.key, cpu_model=record.cpu_model.strip(), isa_flags=record.isa_flags,
            model=record.model, measured_at=record.measured_at, received_at=datetime.now(UTC),
            record=record.model_dump_json(), posted_by=posted_by,
        )  # fmt: skip
        try:
            with self.engine.begin() as connection:
                self._lock_key(connection, record.key)
                # Another request (here or on another replica) may have stored it first: the copy is not inserted.
                # Catching the primary key's refusal instead and then looking the digest up failed where a third
                # add of the key had meanwhile dropped the record as past the bound (a 500, benchmarks/fleet_load.py
                # in CI, 2026-12-07).
                insert = _dialect_insert(self.url.get_backend_name())(calibrations).values(**row)
                insert = insert.on_conflict_do_nothing(index_elements=["digest"]).returning(calibrations.c.digest)
                if connection.execute(insert).first() is None:  # (rowcount: -1 for this statement on psycopg)
                    return False
                dropped = self._drop_older(connection, record.key)
            return record.digest not in dropped
        except SQLAlchemyError as err:
            raise self._unavailable(err) from err

    def _lock_key(self, connection: sa.Connection, key: str) -> None:
        """Adds of one key one at a time, until this transaction ends: two replicas adding to a key at once each
        counted the key's rows without the other's uncommitted insert, and both kept KEEP_PER_KEY, leaving one more
        (seen: 9 of 8, benchmarks/fleet_load.py). PostgreSQL: a transaction-scoped advisory lock on the key's hash.
        SQLite: its single writer already serializes them."""
        if self.url.get_backend_name() == "postgresql":
            connection.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtext(key))))

    def _drop_older(self, connection: sa.Connection, key: str) -> set[str]:
        """Delete the key's records past the newest KEEP_PER_KEY (by measurement time, then arrival); their
        digests. Ordered here, not in SQL: measured_at is ISO 8601 text in whatever offset the box wrote."""
        c = calibrations.c
        rows = connection.execute(sa.select(c.digest, c.measured_at, c.received_at).where(c.key == key)).all()
        if len(rows) <= KEEP_PER_KEY:
            return set()
        rows.sort(key=lambda row: (_measured(row.measured_at), _utc_time(row.received_at), row.digest), reverse=True)
        dropped = {row.digest for row in rows[KEEP_PER_KEY:]}
        connection.execute(sa.delete(calibrations).where(c.digest.in_(sorted(dropped))))
        return dropped

    def delete(self, digest: str) -> bool:
        """Remove the record with this digest; False when there was none."""
        self.open()
        try:
            with self.engine.begin() as connection:
                return connection.execute(sa.delete(calibrations).where(calibrations.c.digest == digest)).rowcount > 0
        except SQLAlchemyError as err:
            raise self._unavailable(err) from err

    def summaries(self, cpu_model: str | None = None, limit: int = 100, offset: int = 0) -> list[CalibrationSummary]:
        """What is stored, newest measurement first, `limit` of them from `offset`; only this CPU model's when one
        is named."""
        self.open()
        c = calibrations.c
        query = sa.select(c.digest, c.key, c.cpu_model, c.isa_flags, c.model, c.measured_at, c.received_at,
                          c.posted_by)  # fmt: skip
        if cpu_model is not None:
            query = query.where(c.cpu_model == cpu_model.strip())
        query = query.order_by(c.measured_at.desc(), c.digest).limit(limit).offset(offset)
        return [CalibrationSummary.model_validate(_utc(row._asdict())) for row in self._fetch(query)]

    def records(self, cpu_models: Iterable[str]) -> list[CalibrationRecord]:
        """The stored records of these CPU models (the devices of one request); unreadable ones are skipped."""
        wanted = sorted({model.strip() for model in cpu_models})
        if not wanted:
            return []
        self.open()
        query = sa.select(calibrations.c.digest, calibrations.c.record).where(calibrations.c.cpu_model.in_(wanted))
        records = []
        for digest, text in self._fetch(query):
            try:
                records.append(CalibrationRecord.model_validate_json(text))
            except ValidationError as err:  # e.g. stored by a newer schema than this process reads
                log.warning("calibration %s skipped: not a record this server reads (%s)", digest, err.errors()[0])
        return newest_per_key(records)

    def _fetch(self, query) -> list[sa.Row]:
        try:
            with self.engine.connect() as connection:
                return list(connection.execute(query))
        except SQLAlchemyError as err:
            raise self._unavailable(err) from err

    def _unavailable(self, err: SQLAlchemyError) -> StoreUnavailable:
        first = str(err.orig if getattr(err, "orig", None) is not None else err).splitlines()[0]
        return StoreUnavailable(f"calibration store {self.describe()}: {first}")


def newest_per_key(records: Iterable[CalibrationRecord], keep: int = KEEP_PER_KEY) -> list[CalibrationRecord]:
    """The newest `keep` records of each key (a store written before the cap may hold more)."""
    by_key: dict[str, list[CalibrationRecord]] = {}
    for record in records:
        by_key.setdefault(record.key, []).append(record)
    return [r for group in by_key.values() for r in sorted(group, key=lambda r: r.measured_time, reverse=True)[:keep]]


def _measured(text: str) -> datetime:
    try:
        return measured_time(text)
    except ValueError:  # stored before measured_at was checked: older than any real record
        return datetime.min.replace(tzinfo=UTC)


def _utc_time(when: datetime) -> datetime:
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when


def _utc(row: dict) -> dict:
    """SQLite keeps no time zone: what this store writes is UTC."""
    received = row["received_at"]
    return {**row, "received_at": received.replace(tzinfo=UTC) if received.tzinfo is None else received}
