"""Where edge-select keeps what it builds: the measured layout, the default model, conversions, compile caches.

One directory, `$EDGE_SELECT_CACHE_DIR` or ~/.cache/edge-select. Plans name engine caches under the default
spelling (`~/.cache/edge-select/...`, readable and pure); `resolve` maps that onto the directory in force.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_SPELLING = "~/.cache/edge-select"


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("EDGE_SELECT_CACHE_DIR"):
        return Path(env["EDGE_SELECT_CACHE_DIR"])
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".cache" / "edge-select"


def resolve(path: str, env: Mapping[str, str] | None = None) -> str:
    """A plan's path spelled under ~/.cache/edge-select, placed in the cache directory in force."""
    if path == DEFAULT_SPELLING or path.startswith(DEFAULT_SPELLING + "/"):
        return str(cache_dir(env)) + path[len(DEFAULT_SPELLING):]
    return os.path.expanduser(path)


def converted_dir(
    model_dir: Path, quantization_config: dict[str, Any] | None, env: Mapping[str, str] | None = None
) -> Path:
    """Where the conversion of this model for this quantization_config lives; same config, same place (edge-serve
    converts there, edge-eval --plan evaluates there). None: a bf16 checkpoint (a GGUF source's, which vLLM cannot
    load as a file)."""
    digest = hashlib.sha256(json.dumps(quantization_config, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir(env) / "converted" / f"{Path(model_dir).name}-{digest}"
