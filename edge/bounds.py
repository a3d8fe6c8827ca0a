"""The largest inputs the planner reads: one place for every bound, and the checks that name what broke one.

A bound sits well past anything real and well short of what makes planning slow or overflow: a plan walks a
per-layer list, so 10^6 layers took 28 s per plan before layers were bounded; a number past float range makes
arithmetic raise instead of refuse. Text is bounded per line (or per field) so that one line cannot cost more than
the rest of the file.
"""

from __future__ import annotations

import math
from typing import Any

from edge.errors import InputError

# Model dimensions, by config.json's names. The largest real ones: 126 layers (Llama 3.1 405B), hidden 16384 and
# intermediate 53248 (405B), vocab 262208 (Gemma 3) or 256000 (Gemma 2), 128 heads (405B), head_dim 256 (Gemma),
# contexts of 10M tokens (Llama 4 Scout).
MAX_DIMENSIONS: dict[str, int] = {
    "num_hidden_layers": 1024,
    "hidden_size": 65536,
    "intermediate_size": 1 << 20,
    "vocab_size": 1 << 22,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": 1 << 24,
    "sliding_window": 1 << 24,
    "sliding_window_pattern": 1024,
    "max_window_layers": 1 << 24,  # "from layer N on": past the last layer means no sliding layer
}
MAX_TENSOR_DIM = 1 << 22  # a GGUF tensor's dimension: no matrix is larger than the largest vocab
MAX_BYTES = 1 << 60  # 1 EiB: any memory size or budget
MAX_CPUS = 1 << 16  # logical CPUs of one device
MAX_COUNT = 1 << 20  # any other count a device states (cores per socket, sockets)
MAX_NUMBER = 1 << 63  # the magnitude of any number a request body carries
MAX_LINE_CHARS = 16 * 1024  # a /proc/cpuinfo line or an lscpu field; x86 `flags` lines are ~1.6 KB
MAX_TEXT_CHARS = 4 * 1024 * 1024  # a /proc/cpuinfo of 1024 logical CPUs is ~1.6 MB
MAX_SIZE_CHARS = 64  # a size string such as "32Gi" or "8589934592"
MAX_LSCPU_ENTRIES = 4096  # `lscpu -J` prints ~40; a big.LITTLE CPU a few more per core type
# Kubernetes label limits (apimachinery validation: a key is an optional DNS prefix of <= 253 characters, "/", and
# a name of <= 63; a value is <= 63 characters); a node has a few hundred labels with NFD's.
MAX_LABELS = 1024
MAX_LABEL_KEY_CHARS = 253 + 1 + 63
MAX_LABEL_VALUE_CHARS = 63


def check_dimension(field: str, key: str, value: int) -> int:
    """`value` when it is at most MAX_DIMENSIONS[key]; InputError naming `field` otherwise."""
    limit = MAX_DIMENSIONS[key]
    if value > limit:
        raise InputError(field, value, f"a positive integer at most {limit} (no real model's {key} is larger)")
    return value


def check_text(field: str, text: str, limit: int = MAX_TEXT_CHARS) -> str:
    if len(text) > limit:
        raise InputError(field, text, f"text of at most {limit} characters")
    return text


def check_finite_numbers(obj: Any, field: str, depth: int = 0) -> None:
    """Every number in JSON-decoded `obj` is finite and at most MAX_NUMBER in magnitude (Python's json reads NaN,
    Infinity and 1e400, which is inf); InputError naming the path of the first that is not."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return
    if not isinstance(obj, int | float | dict | list | tuple):  # e.g. the server's stand-in for a NaN it was sent
        raise InputError(field, obj, "a finite number (JSON has no NaN or Infinity)")
    if isinstance(obj, int | float):
        if not (isinstance(obj, int) or math.isfinite(obj)) or abs(obj) > MAX_NUMBER:
            raise InputError(field, obj, "a finite number of magnitude at most 2**63 (JSON has no NaN or inf)")
        return
    if depth > 32:
        raise InputError(field, "...", "JSON nested at most 32 deep")
    if isinstance(obj, dict):
        for key, value in obj.items():
            check_finite_numbers(value, f"{field}.{key}", depth + 1)
    elif isinstance(obj, list | tuple):
        for index, value in enumerate(obj):
            check_finite_numbers(value, f"{field}[{index}]", depth + 1)


def small_int(text: str, limit: int = MAX_COUNT) -> int | None:
    """A decimal count in `text` (1..limit), else None: "²".isdigit() is true and int("²") raises, and int() of
    more than 4300 digits raises too."""
    if not text.isascii() or not text.isdigit() or len(text) > len(str(limit)):
        return None
    value = int(text)
    return value if 0 < value <= limit else None
