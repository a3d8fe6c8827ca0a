"""Which weights a path quantizes: the one owner of that decision.

Asked three ways, always through `QuantRules`:
    per kind of layer, from a ModelShape      the planner, the ledger, the engine config (`model_layers`)
    per checkpoint tensor                     the converter (`QuantRules.weights`)
    per vLLM layer, fused or not              the `cpu_int4` method (`QuantRules.fused`)

Decided per checkpoint weight (model.layers.3.self_attn.v_proj), so one kind may take two formats: a GGUF source's
tensors keep the file's own mixed grid (a tensor on a 4-bit group-32 grid keeps its codes, one in a wider type goes
to the 8-bit set), and the plan's `layers` then lists a kind once per format, with the layers each covers.

A layer stays bf16 when `quantization_config.ignore` names it, when the kernel cannot take its shape (tinygemm
packs N in 16s; vLLM's CPU GPTQ wants N and K in 32s), or when a layer vLLM fuses it with stays bf16 (q/k/v
load into one qkv_proj, gate/up into one gate_up_proj: a fused layer takes one format, the widest of its parts).
A w4a16 weight in the 8-bit set (`quantization_config.int8`: kinds, prefixes or globs) is int8, per channel, or per
group of `quantization_config.int8_group_size` for a model read from a GGUF (eight_bit_group: the file's own 8-bit
grids copied, not re-rounded per channel).
The embedding and the head:
    w4a16-tinygemm  plans give both HEAD_FORMAT[priority]: the 8-bit set (EIGHT_BIT_SET) for speed, bf16 (listed
                    in `ignore`) for fidelity; a tied head follows its embedding. A config with neither quantizes
                    the embedding to int4 when `quantize_embedding` says so; an untied head is then a linear
    w4a8-gptq       `quant_method: cpu_w4a8` (the plugin's method, every host's plan): as w4a16 plans, both take
                    HEAD_FORMAT[priority] (int8 or bf16, never 4 bits) and a tied head follows its embedding
                    `quant_method: gptq` (vLLM's own method, a GPTQ checkpoint's): the embedding stays bf16; the
                    head is quantized (`lm_head: true`; a tied one is untied)
    Gemma and Gemma 2 (BF16_EMBEDDING_ARCHITECTURES) keep both bf16: vLLM's classes cannot load them quantized.
Pure: no torch, no I/O.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel

from edge.catalog.shape_rules import copied_grid
from edge.catalog.weight_paths import METHODS, QUANTIZED_PATHS, MethodSpec, own_method, quant_method
from edge.errors import InputError
from edge.model.gguf_metadata import GGML_BLOCKS, GRID_GROUP, INT8_GRIDS, WIDE_SOURCE_TYPES
from edge.model.shapes import LinearShape, ModelShape

Format = Literal["int4", "int8", "bf16"]
HEAD = "lm_head"
EMBEDDING = "embed_tokens"
# The 8-bit set a w4a16 plan writes (quantization_config.int8): the embedding and the head. llama.cpp keeps
# the output tensor and a tied embedding at 6-8 bits, Meta's quantized Llama 3.2 both at 8, and the default
# model's own GGUF stores them as Q8_0 (docs/FACTS.md); edge-eval measures what it buys (docs/reports/).
EIGHT_BIT_SET: tuple[str, ...] = (EMBEDDING, HEAD)
# Which format a w4a16 plan gives the embedding and the head, by priority. Measured on the default model
# (edge-eval, 16384 tokens of prose, group-32 source codes, AMD EPYC Zen 5, 2026-11-30; docs/reports/
# 2026-11-30-quality.md): head and embedding int8 top-1 96.5 %, mean KLD 0.0029; bf16 97.9 %, 0.0016; int4
# 84.5 %, 0.059. int8 halves the head's decode time against bf16 (1.90 vs 3.79 ms at 49152x576, M=1).
HEAD_FORMAT: dict[str, Format] = {"speed": "int8", "fidelity": "bf16"}
# The most sensitive linears, which a fidelity plan also keeps at 8 bits when the source has no 4-bit grid of its
# own. One group at a time at 4 bits (group 64, edge-eval, same host and text): q/k/v cost a mean KLD of 0.104 for
# 16.6 M weights, about 7 times gate/up's cost per weight; on a plain bf16 source at group 64, moving q/k/v to
# int8 cut the whole model's KLD from 0.170 to 0.097 and raised top-1 from 77.9 to 82.8 % for ~8 MB (135M model).
SENSITIVE_SET: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
# vLLM 0.28's classes for these build their VocabParallelEmbedding without the quantization config (models/gemma.py,
# gemma2.py), so the engine cannot load a quantized embedding ("no module or parameter named
# model.embed_tokens.qweight in Gemma2ForCausalLM", seen 2026-12-01); their head is that embedding (tied), so
# both stay bf16 whatever the priority. Gemma 3's class passes the config, so it takes the 8-bit set.
BF16_EMBEDDING_ARCHITECTURES: tuple[str, ...] = ("GemmaForCausalLM", "Gemma2ForCausalLM")
# A weight the file holds in a type wider than 4 bits (WIDE_SOURCE_TYPES) goes to the 8-bit set, tensor by tensor
# (issue 22: 5-, 6- and 8-bit grids go to the 8-bit path; the file's own mixed grid is kept). Re-rounding such
# weights to 4 bits is a second quantization: the default model's Q4_K_M requantization (166 Q5_0 linears) measured
# mean KLD 0.235 and top-1 72.9 % against the file's own weights with every linear re-rounded, 0.063 with the
# Q5_0-held kinds int8 and down_proj (16 Q4_K, 14 Q6_K) re-rounded at group 64, where llama.cpp serving the file
# measured 0.0044 (benchmarks/gguf_fidelity.py, docs/reports/2026-12-01-gguf-models.md).

# The module each kind of decoder linear sits in inside model.layers.N, as the Hugging Face checkpoints of every
# architecture read here name them (transformers' Llama, Qwen2/3, Gemma 2/3 and Phi-3; kernels.source.gguf_source
# gives a GGUF's tensors the same names).
LAYER_MODULES: dict[str, str] = {
    **dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"), "self_attn"),
    **dict.fromkeys(("gate_proj", "up_proj", "down_proj", "gate_up_proj"), "mlp"),
}


def layer_prefix(name: str, layer: int) -> str:
    """A decoder linear's checkpoint prefix: ("v_proj", 3) -> model.layers.3.self_attn.v_proj (a kind no
    architecture here has, as a ModelShape may name one, directly in the layer: model.layers.3.<name>)."""
    module = LAYER_MODULES.get(name)
    return f"model.layers.{layer}.{module}.{name}" if module else f"model.layers.{layer}.{name}"


def eight_bit_group(model: ModelShape, int8: Sequence[str]) -> int | None:
    """The 8-bit set's group for a model whose weights come from a GGUF (a file, or the default model's
    edge-source.json): the smallest INT8_GRIDS group among the types the file holds the set's kinds in (16 where
    one is Q6_K), else the Q8_0 block's 32; None (one scale per channel) for any other source, or an empty set.

    Why: llama.cpp's files hold these weights on grids of 32 (or 16) with a scale each; one scale per channel
    re-rounds them, and a row whose groups differ in range loses most (the default model's Q4_K_M, mostly Q5_0:
    the W4A16 plan measured mean KLD 0.00479 against llama.cpp's 0.00438 with per-channel int8,
    docs/reports/2026-12-01-grid-ledger-served-decode.md)."""
    if not int8 or (model.source_types is None and model.source_grid is None):
        return None
    kinds = {kind(entry) for entry in int8}
    held = {t for name, types in (model.source_types or {}).items() if name in kinds for t in types}
    return min((INT8_GRIDS[t] for t in held if t in INT8_GRIDS), default=GRID_GROUP)


def source_weights(
    model: ModelShape, held: Callable[[str], bool], kinds: Sequence[str] | None = None
) -> tuple[str, ...]:
    """The decoder weights (of `kinds`, default all) that the source file holds in a type `held` accepts, as
    `quantization_config.int8` names them: a kind held so throughout by its name, the layers of a kind held so
    only in part by their prefixes (model.layers.3.self_attn.v_proj). Nothing for a source without types."""
    entries: list[str] = []
    for name, types in (model.source_types or {}).items():
        if name in (EMBEDDING, HEAD) or (kinds is not None and name not in kinds) or not any(map(held, types)):
            continue
        if all(map(held, types)):
            entries.append(name)
            continue
        by_type = (model.source_layers or {}).get(name)
        assert by_type is not None, f"{name} is held in {sorted(types)}: edge.model.reader gives its layers"
        layers = sorted(i for type_name, indices in by_type.items() if held(type_name) for i in indices)
        entries += [layer_prefix(name, i) for i in layers]
    return tuple(entries)


def wide_source_weights(model: ModelShape) -> tuple[str, ...]:
    """The decoder weights the source file holds in WIDE_SOURCE_TYPES, which a plan keeps at 8 bits."""
    return source_weights(model, lambda type_name: type_name in WIDE_SOURCE_TYPES)


# When vLLM fuses weights of different formats into one layer, all take the widest (the cost model counts such a
# layer so too).
FORMAT_WIDTH = {"int4": 0, "int8": 1, "bf16": 2}
# vLLM's fused layers and the checkpoint weights they load (Llama's packed_modules_mapping).
SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
FUSED: dict[str, str] = {shard: fused for fused, shards in SHARDS.items() for shard in shards}


class LayerDecision(BaseModel):
    """One kind of weight (`count` of them) and what the path stores it as. A kind whose layers take different
    formats (or one format for different reasons) is listed once per part, each naming the layers it covers."""

    name: str  # "q_proj", ..., "lm_head", "embed_tokens"
    format: Format
    why: str
    n: int
    k: int
    count: int
    source: dict[str, int] | None = None  # what a GGUF source holds them as: {GGML type: how many}
    indices: list[int] | None = None  # the decoder layers (model.layers.N) of a kind split in parts; None: all
    group: int | None = None  # int8: one scale per this many weights along K (int8_group_size); None: per channel
    blocks: str | None = None  # int4/int8: the decode copy holds the file's own blocks of this type (OWN_BLOCKS)


@dataclass(frozen=True)
class Decision:
    format: Format
    why: str
    blocks: str | None = None  # the decode copy keeps the file's own blocks of this GGML type (OWN_BLOCKS)

    @property
    def quantized(self) -> bool:
        return self.format != "bf16"


INT4 = Decision("int4", "quantized")


@dataclass(frozen=True)
class OwnBlocks:
    """A GGML type whose blocks a layer can keep as the file holds them, read by an int8-activation kernel in the
    decode layout: the format it stands in for (int4: a layer's decode copy, prefill reading the tinygemm buffer as
    for any int4 layer; int8: an 8-bit-set layer), the `quantization_config` key that names its weights, and its
    block (K must be whole blocks; N whole blocks of OWN_BLOCK_N channels)."""

    type: str
    format: Format
    key: str

    @property
    def k_multiple(self) -> int:
        return GGML_BLOCKS[self.type][0]

    @property
    def decision(self) -> Decision:
        where = "its decode copy" if self.format == "int4" else "in the 8-bit set as"
        return Decision(self.format, f"{'quantized; ' if self.format == 'int4' else ''}{where} the file's own "
                        f"{self.type} blocks (quantization_config.{self.key})", self.type)  # fmt: skip


# Q4_K at 4.5 bits where the int4 grid holds 5 (kernels/ops/q4k.py); for the 8-bit set, which holds 10 bits a weight
# per group of 16 (9 per 32): Q6_K at 6.5625 (kernels/ops/q6k.py), Q8_0 at 8.5 and Q5_0 at 5.5 (kernels/ops/g32.py).
OWN_BLOCK_TYPES: dict[str, OwnBlocks] = {
    b.type: b for b in (OwnBlocks("Q4_K", "int4", "q4k"), OwnBlocks("Q6_K", "int8", "q6k"),
                        OwnBlocks("Q8_0", "int8", "q8_0"), OwnBlocks("Q5_0", "int8", "q5_0"))
}  # fmt: skip
OWN_BLOCKS: dict[str, str] = {t: b.format for t, b in OWN_BLOCK_TYPES.items()}
OWN_BLOCK_N = 8
# A type whose weights another holds unrounded: a Q5_0 block is a Q8_0 block with narrower codes (the same d, q - 16
# as its int8), so a Q5_0 weight fused with Q8_0 ones is written as Q8_0 blocks and the layer keeps one kind.
WIDENS_TO: dict[str, str] = {"Q5_0": "Q8_0"}
INT8 = Decision("int8", "in the 8-bit set (quantization_config.int8)")


def _method(path: str, method: str | None) -> MethodSpec:
    """A checkpoint's method, or its path's own where its config names none; a path without methods (bf16) is
    never asked how it quantizes (QuantRules.weight keeps every weight bf16 there)."""
    spec = METHODS.get(method) if method else own_method(path)
    return spec if spec is not None else _NO_METHOD


_NO_METHOD = MethodSpec("none", "bf16", False, False, 1, 1, False, False, False, ())


def kind(prefix: str) -> str:
    """The last name of a weight's prefix: model.layers.3.self_attn.q_proj -> q_proj."""
    return prefix.rsplit(".", 1)[-1]


def matches(prefix: str, patterns: Sequence[str]) -> bool:
    """An `ignore` entry is a layer kind ("q_proj", "lm_head"), a full prefix, or a glob: `prefix` is one, ends in
    "." and one, or matches one."""
    names, globs = _patterns(tuple(patterns))
    parts = prefix.split(".")
    return any(".".join(parts[i:]) in names for i in range(len(parts))) or any(
        fnmatch.fnmatchcase(prefix, p) for p in globs
    )


@functools.lru_cache(maxsize=64)
def _patterns(patterns: tuple[str, ...]) -> tuple[frozenset[str], tuple[str, ...]]:
    """The entries as names to look up and the globs among them (fnmatch's special characters). An 8-bit set that
    names a Q4_K_M's layers one by one has ~160 entries, which every weight of the model is matched against."""
    return frozenset(patterns), tuple(p for p in patterns if any(c in p for c in "*?["))


@dataclass(frozen=True)
class QuantRules:
    """What a path's `quantization_config` says about which weights to quantize, for one model."""

    path: str
    group_size: int | None = None
    ignore: tuple[str, ...] = ()
    quantize_embedding: bool = False  # w4a16: the tied embedding and the head it serves
    quantize_head: bool = True  # w4a8-gptq: `lm_head`
    int8: tuple[str, ...] = ()  # the 8-bit set, as kinds, prefixes or globs (`quantization_config.int8`)
    int8_group: int | None = None  # its scales per this many weights (`int8_group_size`); None: per channel
    # the weights kept as the file's own blocks, per GGML type (OWN_BLOCK_TYPES; `quantization_config.q4k`, `.q6k`,
    # `.q8_0`, `.q5_0`), named as `int8`: (type, names) pairs
    blocks: tuple[tuple[str, tuple[str, ...]], ...] = ()
    tied: bool = False
    # the checkpoint's quant_method; None: the path's own (cpu_int4 for w4a16, vLLM's gptq for w4a8)
    quant_method: str | None = None
    # A K the group does not divide: an error when a checkpoint's config does not fit its model (converter, vLLM
    # method); bf16 with the reason when the planner weighs a path it may refuse anyway.
    strict: bool = True

    @classmethod
    def from_config(cls, path: str, qconfig: Mapping[str, Any] | None, *, tied: bool) -> QuantRules:
        qconfig = qconfig or {}
        method = qconfig.get("quant_method")
        rules = cls(
            path=path,
            group_size=qconfig.get("group_size"),
            ignore=tuple(qconfig.get("ignore") or ()),
            quantize_embedding=bool(qconfig.get("quantize_embedding", False)),
            quantize_head=bool(qconfig.get("lm_head", _method(path, method).head_by_default)),
            tied=tied,
            quant_method=method,
        )
        if not rules.eight_bit:
            return rules
        blocks = tuple((t, tuple(names)) for t, b in OWN_BLOCK_TYPES.items() if (names := qconfig.get(b.key)))
        return replace(rules, int8=tuple(qconfig.get("int8") or ()), int8_group=qconfig.get("int8_group_size"),
                       blocks=blocks)  # fmt: skip

    @property
    def method(self) -> MethodSpec:
        """The checkpoint's method (edge.catalog.weight_paths.METHODS), which says how it takes each weight."""
        return _method(self.path, self.quant_method)

    @property
    def eight_bit(self) -> bool:
        """Whether the checkpoint's method runs the 8-bit set (the plugin's methods; vLLM's own gptq does not)."""
        return self.path in QUANTIZED_PATHS and self.method.eight_bit

    @property
    def n_multiple(self) -> int:
        return self.method.n_multiple

    def ignored(self, prefix: str) -> bool:
        return matches(prefix, self.ignore)

    @property
    def per_layer(self) -> bool:
        """Whether an entry of `ignore` or `int8` can tell one layer of a kind from another: a glob, or a name
        with a layer index (model.layers.3.self_attn.v_proj). Without one, every layer of a kind is decided alike."""
        entries = self.ignore + self.int8 + tuple(name for _, names in self.blocks for name in names)
        return any(_patterns(entries)[1]) or any(part.isdecimal() for entry in entries for part in entry.split("."))

    def weight(self, prefix: str, n: int, k: int) -> Decision:
        """One checkpoint weight [N, K] named by its prefix (model.layers.3.mlp.down_proj, lm_head,
        model.embed_tokens). A K the group does not divide raises InputError when `strict`: the config does not
        fit the model, and silently keeping bf16 would break the plan's memory ledger."""
        if self.path not in QUANTIZED_PATHS:
            return Decision("bf16", f"path {self.path} keeps every weight bf16")
        name = kind(prefix)
        if name == EMBEDDING or (name == HEAD and self.tied and self.eight_bit):
            return self._embedding(prefix, n, k)
        if name == HEAD and not self.quantize_head and not self.eight_bit:
            return Decision("bf16", "quantization_config.lm_head is not true")
        if self.ignored(prefix):
            return Decision("bf16", "listed in quantization_config.ignore")
        if matches(prefix, self.int8):
            return self._own_blocks(prefix, "int8", n, k) or INT8
        if name == HEAD and not self.method.int4_head:
            return Decision("bf16", f"{self.method.name} runs the head in int8 (quantization_config.int8) or bf16")
        decision = self._shape(prefix, n, k)
        return (self._own_blocks(prefix, "int4", n, k) or decision) if decision == INT4 else decision

    def _own_blocks(self, prefix: str, fmt: Format, n: int, k: int) -> Decision | None:
        """The file's own blocks a weight of `fmt` keeps: the first type of that format whose entries name it, where
        its shape is whole blocks; None where none does."""
        for type_name, names in self.blocks:
            own = OWN_BLOCK_TYPES[type_name]
            if own.format == fmt and matches(prefix, names) and k % own.k_multiple == 0 and n % OWN_BLOCK_N == 0:
                return own.decision
        return None

    def _embedding(self, prefix: str, n: int, k: int) -> Decision:
        if not self.eight_bit:
            return Decision("bf16", "a lookup: vLLM's GPTQ keeps the embedding bf16 (the head is untied from it)")
        embedding = prefix.removesuffix(HEAD) + f"model.{EMBEDDING}" if kind(prefix) == HEAD else prefix
        if self.ignored(embedding) or (self.tied and self.ignored(HEAD)):
            return Decision("bf16", "the embedding or the head tied to it is listed in quantization_config.ignore")
        if matches(embedding, self.int8) or (self.tied and matches(HEAD, self.int8)):
            return INT8
        if not self.method.int4_embedding:
            return Decision("bf16", f"{self.method.name} stores the embedding in int8 (quantization_config.int8) "
                            "or bf16")
        if not self.quantize_embedding:
            why = "" if self.tied else "an untied embedding is a lookup: "
            return Decision("bf16", f"{why}quantization_config.quantize_embedding is not true")
        return self._shape(prefix, n, k)

    def _shape(self, prefix: str, n: int, k: int) -> Decision:
        multiple, k_multiple = self.n_multiple, self.method.k_multiple
        if n % multiple:
            return Decision("bf16", f"N={n} is not a multiple of {multiple}")
        group = self.group_size
        if group is None or k % k_multiple or (group > 0 and k % group):
            if not self.strict:
                return Decision("bf16", f"K={k} is not divisible by group_size {group} (and by {multiple} for GPTQ)")
            raise InputError(
                f"{prefix}.weight", f"K={k}", f"K divisible by group_size {group} (and by {multiple} for GPTQ), "
                "or the layer listed in quantization_config.ignore",
            )
        return INT4

    def fused(self, prefix: str, shards: Sequence[tuple[str, int]], k: int) -> Decision:
        """A vLLM layer loaded from several checkpoint weights (shard kind, its N), e.g. qkv_proj from q/k/v."""
        if self.ignored(prefix):
            return Decision("bf16", "listed in quantization_config.ignore")
        base = prefix.removesuffix(kind(prefix))
        decided = [(shard, self.weight(base + shard, n, k)) for shard, n in shards]
        shard, widest = max(decided, key=lambda pair: (FORMAT_WIDTH[pair[1].format], pair[1].blocks is None))
        if all(d == widest for _, d in decided):
            return widest
        if all(d.format == widest.format for _, d in decided) and widest.format != "int4":
            return widest
        return Decision(widest.format, f"fused with {shard}, which is {widest.format} ({widest.why})")

    def weights(self, shapes: Mapping[str, tuple[int, int]]) -> dict[str, Decision]:
        """Every checkpoint weight (prefix -> (N, K)), the fused-sibling rule applied."""
        decided = {prefix: self.weight(prefix, n, k) for prefix, (n, k) in shapes.items()}
        for prefix, decision in list(decided.items()):
            fused = FUSED.get(kind(prefix))
            if fused is None:
                continue
            base = prefix.removesuffix(kind(prefix))
            for sibling in SHARDS[fused]:
                other = decided.get(base + sibling)
                if other is not None and FORMAT_WIDTH[other.format] < FORMAT_WIDTH[decision.format]:
                    decided[base + sibling] = Decision(
                        decision.format,
                        f"fused with {kind(prefix)} in vLLM's {fused}, which is {decision.format} ({decision.why})",
                    )
        # one vLLM layer keeps one kind of decode copy: where its weights (now of one format) keep blocks of types one
        # of which holds the others unrounded (WIDENS_TO), they take that type; where not all keep blocks, or their
        # types differ otherwise, none does
        for prefix, decision in list(decided.items()):
            fused = FUSED.get(kind(prefix))
            if fused is None or not decision.blocks:
                continue
            base = prefix.removesuffix(kind(prefix))
            siblings = {s: decided[base + s].blocks for s in SHARDS[fused] if base + s in decided}
            types = set(siblings.values())
            if types == {decision.blocks}:
                continue
            wide = next((t for t in types if t is not None and all(o == t or WIDENS_TO.get(o) == t for o in types)),
                        None)  # fmt: skip
            other = next(s for s, t in siblings.items() if t != decision.blocks)
            if wide is None:
                decided[prefix] = Decision(decision.format, f"fused with {other} in vLLM's {fused}, which is not the "
                                           f"file's {decision.blocks} blocks (one layer keeps one kind of decode "
                                           "copy)")  # fmt: skip
            elif wide != decision.blocks:
                decided[prefix] = Decision(decision.format, f"the file's {decision.blocks} written as {wide} blocks, "
                                           f"unrounded: fused with {other} in vLLM's {fused}, which keeps {wide} "
                                           "blocks (one layer keeps one kind of decode copy; quantization_config."
                                           f"{OWN_BLOCK_TYPES[wide].key})", wide)  # fmt: skip
        return decided


def rules_for(
    model: ModelShape,
    path: str,
    group_size: int | None,
    priority: str = "speed",
    ignore: Sequence[str] = (),
    *,
    amx: bool = True,
    int8_groups: bool = True,
    own_blocks: bool = False,
) -> QuantRules:
    """The rules a plan writes for this model: w4a16, and w4a8 on a device without AMX (`amx=False`: the plugin's
    cpu_w4a8), give the embedding and the head HEAD_FORMAT[priority] (the 8-bit set for speed; bf16, listed in
    `ignore`, for fidelity); fidelity also keeps SENSITIVE_SET at 8 bits, but for the tensors whose codes come
    from the source's own grid at this group (a GPTQ checkpoint never takes codes from the source). The weights a
    GGUF source holds wider than 4 bits take the 8-bit set, tensor by tensor (wide_source_weights). An
    architecture whose vLLM class cannot load a quantized embedding (BF16_EMBEDDING_ARCHITECTURES) keeps the
    embedding and its tied head bf16. `int8_groups`: the device runs a per-group 8-bit set at decode speed
    (edge.catalog.kernel_registry.runs_grouped_int8); where it does not, the set stays per channel. `own_blocks`:
    the plan's decode kernel reads a GGUF's own blocks (edge.catalog.kernel_registry.reads_own_blocks); then the
    4-bit weights the file holds as Q4_K keep them for decode (`q4k`) where the plan copies the file's codes, and the
    8-bit set's weights held as Q6_K, Q8_0 or Q5_0 keep theirs (`q6k`, `q8_0`, `q5_0`; OWN_BLOCK_TYPES) where the plan
    copies the file's codes or its method quantizes activations to int8 anyway (W4A8: MethodSpec.int8_activations)."""
    method = quant_method(path, amx=amx)
    spec = METHODS.get(method) if method else None
    eight_bit = spec is not None and spec.eight_bit
    plain_embedding = model.architecture in BF16_EMBEDDING_ARCHITECTURES
    head_format = ("bf16" if plain_embedding else HEAD_FORMAT[priority]) if eight_bit else None
    own_grid = spec is not None and copied_grid(model, spec.source_codes) == group_size
    # W4A8 re-rounds a Q4_K file's 4-bit weights to its own grid, yet its 8-bit set may keep the file's blocks
    int8_activations = spec is not None and spec.int8_activations
    sensitive: tuple[str, ...] = ()
    if eight_bit and priority == "fidelity":
        # a source grid without types (an edge-source.json: every linear Q4_0/Q4_1) holds them all already
        copies = spec.source_codes  # eight_bit: a method
        off_grid = source_weights(model, lambda type_name: type_name not in copies, SENSITIVE_SET)
        sensitive = off_grid if own_grid else SENSITIVE_SET
    wide = wide_source_weights(model) if eight_bit else ()
    int8 = tuple(dict.fromkeys((EIGHT_BIT_SET if head_format == "int8" else ()) + sensitive + wide))
    copies_q4k = own_grid and spec is not None and "Q4_K" in spec.source_codes
    blocks: list[tuple[str, tuple[str, ...]]] = []
    if own_blocks and copies_q4k and (q4k := source_weights(model, lambda type_name: type_name == "Q4_K")):
        blocks.append(("Q4_K", q4k))
    # the 8-bit set's weights held as Q6_K, Q8_0 or Q5_0, as their kernels' int8 activations per group of 32 run
    # them; an untied head too (a tied one is the embedding's lookup table)
    held_head = set((model.source_types or {}).get(HEAD, {}))
    for own in OWN_BLOCK_TYPES.values():
        if own.format != "int8" or not (own_blocks and eight_bit and int8_groups and (own_grid or int8_activations)):
            continue
        head = (HEAD,) if head_format == "int8" and not model.tie_word_embeddings and held_head == {own.type} else ()
        if names := source_weights(model, lambda type_name, t=own.type: type_name == t) + head:
            blocks.append((own.type, names))
    return QuantRules(
        path=path,
        group_size=group_size,
        ignore=tuple(ignore) + ((HEAD,) if head_format == "bf16" else ()),
        # a tied head listed in `ignore` keeps it bf16 all the same
        quantize_embedding=model.tie_word_embeddings and not plain_embedding,
        quantize_head=True,
        int8=int8,
        int8_group=eight_bit_group(model, int8) if int8_groups else None,
        blocks=tuple(blocks),
        tied=model.tie_word_embeddings,
        strict=False,
        quant_method=method,
    )


def model_layers(model: ModelShape, quant: QuantRules) -> list[LayerDecision]:
    """Per kind of weight in `model` (the embedding first), what `quant` stores it as, decided per checkpoint
    weight as the converter decides it: one entry a kind, or one a part where its layers differ."""
    kinds = [LinearShape(name=EMBEDDING, n=model.vocab_size, k=model.hidden_size, count=1), *model.linears]
    if not any(lin.name == HEAD for lin in model.linears):
        kinds.append(LinearShape(name=HEAD, n=model.vocab_size, k=model.hidden_size, count=1))
    prefixes = {lin.name: _prefixes(lin, every_layer=quant.per_layer) for lin in kinds}
    decided = quant.weights({prefix: (lin.n, lin.k) for lin in kinds for prefix in prefixes[lin.name]})
    layers = []
    for lin in kinds:
        parts: dict[Decision, list[int]] = {}
        for index, prefix in enumerate(prefixes[lin.name]):
            parts.setdefault(decided[prefix], []).append(index)
        whole = len(parts) == 1
        for decision, indices in parts.items():
            source = _source(model, lin.name, None if whole else indices)
            layers.append(LayerDecision(
                name=lin.name, format=decision.format, why=_from_source(model, quant, lin.name, decision, source),
                n=lin.n, k=lin.k, count=lin.count if whole else len(indices), source=source,
                indices=None if whole else indices,
                group=quant.int8_group if decision.format == "int8" else None, blocks=decision.blocks))  # fmt: skip
    return layers


def _prefixes(lin: LinearShape, *, every_layer: bool) -> list[str]:
    """The checkpoint prefixes of a kind's weights, by layer: every layer's, or the first one's when every layer
    is decided alike (QuantRules.per_layer: the same answer at 1/num_layers of the cost)."""
    if lin.name in (EMBEDDING, HEAD):
        return [f"model.{EMBEDDING}" if lin.name == EMBEDDING else HEAD]
    return [layer_prefix(lin.name, i) for i in range(lin.count if every_layer else 1)]


def _source(model: ModelShape, name: str, indices: Sequence[int] | None) -> dict[str, int] | None:
    """What a GGUF source holds weights of kind `name` as, {GGML type: how many}: all of them (`indices` None),
    or those of the layers named."""
    types = (model.source_types or {}).get(name)
    if types is None or indices is None:
        return types
    by_type = (model.source_layers or {}).get(name)
    if by_type is None:  # held in one type throughout
        assert len(types) == 1, f"{name} is held in {sorted(types)}: edge.model.reader gives its layers"
        return {next(iter(types)): len(indices)}
    counts = {t: sum(i in layers for i in indices) for t, layers in by_type.items()}
    return {t: n for t, n in counts.items() if n}


def _from_source(model: ModelShape, quant: QuantRules, name: str, decision: Decision,
                 types: Mapping[str, int] | None) -> str:  # fmt: skip
    """The decision's reason, and for a GGUF source's weights what the file held: for 4-bit ones on its own grid
    which keep the file's codes and which are re-rounded (a float tensor), for int8 ones the file's types and, per
    group, which keep their codes (INT8_GRIDS at a multiple of the group)."""
    if decision.format == "int8" and types:
        if quant.int8_group is None:
            return f"{decision.why}: from the file's " + ", ".join(f"{t} x{n}" for t, n in types.items())
        copied = ", ".join(f"{t} x{n}" for t, n in types.items() if INT8_GRIDS.get(t, 1) % quant.int8_group == 0)
        others = ", ".join(f"{t} x{n}" for t, n in types.items() if INT8_GRIDS.get(t, 1) % quant.int8_group)
        parts = ([f"the file's codes copied ({copied})"] if copied else []) + (
            [f"re-rounded per group of {quant.int8_group} from {others}"] if others else [])
        return f"{decision.why}: " + "; ".join(parts)
    if not types or name in (EMBEDDING, HEAD):
        return decision.why
    copies = quant.method.source_codes
    if decision.format != "int4" or copied_grid(model, copies) != quant.group_size:
        return decision.why
    kept = sum(count for t, count in types.items() if t in copies)
    others = ", ".join(f"{t} x{count}" for t, count in types.items() if t not in copies)
    return f"{decision.why}: the file's codes copied ({kept})" + (f", re-rounded from {others}" if others else "")


def by_kind(layers: Sequence[LayerDecision]) -> dict[str, list[LayerDecision]]:
    """model_layers' entries per kind: one part, or several where a kind's layers take different formats."""
    kinds: dict[str, list[LayerDecision]] = {}
    for layer in layers:
        kinds.setdefault(layer.name, []).append(layer)
    return kinds


def format_counts(parts: Sequence[LayerDecision]) -> dict[Format, int]:
    """How many layers of a kind (its parts) take each format."""
    counts: dict[Format, int] = {}
    for part in parts:
        counts[part.format] = counts.get(part.format, 0) + part.count
    return counts


def _named(layers: Sequence[LayerDecision], fmt: Format,
           also: Callable[[LayerDecision], bool] = lambda layer: True) -> list[str]:  # fmt: skip
    """The weights `layers` store as `fmt` (and `also` accepts), as `quantization_config` names them: a kind all of
    whose weights do by its name, the layers of a kind split in parts by their prefixes, in layer order."""
    found: dict[str, list[int] | None] = {}  # kind -> its layers in `fmt`, None: all of them
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.name] = counts.get(layer.name, 0) + layer.count
        if layer.format == fmt and also(layer):
            known = found.get(layer.name, [])
            found[layer.name] = None if layer.indices is None or known is None else known + layer.indices
    found = {name: None if indices is not None and len(indices) == counts[name] else indices
             for name, indices in found.items()}  # fmt: skip
    return [entry for name, indices in found.items()
            for entry in ([name] if indices is None else [layer_prefix(name, i) for i in sorted(indices)])]  # fmt: skip


def eight_bit_set(layers: Sequence[LayerDecision]) -> list[str]:
    """The plan's 8-bit set, as `quantization_config.int8` names it."""
    return _named(layers, "int8")


def eight_bit_group_size(layers: Sequence[LayerDecision]) -> int | None:
    """The 8-bit set's group (`quantization_config.int8_group_size`), one for the whole set; None: per channel."""
    groups = {layer.group for layer in layers if layer.format == "int8"}
    assert len(groups) <= 1, f"one int8 group per checkpoint, got {groups}"
    return next(iter(groups), None)


def own_block_sets(layers: Sequence[LayerDecision]) -> dict[str, list[str]]:
    """The weights kept as the file's own blocks, per `quantization_config` key (OWN_BLOCK_TYPES: q4k for int4 layers'
    decode copies, q6k, q8_0, q5_0 for the 8-bit set's), as the keys name them; a type no weight keeps is left out."""
    sets = {own.key: _named(layers, own.format, lambda layer, t=own.type: layer.blocks == t)
            for own in OWN_BLOCK_TYPES.values()}  # fmt: skip
    return {key: names for key, names in sets.items() if names}


def kept_bf16(layers: Sequence[LayerDecision]) -> list[str]:
    """The linears a quantized path leaves bf16, as `quantization_config.ignore` names them."""
    return [name for name in _named(layers, "bf16") if name != EMBEDDING]
