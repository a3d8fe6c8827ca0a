"""The calibration store's one error, apart from the store (server/calibrations.py, which imports SQLAlchemy) so
that the API's error handlers can name it without loading the store (server/store.py)."""

from __future__ import annotations


class StoreUnavailable(RuntimeError):
    """The database could not be reached or refused a query (the API answers 503)."""
