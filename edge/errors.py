"""Domain errors: what a user or a device description can get wrong.

Raised anywhere in `edge/`; turned into a message and exit code 2 by the CLI and into 422 by the server.
"""

from __future__ import annotations

from typing import Any


class InputError(ValueError):
    """Bad input, naming the field, the value and what was expected."""

    def __init__(self, field: str, value: Any, expected: str) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        # A prefix of a long string is all that is shown: repr() of a 1 MiB value would cost more than refusing it.
        shown = repr(value[:160]) if isinstance(value, str | bytes) and len(value) > 160 else repr(value)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        super().__init__(f"{field}: expected {expected}, got {shown}")
