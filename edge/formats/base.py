"""What every weight format is asked, and the ledger lines they are answered in.

A weight format is how a path stores its weights (edge.catalog.weight_paths' `weight_format` names one), or how
the 8-bit set stores the embedding and the head. Each format is one object in its own module of this package:
its bytes per weight and per layer (the ledger's weight items, the cost model's derived bytes), its checkpoint
config's validation (the converter and the vLLM method both ask it), the kernel layouts it stores (the kernels
of edge.catalog.kernel_registry that read it), and, in kernels/formats, its converter step and the weights its
calibration timers build. Nothing outside these modules branches on a format's name (tests/edge/test_formats.py).

Memory means RssAnon summed over the vLLM process tree (docs/FACTS.md); a weight's bytes are its tensors' sizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from edge.catalog.quantized_layers import EMBEDDING, LayerDecision
from edge.errors import InputError
from edge.model.shapes import LinearShape, ModelShape

FP32 = 4  # bytes of a float32 scale
BF16 = 2  # bytes; the engine runs every path with bf16 activations and bf16 non-quantized tensors
LM_HEAD = "lm_head"
Layers = dict[str, list[LayerDecision]]  # kind -> its parts (edge.catalog.quantized_layers.model_layers)

ItemKind = Literal[
    "bf16-weights", "int4-weights", "int8-weights", "row-major-copy", "lookup-copy", "untie-cost", "export-weights",
    "norms", "biases", "rope", "kv-cache", "engine-baseline", "tokenizer", "prefill-activations", "load-copy",
    "repack-transient", "dequant-working-set", "repack-retention", "drafting",
]  # fmt: skip


class MemoryItem(BaseModel):
    """One named line of the memory ledger."""

    kind: ItemKind  # stable: what programs (and tests) match on; `name` is for people
    layer: str | None = None  # the kind of weight it holds ("q_proj", "lm_head", "embed_tokens"), if any
    name: str  # e.g. "q_proj int4 tinygemm", "KV cache"
    bytes: int
    # settled footprint, or a transient on top of it: while loading, or while running (a prefill's dequantize)
    phase: Literal["resident", "load-transient", "run-transient"]
    detail: str  # how the number was computed, with the shapes
    avoidable_bytes: int | None = Field(
        default=None, description="What a stated change (named in detail) would save, e.g. capping RoPE."
    )
    backing: Literal["anonymous", "file"] = Field(
        default="anonymous",
        description="Where a resident item lives: anonymous memory (RssAnon) or a file the engine maps (RssFile: the "
        "page cache, shared and evictable; kernels/vllm_plugin/mapped_weights.py maps the loaded weights).",
    )


class WeightFormat:
    """One way of storing weights. The defaults are a format vLLM loads as a checkpoint and whose layers dequantize
    nothing at run time; each format module overrides what differs."""

    name: ClassVar[str]
    # the weight layouts of edge.catalog.kernel_registry's kernels that read this format's tensors
    kernel_layouts: ClassVar[tuple[str, ...]] = ()
    group_sizes: ClassVar[tuple[int, ...]] = ()  # () no groups
    group_note: ClassVar[str] = ""  # why these group sizes, in an error message
    # bytes read per weight per decode step, which ranks a path on an ISA class nothing measured; None: not ranked
    derived_bytes: ClassVar[float | None] = None
    runs_in_engine: ClassVar[bool] = True  # False: a bundle for another runtime (no engine, no KV cache)
    # the engine maps its linear layers' tensors from a file once loaded (kernels/vllm_plugin/mapped_weights.py):
    # False where vLLM repacks them into memory no module holds as a tensor (oneDNN's and sgl's packed bf16)
    linears_mapped: ClassVar[bool] = True
    decode_kernels: ClassVar[bool] = False  # its 4-bit layers' decode rows take a decode_kernel choice
    eight_bit: ClassVar[Any] = None  # the format of the 8-bit set beside its 4-bit layers (edge.formats.int8)

    def __repr__(self) -> str:
        return f"<weight format {self.name}>"

    def decode_copy_only(self, layout: str | None, decode_kernel: str) -> bool:
        """Whether its 4-bit layers keep only the decode kernel's copy (edge.formats.tinygemm); no by default."""
        return False

    def cannot_hold(self, layout: str, n: int, k: int, group: int) -> str | None:
        """Why this format's `layout` (one of kernel_layouts) cannot store an [N, K] weight at this group, or
        None (a calibration timer skips such a shape)."""
        return None

    # --- the ledger ---------------------------------------------------------------------------------------

    def weight_items(self, model: ModelShape, layers: Layers, layout: str | None, group: int | None, *,
                     block: int, decode_kernel: str) -> list[MemoryItem]:  # fmt: skip
        """The resident weight items of a plan storing its weights in this format."""
        raise NotImplementedError(self.name)

    def load_transients(self, model: ModelShape, layers: Layers, *, repack_chunk_rows: int) -> list[MemoryItem]:
        """What loading adds on top of the resident bytes: by default, the largest tensor's bf16 copy while it
        loads."""
        largest = max(weight_matrices(model), key=lambda lin: lin.n * lin.k)
        one = largest.model_copy(update={"count": 1})
        return [transient("load-copy", "largest tensor's load copy", bf16_bytes(one),
                          f"{largest.name}: {bf16_detail(one)} copied while it loads")]  # fmt: skip

    def run_transients(self, model: ModelShape, layers: Layers, layout: str | None, *, dequant_threshold: int,
                       prefill_dtype: str, max_model_len: int, max_num_seqs: int) -> list[MemoryItem]:  # fmt: skip
        """What a running batch adds on top of the resident bytes (a layer dequantized for a prompt)."""
        return []

    # --- the checkpoint's quantization_config --------------------------------------------------------------

    def check_request(self, path: str, qconfig: Any, methods: Sequence[str]) -> None:
        """A conversion's quantization_config, as the converter takes it: a dict naming one of the path's
        `methods` and one of this format's group sizes."""
        if not isinstance(qconfig, dict) or not isinstance(qconfig.get("group_size"), int):
            raise InputError("quantization_config", qconfig, f"a dict with an integer group_size for path {path}")
        if qconfig.get("quant_method") not in methods:
            expected = f"'{methods[0]}'" if len(methods) == 1 else f"one of {list(methods)}"
            raise InputError("quantization_config.quant_method", qconfig.get("quant_method"), expected)
        self.check_group_size(qconfig["group_size"], field="quantization_config.group_size", note=False)

    def check_group_size(self, group_size: object, *, field: str = "group_size", note: bool = True) -> None:
        if group_size not in self.group_sizes:
            why = f" ({self.group_note})" if note and self.group_note else ""
            raise InputError(field, group_size, f"one of {self.group_sizes}{why}")

    def check_method_config(self, *, group_size: object, dequant_threshold: int | None,
                            int8_group_size: int | None) -> None:  # fmt: skip
        """What the vLLM method reading this format checks of a checkpoint's config before building layers: its
        group size, the 8-bit set's, and the rows from which a batch dequantizes."""
        assert self.eight_bit is not None, f"{self.name} keeps no 8-bit set"
        self.eight_bit.check_group(int8_group_size)
        self.check_group_size(group_size)
        if dequant_threshold is not None and dequant_threshold < 1:
            raise InputError("dequant_threshold", dequant_threshold, "a row count >= 1")


# --- ledger lines, as every format writes them -------------------------------------------------------------


def resident(kind: ItemKind, name: str, size: int, detail: str, *, layer: str | None = None,
             avoidable_bytes: int | None = None) -> MemoryItem:  # fmt: skip
    return MemoryItem(kind=kind, layer=layer, name=name, bytes=size, phase="resident", detail=detail,
                      avoidable_bytes=avoidable_bytes)  # fmt: skip


def transient(kind: ItemKind, name: str, size: int, detail: str) -> MemoryItem:
    return MemoryItem(kind=kind, name=name, bytes=size, phase="load-transient", detail=detail)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def times(lin: LinearShape) -> str:
    return f"{lin.count} x " if lin.count > 1 else ""


def bf16_bytes(lin: LinearShape) -> int:
    return lin.count * lin.n * lin.k * BF16


def bf16_detail(lin: LinearShape) -> str:
    return f"{times(lin)}{lin.n} x {lin.k} x 2 B = {mib(bf16_bytes(lin))}"


def kept_bf16(lin: LinearShape, why: str) -> MemoryItem:
    return resident("bf16-weights", f"{lin.name} kept bf16", bf16_bytes(lin), f"{why}: {bf16_detail(lin)}",
                    layer=lin.name)  # fmt: skip


# --- the model's weight matrices ----------------------------------------------------------------------------


def embedding(model: ModelShape) -> LinearShape:
    return LinearShape(name=EMBEDDING, n=model.vocab_size, k=model.hidden_size, count=1)


def layer_linears(model: ModelShape) -> list[LinearShape]:
    return [lin for lin in model.linears if lin.name != LM_HEAD]


def head(model: ModelShape) -> LinearShape:
    heads = [lin for lin in model.linears if lin.name == LM_HEAD]
    return heads[0] if heads else embedding(model).model_copy(update={"name": LM_HEAD})


def weight_matrices(model: ModelShape) -> list[LinearShape]:
    return [embedding(model), *model.linears]


def one(layers: Layers, name: str) -> LayerDecision:
    """The decision of a weight that is one tensor (the embedding, the head): never split."""
    (decision,) = layers[name]
    return decision


def parts(linears: Iterable[LinearShape], layers: Layers) -> list[tuple[LinearShape, LayerDecision]]:
    """Each of `linears` per format its layers take (a kind split by format counts each part in its own), as
    LinearShapes of that many layers, each with the first of its parts' decisions."""
    found: list[tuple[LinearShape, LayerDecision]] = []
    for lin in linears:
        counts: dict[tuple[str, str | None], int] = {}  # int4 parts apart by their decode copy (blocks)
        for part in layers[lin.name]:
            counts[part.format, part.blocks] = counts.get((part.format, part.blocks), 0) + part.count
        for (fmt, blocks), count in counts.items():
            first = next(d for d in layers[lin.name] if (d.format, d.blocks) == (fmt, blocks))
            found.append((lin.model_copy(update={"count": count}), first))
    return found
