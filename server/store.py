"""The calibration store as the API holds it: server.calibrations.CalibrationStore, built on first use.

SQLAlchemy is 10.5 MiB of RssAnon once imported (measured 2026-12-07, Zen 5: `import sqlalchemy` in the project's
venv), and an edge box's wrapper that never serves /calibrations or /plan has no use for it (issue 44: the wrapper's
own share). So the store, and SQLAlchemy with it, is built when a request first needs it. A database named
(`EDGE_CALIBRATION_DB`: a fleet planner) is built and opened at start, so that a bad URL or an unreachable server
is found then; the default, SQLite in the cache directory, waits for its first use.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.calibrations import CalibrationStore


class LazyCalibrationStore:
    """CalibrationStore's interface; the store itself is made on first use (at once when a database is named)."""

    def __init__(self, url: str | None = None) -> None:
        self._url = url
        self._store: CalibrationStore | None = None
        self._lock = threading.Lock()
        if url:
            self.store()  # a bad URL is an InputError now, not at the first request

    @property
    def loaded(self) -> bool:
        return self._store is not None

    def store(self) -> CalibrationStore:
        with self._lock:
            if self._store is None:
                from server.calibrations import CalibrationStore

                self._store = CalibrationStore(self._url)
            return self._store

    def open(self) -> None:
        """At the app's start: a named database is opened (its table created or found); SQLite waits."""
        if self._url:
            self.store().open()

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store(), name)
