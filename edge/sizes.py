"""Byte sizes as people and Kubernetes write them: 8589934592, "8GiB", "512MiB", "8G", "32Gi", "3.5GB".

Binary units (Ki, Mi, Gi, Ti, with or without a trailing B) are powers of 1024; decimal units (K, M, G, T,
with or without B) are powers of 1000, as in Kubernetes quantities. So "8G" is 8e9 bytes, 7% less than
"8GiB": the safe side when a size caps memory.
"""

from __future__ import annotations

import math
import re

from edge.bounds import MAX_BYTES, MAX_SIZE_CHARS
from edge.errors import InputError

_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4, "p": 1000**5}
# Read with string operations and patterns that cannot backtrack: "1" + 8000 spaces + "x" took 0.48 s through one
# regex with a leading and a trailing \s* around optional unit groups (runs over the same characters).
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_UNIT = re.compile(r"([kmgtp]?)(i?)(b?)", re.IGNORECASE)
_DIGITS = "0123456789."
EXPECTED = (
    f'a non-negative size of at most {MAX_BYTES} bytes (1 EiB): bytes as an integer, or a string like "8GiB", '
    f'"512MiB", "8G" or "32Gi" (at most {MAX_SIZE_CHARS} characters)'
)


def parse_size(text: int | str, field: str) -> int:
    """Bytes from an int or a size string; InputError naming `field` otherwise."""
    if isinstance(text, bool):
        raise InputError(field, text, EXPECTED)
    if isinstance(text, int):
        return _bounded(text, text, field)
    if isinstance(text, float) and math.isfinite(text) and text >= 0 and text.is_integer():
        return _bounded(int(text), text, field)
    if not isinstance(text, str) or len(text) > MAX_SIZE_CHARS:
        raise InputError(field, text, EXPECTED)
    stripped = text.strip()
    unit_at = len(stripped) - len(stripped.lstrip(_DIGITS))
    number, unit = stripped[:unit_at], stripped[unit_at:].lstrip()  # "8 GiB": spaces may part number and unit
    match = _UNIT.fullmatch(unit) if _NUMBER.fullmatch(number) else None
    if not match:
        raise InputError(field, text, EXPECTED)
    prefix, binary, _ = match.groups()
    if binary and not prefix:  # "8i" or "8iB" is no unit at all
        raise InputError(field, text, EXPECTED)
    scale = 1024 ** ("kmgtp".index(prefix.lower()) + 1) if binary else _UNITS[prefix.lower()]
    size = int(number) * scale if number.isdigit() else float(number) * scale
    return _bounded(int(size) if math.isfinite(size) else MAX_BYTES + 1, text, field)


def _bounded(size: int, given: object, field: str) -> int:
    if not 0 <= size <= MAX_BYTES:
        raise InputError(field, given, EXPECTED)
    return size
