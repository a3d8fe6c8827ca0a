"""Byte sizes as people and Kubernetes write them: 8589934592, "8GiB", "512MiB", "8G", "32Gi", "3.5GB".

Binary units (Ki, Mi, Gi, Ti, with or without a trailing B) are powers of 1024; decimal units (K, M, G, T,
with or without B) are powers of 1000, as in Kubernetes quantities. So "8G" is 8e9 bytes, 7% less than
"8GiB": the safe side when a size caps memory.
"""

from __future__ import annotations

import math
import re

from edge.errors import InputError

_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4, "p": 1000**5}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
EXPECTED = 'a non-negative size: bytes as an integer, or a string like "8GiB", "512MiB", "8G" or "32Gi"'


def parse_size(text: int | str, field: str) -> int:
    """Bytes from an int or a size string; InputError naming `field` otherwise."""
    if isinstance(text, bool):
        raise InputError(field, text, EXPECTED)
    if isinstance(text, int):
        if text < 0:
            raise InputError(field, text, EXPECTED)
        return text
    if isinstance(text, float) and math.isfinite(text) and text >= 0 and text.is_integer():
        return int(text)
    if not isinstance(text, str):
        raise InputError(field, text, EXPECTED)
    match = _SIZE.match(text)
    if not match:
        raise InputError(field, text, EXPECTED)
    number, prefix, binary, _ = match.groups()
    if binary and not prefix:  # "8i" or "8iB" is no unit at all
        raise InputError(field, text, EXPECTED)
    scale = 1024 ** ("kmgtp".index(prefix.lower()) + 1) if binary else _UNITS[prefix.lower()]
    return int(number) * scale if number.isdigit() else int(float(number) * scale)
