"""What a path costs in quality: records that edge-eval measured, matched to the options a plan weighs.

A record is one edge-eval measurement of one model converted with one `quantization_config`, against its bf16
source, on real prose (kernels/evaluate/evaluate.py writes them under $EDGE_SELECT_CACHE_DIR/quality/). The planner is
pure: the CLI and the server read the records (`load_records`) and pass them in. A record matches an option
when the model's name and the settings that change the weights' numbers agree (`quality_key`); kernel settings
that only move time (layout, threshold, block) do not enter the key.

Without a record the plan says `unmeasured` and quotes the nearest reference fact (docs/FACTS.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from edge.catalog.kernel_registry import LOSSY_DECODE_KERNELS
from edge.catalog.quantized_layers import OWN_BLOCK_TYPES

# The speed priority trades quality only within this mean KL divergence (per token, nats) unless told otherwise.
# llama.cpp's plain 4-bit round-to-nearest formats (Q4_0/Q4_1, group 32) sit at 0.072 on Llama-3-8B and its
# Q4_K_M at 0.031 (tools/perplexity README, docs/FACTS.md): a floor just above the plain 4-bit grid lets what
# llama.cpp users run every day through and stops what is worse (the old g64 re-rounding of the default model
# kept 62 % of its top-1 tokens).
DEFAULT_MAX_KLD = 0.08
# The revision of edge-eval's candidate a record is measured with (QualityRecord.evaluator), and the revision below
# which a model of an architecture was measured wrong: the planner reads such a record as none (`find`).
#   2  a quantized embedding keeps the scale its module multiplies by (issue 40). Before, Gemma 3's candidate lost
#      its sqrt(hidden): a Gemma 3 Q4_K_M's w4a16 plan measured mean KLD 12.55 and top-1 1.9 % while it serves at
#      top-1 97.3 % (served prompt log-probs against the bf16 plan's), and the speed priority refused it.
EVALUATOR_REVISION = 2
STALE_BELOW: dict[str, int] = {"Gemma3ForCausalLM": 2}
# Settings of a quantization_config that change the weights' values or the arithmetic (and so the quality). Not
# `q4k`: a layer whose decode copy keeps the file's Q4_K blocks has the same codes and the same prefill buffer as the
# int4 grid of that file, its decode scales the file's own where the grid rounds them to bf16 (kernels/ops/q4k.py),
# and runs on int8 activations as the grid's decode kernel does then; it exists only with an int8-activation decode
# kernel, whose record (edge-eval --decode-kernel, run on the grid) the planner needs before it writes one, so the
# two share it. The 8-bit set's blocks (`q6k`, `q8_0`, `q5_0`: EIGHT_BIT_BLOCK_KEYS) do count: their kernels take
# int8 activations where the set's own kernel takes int16 (on the default model's Q4_K_M, mean KLD 0.0038 against
# 0.0016 on the grid, 2048 tokens, 2026-12-06), so their record is their own.
EIGHT_BIT_BLOCK_KEYS = tuple(own.key for own in OWN_BLOCK_TYPES.values() if own.format == "int8")
# smoothing and calibration_windows: how GPTQ solved a W4A8 checkpoint (kernels/convert/gptq_pass.py)
_NUMERIC_KEYS = ("quant_method", "bits", "group_size", "sym", "codes_from_source", "rounding", "smoothing",
                 "calibration_windows", "quantize_embedding", "int8", "int8_group_size", "ignore", "lm_head",
                 *EIGHT_BIT_BLOCK_KEYS)  # fmt: skip


class QualityRecord(BaseModel):
    """One edge-eval measurement, with standard errors."""

    model: str  # the source model's name (its directory's name)
    key: dict[str, Any]  # quality_key(path, quantization_config) of the candidate
    kld_mean: float
    kld_mean_se: float
    kld_p99: float | None = None
    top1_agreement: float  # fraction
    top1_agreement_se: float
    ppl_ratio: float
    ppl_ratio_se: float
    confident_flip_rate: float
    confident_flip_rate_se: float
    tokens: int
    cpu: str | None = None
    # the architecture whose kernels it ran on; None: x86_64, where every record before the field was measured
    arch: str | None = None
    measured_at: str | None = None
    report: str | None = None  # the report file it came from
    evaluator: int = 1  # EVALUATOR_REVISION of the edge-eval that measured it (records before revision 2 carry none)


class PlanQuality(BaseModel):
    """The plan's `quality` section."""

    status: Literal["measured", "unmeasured", "reference"]
    record: QualityRecord | None = None
    note: str  # where the numbers come from, or the nearest reference fact when unmeasured


def quality_key(path: str, qconfig: Mapping[str, Any] | None) -> dict[str, Any]:
    """The part of an option that decides its numbers: the path and the value-changing config settings."""
    key: dict[str, Any] = {"path": path}
    for name in _NUMERIC_KEYS:
        if qconfig and name in qconfig:
            value = qconfig[name]
            key[name] = sorted(value) if isinstance(value, list) else value
    # decode kernels whose arithmetic changes the numbers (edge.catalog.kernel_registry: int8 activations) key their own
    # records; a lossless one (the int16 AVX2 kernel) shares tinygemm's
    if qconfig and qconfig.get("decode_kernel") in LOSSY_DECODE_KERNELS:
        key["decode_kernel"] = qconfig["decode_kernel"]
    return key


def grid_key(key: Mapping[str, Any]) -> dict[str, Any]:
    """The key of the same candidate with its 8-bit set on the grid (no blocks of the file's): what a record measured
    before a plan kept any (edge-eval --decode-kernel on the grid plan) is filed under."""
    return {name: value for name, value in key.items() if name not in EIGHT_BIT_BLOCK_KEYS}


def find(
    records: list[QualityRecord], model: str, key: Mapping[str, Any], architecture: str | None = None
) -> QualityRecord | None:
    """The record with the most scored tokens for this model and key, or None; a record an older edge-eval measured
    wrong for this architecture (STALE_BELOW) is not one."""
    floor = STALE_BELOW.get(architecture or "", 0)
    matching = [r for r in records if r.model == model and r.key == dict(key) and r.evaluator >= floor]
    return max(matching, key=lambda r: r.tokens, default=None)


def for_arch(records: list[QualityRecord], arch: str | None) -> list[QualityRecord]:
    """The records that hold on a device of this architecture. The weights' values are the same everywhere, but the
    arithmetic is not: torch's ARM tinygemm truncates its float32 output to bf16 where x86's rounds to nearest (its
    error against float32 0.0033 against x86's 0.0016, emulated, docs/FACTS.md), and the decode kernels differ, so an
    x86 record says nothing certain of an ARM plan, nor the reverse. A device of unknown architecture takes x86's."""
    wanted = arch or "x86_64"
    return [r for r in records if (r.arch or "x86_64") == wanted]


def cached_records() -> list[QualityRecord]:
    """edge-eval's records in the cache directory ($EDGE_SELECT_CACHE_DIR/quality/), then the ones shipped for the
    embedded default model; none is fine."""
    from edge.paths import cache_dir

    return load_records(cache_dir() / "quality") + shipped_records()


def shipped_records() -> list[QualityRecord]:
    """The default model's plans as this project measured them (edge/data/quality_default_model.json): a fresh box
    knows what its speed plan's weights cost, e.g. that W4A8 re-rounds the model's Q4_1 codes to a mean KLD of 0.40.
    Measured on x86 hosts, they hold on every x86 box (for_arch); a box's own record wins on ties."""
    from importlib import resources

    data = json.loads(resources.files("edge").joinpath("data/quality_default_model.json").read_text())
    return [QualityRecord.model_validate(record) for record in data["records"]]


def load_records(directory: Path) -> list[QualityRecord]:
    """Every readable record in `directory` (*.json written by edge-eval); anything else is skipped."""
    records = []
    for file in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            data = json.loads(file.read_text())
            record = data.get("record") if isinstance(data, dict) else None
            if record is not None:
                records.append(QualityRecord.model_validate({**record, "report": str(file)}))
        except (OSError, ValueError, ValidationError):
            continue
    return records
