"""The checkpoint facts edge-eval checks before loading anything: readable config.json files, a quant_method it
runs, and a candidate whose shapes are its source's. No torch here: bad input is refused, and a cached result
returned, without the 1.5 s torch import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edge.catalog.weight_paths import METHODS
from edge.errors import InputError

# config.json fields that fix the tensor shapes; a candidate must match its source on each it has.
SHAPE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size")  # fmt: skip
QUANT_METHODS = tuple(METHODS)  # every checkpoint method (edge.catalog.weight_paths), each with its installer


def read_config(directory: Path, field_name: str) -> dict[str, Any]:
    """config.json of a model directory; InputError naming `field_name` (SOURCE, CANDIDATE) when not one."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(field_name, str(directory), "a model directory")
    config_file = directory / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(field_name, str(directory), "a model directory holding config.json") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise InputError(str(config_file), str(error), "a readable JSON file") from None
    if not isinstance(config, dict):
        raise InputError(str(config_file), type(config).__name__, "a JSON object")
    return config


def quant_method(config: dict[str, Any]) -> str:
    """The quant_method edge-eval runs: "bf16" for a checkpoint without quantization_config."""
    qconfig = config.get("quantization_config")
    if qconfig is None:
        return "bf16"
    method = qconfig.get("quant_method") if isinstance(qconfig, dict) else qconfig
    if method not in QUANT_METHODS:
        raise InputError("quantization_config.quant_method", method, f"one of {list(QUANT_METHODS)} (or none: bf16)")
    return method


def check_same_shapes(source: dict[str, Any], candidate: dict[str, Any]) -> None:
    for key in SHAPE_FIELDS:
        if key in source and key in candidate and source[key] != candidate[key]:
            raise InputError(f"CANDIDATE config.json {key}", candidate[key], f"{source[key]!r}, as in the source")
