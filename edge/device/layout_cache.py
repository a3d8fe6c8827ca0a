"""The tinygemm block of this host, measured once per (torch version, CPU flags) and cached.

Reading the packed int4 layout with the wrong block returns wrong weights (docs/FACTS.md: 32 on this AVX2 host,
64 on AVX-512), so the block is measured by kernels.ops.layout in a subprocess (edge/ never imports torch) and
kept in $EDGE_SELECT_CACHE_DIR/tinygemm_layout.json (default ~/.cache/edge-select/). File shape:

    {"entries": {"torch=2.13.0+cpu;cpu=<sha256 of the sorted flags, 16 hex>": {"block": 32, ...}}}

A new torch or different CPU flags is a different key: the old entry stays, unused.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from edge.device.profile import Fact
from edge.paths import cache_dir

CACHE_FILE = "tinygemm_layout.json"
MEASURE_COMMAND = (sys.executable, "-m", "kernels.ops.layout", "--json")
# A cold torch import took 2.6 s here (2 shared cores); the measurement itself packs a few small matrices.
MEASURE_TIMEOUT_S = 60.0


def cache_path(env: Mapping[str, str]) -> Path | None:
    if not env.get("EDGE_SELECT_CACHE_DIR") and not env.get("HOME"):
        return None
    return cache_dir(env) / CACHE_FILE


def cache_key(torch_version: str, flags: Iterable[str], capability: str = "") -> str:
    """Torch version, CPU flags and ATEN_CPU_CAPABILITY: the layout follows torch's dispatch, not the flags
    alone (ATEN_CPU_CAPABILITY=default on this AVX2 host packs "pairs" instead of "halves", kernels/ops/layout.py)."""
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16]
    return f"torch={torch_version};cpu={digest};capability={capability or 'auto'}"


def _valid_block(record: Any) -> int | None:
    block = record.get("block") if isinstance(record, dict) else None
    return block if isinstance(block, int) and not isinstance(block, bool) and block > 0 else None


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and isinstance(data.get("entries"), dict) else {}


def lookup(path: Path, key: str) -> dict[str, Any] | None:
    """The cached record for this key, or None (no file, unreadable, no entry, or no valid block)."""
    record = _load(path).get("entries", {}).get(key)
    return record if _valid_block(record) is not None else None


def store(path: Path, key: str, record: dict[str, Any]) -> str | None:
    """Add the record under key, atomically (temp file + rename); the reason on failure, else None."""
    data = _load(path) or {"entries": {}}
    data["entries"][key] = record
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".tinygemm_", delete=False) as tmp:
            json.dump(data, tmp, indent=2, sort_keys=True)
        os.chmod(tmp.name, 0o644)  # NamedTemporaryFile makes 0600; the cache holds nothing private
        os.replace(tmp.name, path)
    except OSError as error:
        return f"could not write {path}: {error}"
    return None


def measure(
    command: Sequence[str] = MEASURE_COMMAND, timeout_s: float = MEASURE_TIMEOUT_S
) -> tuple[dict | None, str]:
    """Run the layout measurement; (record, "") on success, (None, reason) on any failure."""
    try:
        done = subprocess.run(
            list(command), capture_output=True, text=True, errors="replace", timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return None, f"{' '.join(command[-3:])} took over {timeout_s:.0f} s"
    except OSError as error:
        return None, f"could not start {command[0]}: {error}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{' '.join(command[-3:])} exited {done.returncode}: {last[:200]}"
    lines = done.stdout.strip().splitlines()
    try:
        record = json.loads(lines[-1]) if lines else None
    except ValueError:
        record = None
    if _valid_block(record) is None:
        return (
            None,
            f"{' '.join(command[-3:])} printed no JSON object with an integer block: {done.stdout[-200:]!r}",
        )
    return record, ""


def tinygemm_block(
    torch_version: str | None,
    flags: Iterable[str],
    derived: Fact[int],
    *,
    measure_layout: bool,
    env: Mapping[str, str],
    command: Sequence[str] = MEASURE_COMMAND,
) -> Fact[int]:
    """Measured block (cached or fresh) when torch is installed; else `derived`, with the reason appended."""

    def fallback(reason: str) -> Fact[int]:
        return derived.model_copy(update={"detail": f"{derived.detail}; not measured: {reason}"})

    if torch_version is None:
        return fallback("torch is not installed")
    flags = frozenset(flags)
    path = cache_path(env)
    key = cache_key(torch_version, flags, env.get("ATEN_CPU_CAPABILITY", "")) if flags else None
    if path is not None and key is not None:
        record = lookup(path, key)
        if record is not None:
            return Fact(
                value=record["block"],
                source="torch",
                detail=f"measured by kernels.ops.layout, cached in {path} under {key}",
            )
    if not measure_layout:
        return fallback("no cached measurement and measure_layout is off")
    record, reason = measure(command)
    if record is None:
        return fallback(reason)
    note = "not cached: CPU flags unknown" if key is None or path is None else store(path, key, record)
    where = note or f"cached in {path} under {key}"
    return Fact(
        value=record["block"], source="torch", detail=f"measured now by kernels.ops.layout (fresh); {where}"
    )
