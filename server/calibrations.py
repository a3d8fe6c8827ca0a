"""The fleet's calibration records (edge.calibration): what boxes posted to `POST /calibrations`, kept so that
`/plan` for a device of the same CPU ranks from its measured kernel times instead of the facts table.

SQLite in the cache directory by default (one API process); PostgreSQL given a URL (EDGE_CALIBRATION_DB,
`edge-serve --calibration-db`), so that replicas behind a load balancer share what any of them was sent.
A record is stored once, by its digest: posting it again, to any replica, at the same time or not, is a no-op.
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
from sqlalchemy.exc import ArgumentError, IntegrityError, NoSuchModuleError, SQLAlchemyError

from edge.calibration import CalibrationRecord
from edge.errors import InputError
from edge.paths import cache_dir
from server.schemas import CalibrationSummary

log = logging.getLogger(__name__)

SQLITE_FILE = "calibrations.sqlite"
URL_EXAMPLE = "postgresql://user:password@host:5432/database or sqlite:////path/to/calibrations.sqlite"

metadata = sa.MetaData()
calibrations = sa.Table(
    "calibrations",
    metadata,
    sa.Column("digest", sa.String(64), primary_key=True),  # CalibrationRecord.digest: this exact record
    sa.Column("key", sa.String(64), nullable=False, index=True),  # CPU, torch, vLLM, native library
    sa.Column("cpu_model", sa.Text, nullable=False, index=True),  # stripped, as edge.calibration.matches compares
    sa.Column("isa_flags", sa.JSON, nullable=False),
    sa.Column("model", sa.Text, nullable=True),
    sa.Column("measured_at", sa.String(64), nullable=False),  # ISO 8601, as the record states it
    sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("record", sa.Text, nullable=False),  # record.model_dump_json(): the digest is of exactly this text
)


class StoreUnavailable(RuntimeError):
    """The database could not be reached or refused a query (the API answers 503)."""


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
            self._created = True

    def _has_table(self) -> bool:
        try:
            return sa.inspect(self.engine).has_table(calibrations.name)
        except SQLAlchemyError:
            return False

    def close(self) -> None:
        self.engine.dispose()

    def add(self, record: CalibrationRecord) -> bool:
        """Store the record; False when a record with its digest was already there."""
        self.open()
        row = dict(
            digest=record.digest, key=record.key, cpu_model=record.cpu_model.strip(), isa_flags=record.isa_flags,
            model=record.model, measured_at=record.measured_at, received_at=datetime.now(UTC),
            record=record.model_dump_json(),
        )  # fmt: skip
        try:
            with self.engine.begin() as connection:
                connection.execute(sa.insert(calibrations).values(**row))
            return True
        except IntegrityError:
            # Another request (here or on another replica) stored it first: the primary key refused the copy.
            if self._stored(record.digest):
                return False
            raise
        except SQLAlchemyError as err:
            raise self._unavailable(err) from err

    def _stored(self, digest: str) -> bool:
        query = sa.select(calibrations.c.digest).where(calibrations.c.digest == digest)
        with self.engine.connect() as connection:
            return connection.execute(query).first() is not None

    def summaries(self, cpu_model: str | None = None) -> list[CalibrationSummary]:
        """What is stored, newest measurement first; only this CPU model's when one is named."""
        self.open()
        c = calibrations.c
        query = sa.select(c.digest, c.key, c.cpu_model, c.isa_flags, c.model, c.measured_at, c.received_at)
        if cpu_model is not None:
            query = query.where(c.cpu_model == cpu_model.strip())
        query = query.order_by(c.measured_at.desc(), c.digest)
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
        return records

    def _fetch(self, query) -> list[sa.Row]:
        try:
            with self.engine.connect() as connection:
                return list(connection.execute(query))
        except SQLAlchemyError as err:
            raise self._unavailable(err) from err

    def _unavailable(self, err: SQLAlchemyError) -> StoreUnavailable:
        first = str(err.orig if getattr(err, "orig", None) is not None else err).splitlines()[0]
        return StoreUnavailable(f"calibration store {self.describe()}: {first}")


def _utc(row: dict) -> dict:
    """SQLite keeps no time zone: what this store writes is UTC."""
    received = row["received_at"]
    return {**row, "received_at": received.replace(tzinfo=UTC) if received.tzinfo is None else received}
