"""Request and response bodies of the HTTP API. Every field carries a description: it is the OpenAPI doc."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)

from edge.bounds import MAX_DIMENSIONS, MAX_LABELS, MAX_TENSOR_DIM
from edge.plan.schema import Layout, Plan, Priority, ServingMode, WeightPath
from server.supervisor.status import EngineStatus

# Texts and label maps are bounded here as well as by the body limit, so one field cannot take all of it.
MAX_TEXT_CHARS = 512 * 1024
MAX_MODEL_LEN = MAX_DIMENSIONS["max_position_embeddings"]  # 16 Mi tokens: past any model's context
MAX_NUM_SEQS = 4096


class NotFinite:
    """Stands in for a NaN or an infinity (Python's json reads NaN, Infinity and 1e400) anywhere in a request body: no
    typed field accepts it, edge.bounds.check_finite_numbers refuses it inside a free-form object (a profile, a
    config) naming its path, and the 422 can print it. The float itself cannot be printed as JSON: a validation error
    carrying it (a union's error carries the whole object it was given) would answer 500."""

    def __init__(self, number: float) -> None:
        self.not_finite = str(number)

    def __repr__(self) -> str:
        return self.not_finite


def _mark_non_finite(data: Any) -> Any:
    """`data` with every non-finite float in it replaced by a NotFinite, in place (the body just parsed); iterative,
    so that nesting as deep as json accepts costs no recursion."""
    if isinstance(data, float) and not math.isfinite(data):
        return NotFinite(data)
    pending = [data]
    while pending:
        node = pending.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in list(items):
            if isinstance(value, float) and not math.isfinite(value):
                node[key] = NotFinite(value)
            elif isinstance(value, dict | list):
                pending.append(value)
    return data


class _Strict(BaseModel):
    """Unknown keys refused; a non-finite number given for a field (or in a list field) refused naming it. Numbers
    inside free-form objects (a profile, a config) are checked by edge.bounds.check_finite_numbers instead."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _non_finite_marked(cls, data: Any) -> Any:
        return _mark_non_finite(data)


class ProfileDevice(_Strict):
    """A device as JSON: a full DeviceProfile (what GET /probe returns) or a hand-written description."""

    profile: dict[str, Any] = Field(
        description="A DeviceProfile (has `described_by`) or a description such as "
        '{"name": "gw-17", "arch": "x86_64", "isa": ["avx2", "fma"], "cores": 4, "memory": "8GiB"}.',
        examples=[{"name": "gw-17", "arch": "x86_64", "isa": ["avx2", "fma"], "cores": 4, "memory": "8GiB"}],
    )


class CpuinfoDevice(_Strict):
    """A device as the text of its /proc/cpuinfo, optionally with its /proc/meminfo."""

    cpuinfo: str = Field(max_length=MAX_TEXT_CHARS, description="The text of /proc/cpuinfo.")
    meminfo: str | None = Field(default=None, max_length=MAX_TEXT_CHARS, description="The text of /proc/meminfo.")
    name: str | None = Field(default=None, max_length=256, description="What to call the device in the plan.")


class NfdDevice(_Strict):
    """A device as its Kubernetes node-feature-discovery labels (a bare label map or {labels, capacity})."""

    nfd_labels: dict[str, Any] = Field(
        max_length=MAX_LABELS,
        description='e.g. {"feature.node.kubernetes.io/cpu-cpuid.AVX2": "true", "kubernetes.io/arch": '
        '"amd64"}, or {"labels": {...}, "capacity": {"cpu": "8", "memory": "32Gi"}}.',
    )
    name: str | None = Field(default=None, max_length=256, description="What to call the device in the plan.")


class LscpuDevice(_Strict):
    """A device as util-linux's `lscpu -J` output (flat or with nested `children`), optionally with /proc/meminfo."""

    lscpu: list[dict[str, Any]] = Field(
        max_length=MAX_LABELS,
        description='The `lscpu` list of `lscpu -J`: [{"field": "Architecture:", "data": "x86_64"}, ...].',
    )
    meminfo: str | None = Field(default=None, max_length=MAX_TEXT_CHARS, description="The text of /proc/meminfo.")
    name: str | None = Field(default=None, max_length=256, description="What to call the device in the plan.")


Device = Annotated[
    ProfileDevice | CpuinfoDevice | NfdDevice | LscpuDevice,
    Field(
        description="Exactly one of: {profile}, {cpuinfo, meminfo?, name?}, {nfd_labels, name?}, "
        "{lscpu, meminfo?, name?}."
    ),
]


class ConfigModel(_Strict):
    """A model as its Hugging Face config.json."""

    config: dict[str, Any] = Field(description="The model's config.json object.")
    name: str | None = Field(default=None, max_length=256, description="The model's name in the plan.")


class GgufTensor(_Strict):
    name: str = Field(max_length=256, description="The file's tensor name, e.g. blk.0.attn_q.weight.")
    type: str = Field(max_length=16, description="Its GGML type, e.g. Q4_K.")
    shape: list[Annotated[int, Field(gt=0, le=MAX_TENSOR_DIM)]] = Field(
        max_length=4, description="Hugging Face orientation: [N, K] for a matrix."
    )


class GgufHeaderBody(_Strict):
    metadata: dict[str, Any] = Field(description="The GGUF's metadata keys (an array may be given as its length).")
    tensors: list[GgufTensor] = Field(default=[], max_length=100_000, description="The file's tensor table.")


class GgufModel(_Strict):
    """A model as its GGUF file's header (what `edge.model.gguf_metadata.read_header` reads; no tensor data)."""

    gguf: GgufHeaderBody = Field(description="{metadata, tensors}: the file's header.")
    name: str | None = Field(default=None, max_length=256, description="The model's name in the plan.")


class NamedModel(_Strict):
    """A model known to the server by name."""

    name: Literal["default"] = Field(description="'default': the embedded SmolLM2-135M-Instruct.")


Model = Annotated[
    ConfigModel | GgufModel | NamedModel,
    Field(description="{config, name?}, {gguf: {metadata, tensors}, name?} or {name: 'default'}."),
]

MemoryBudget = Annotated[
    int | str | None,
    Field(
        default=None,
        description="Bytes the engine may use: an integer, or a size such as '3GiB', '512MiB', '8G'. "
        "Default: the device's usable memory.",
        examples=["3GiB", 3221225472],
    ),
]


class PlanOptions(_Strict):
    model: Model = Field(default_factory=lambda: NamedModel(name="default"))
    priority: Priority = Field(default="speed", description="'speed' or 'fidelity' (agents: fidelity).")
    memory_budget: MemoryBudget = None
    max_model_len: int | None = Field(
        default=None, ge=1, le=MAX_MODEL_LEN, description="Context length to serve; default: the planner's."
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, le=MAX_NUM_SEQS, description="Concurrent sequences; default: the planner's."
    )
    serving_mode: ServingMode | None = Field(
        default=None, description="How many processes vLLM runs as: 'one-process', 'two-process' or 'three-process'; "
        "default: the planner's by the device's cores (the plan's vllm.mode).",
    )
    threads: int | None = Field(
        default=None, ge=1, description="The one- or two-process engine's compute threads (OMP_NUM_THREADS); "
        "default: the calibration's choice, else every core but one.",
    )
    speculative: str | None = Field(
        default=None, max_length=64, description="Drafted tokens for vLLM to verify a step: 'off' (the default), "
        "'ngram' (drafts from the request's own text) or 'auto' (ngram where a measurement on the device's ISA class "
        "says it pays; the plan's speculative section says which and why).",
    )


class PlanRequest(PlanOptions):
    """Plan one model on one device."""

    device: Device
    path: WeightPath | None = Field(default=None, description="Pin the weight path instead of choosing one.")
    layout: Layout | None = Field(default=None, description="Pin the w4a16 layout instead of choosing one.")
    force: bool = Field(default=False, description="Plan a pinned choice even where a gate refuses it.")


class InvalidDevice:
    """A batch's device that is not one of the device shapes: its own error in the answer, not the whole batch's."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        self.errors = errors


def _device_or_invalid(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError as error:
        return InvalidDevice(error.errors(include_url=False))


# The schema is Device's; a value that fails it becomes an InvalidDevice in its place.
BatchDevice = Annotated[Device, WrapValidator(_device_or_invalid)]


class BatchRequest(PlanOptions):
    """Plan one model with one priority on many devices; a device that cannot be read gets its own error."""

    devices: list[BatchDevice] = Field(min_length=1, description="The devices, at most the server's batch limit.")


class ErrorItem(BaseModel):
    loc: list[str | int] = Field(description="Where in the request the problem is, e.g. ['body','device','cpuinfo'].")
    msg: str = Field(description="What is wrong: 'FIELD: expected X, got Y'.")
    field: str | None = Field(default=None, description="The field the planner named, when it named one.")
    type: str = Field(description="'input_error' (the planner refused the input) or a validation error type.")


class BatchItem(BaseModel):
    index: int = Field(description="Position of the device in the request's `devices`.")
    plan: Plan | None = Field(default=None, description="The plan, when the device could be planned.")
    error: ErrorItem | None = Field(default=None, description="Why not, when it could not.")


class BatchResponse(BaseModel):
    results: list[BatchItem]
    planned: int = Field(description="How many devices got a plan.")
    failed: int = Field(description="How many devices got an error.")


class DraftingStatus(BaseModel):
    """What the engine's speculative decoding did since it started (vLLM's spec_decode counters)."""

    method: str = Field(description="The plan's drafting method (plan.speculative.method).")
    num_speculative_tokens: int | None = Field(description="Tokens drafted a step at most.")
    drafts: float = Field(description="Steps that checked drafted tokens.")
    drafted_tokens: float = Field(description="Tokens drafted and checked.")
    accepted_tokens: float = Field(description="Drafted tokens the model's own choice confirmed.")
    acceptance_rate: float | None = Field(description="accepted_tokens / drafted_tokens; null before any draft.")
    tokens_per_step: float | None = Field(
        description="Tokens a verified step produced on average: 1 + accepted_tokens / drafts; null before any draft."
    )


class StatusResponse(BaseModel):
    plan: Plan | None = Field(description="The plan in force, if the server runs an engine.")
    engine: EngineStatus | None = Field(description="The engine's state; null when the server only plans.")
    drafting: DraftingStatus | None = Field(
        default=None, description="Speculative decoding's counters, when the plan drafts and the engine is ready."
    )
    weight_path: str | None = Field(description="plan.path[/layout], as sent in X-Edge-Weight-Path.")
    openai_base_url: str | None = Field(description="OpenAI-compatible API through this server (/v1).")
    model_dir: str | None = Field(description="The checkpoint directory the engine serves.")


class Health(BaseModel):
    status: str
    state: str | None = None


class CalibrationSummary(BaseModel):
    """One stored calibration record (edge.device.calibration.CalibrationRecord), without its kernel times."""

    digest: str = Field(description="Identifies this exact record; a record posted twice is stored once.")
    key: str = Field(description="CPU, torch, vLLM and native library: records with the same key are comparable.")
    cpu_model: str = Field(description="The CPU's model string, as /proc/cpuinfo names it.")
    isa_flags: list[str] = Field(description="The ISA flags the CPU has, of those the planner knows.")
    model: str | None = Field(description="Whose linear shapes were timed, when one model's were.")
    measured_at: str = Field(description="When the box measured it (ISO 8601).")
    received_at: datetime = Field(description="When this service stored it.")
    posted_by: str | None = Field(
        default=None, description="The role of the token that posted it ('api' or 'report'); null: stored before."
    )


class CalibrationStored(BaseModel):
    key: str = Field(description="The record's key (CPU, torch, vLLM, native library).")
    digest: str = Field(description="The record's digest, under which it is stored.")
    created: bool = Field(
        description="True: stored now (201); false (200): it was already stored, or it is older than the newest "
        "records its key keeps (server.calibrations.KEEP_PER_KEY) and was not kept."
    )
