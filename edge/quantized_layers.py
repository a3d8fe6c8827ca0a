"""Which weights a path quantizes: the one owner of that decision.

Asked three ways, always through `QuantRules`:
    per kind of layer, from a ModelShape      the planner, the ledger, the engine config (`model_layers`)
    per checkpoint tensor                     the converter (`QuantRules.weights`)
    per vLLM layer, fused or not              the `cpu_int4` method (`QuantRules.fused`)

A layer stays bf16 when `quantization_config.ignore` names it, when the kernel cannot take its shape (tinygemm
packs N in 16s; vLLM's CPU GPTQ wants N and K in 32s), or when a layer vLLM fuses it with stays bf16 (q/k/v
load into one qkv_proj, gate/up into one gate_up_proj: a fused layer is quantized whole or not at all).
The embedding and the head:
    w4a16-tinygemm  the embedding is quantized when `quantize_embedding` says so, and a tied head with it;
                    plans say so for tied embeddings only (an untied one is just a lookup); an untied head is a
                    linear like any other
    w4a8-gptq       the embedding stays bf16; the head is quantized (`lm_head: true`; a tied one is untied)
Pure: no torch, no I/O.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from edge import rules
from edge.errors import InputError
from edge.shapes import ModelShape

Format = Literal["int4", "bf16"]
HEAD = "lm_head"
EMBEDDING = "embed_tokens"
# vLLM's fused layers and the checkpoint weights they load (Llama's packed_modules_mapping).
SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
FUSED: dict[str, str] = {shard: fused for fused, shards in SHARDS.items() for shard in shards}
QUANTIZED_PATHS = ("w4a16-tinygemm", "w4a8-gptq")


class LayerDecision(BaseModel):
    """One kind of weight (all `count` of them) and what the path stores it as."""

    name: str  # "q_proj", ..., "lm_head", "embed_tokens"
    format: Format
    why: str
    n: int
    k: int
    count: int


@dataclass(frozen=True)
class Decision:
    format: Format
    why: str

    @property
    def quantized(self) -> bool:
        return self.format != "bf16"


INT4 = Decision("int4", "quantized")


def kind(prefix: str) -> str:
    """The last name of a weight's prefix: model.layers.3.self_attn.q_proj -> q_proj."""
    return prefix.rsplit(".", 1)[-1]


def matches(prefix: str, patterns: Sequence[str]) -> bool:
    """An `ignore` entry is a layer kind ("q_proj", "lm_head"), a full prefix, or a glob."""
    return any(prefix == p or prefix.endswith("." + p) or fnmatch.fnmatchcase(prefix, p) for p in patterns)


@dataclass(frozen=True)
class QuantRules:
    """What a path's `quantization_config` says about which weights to quantize, for one model."""

    path: str
    group_size: int | None = None
    ignore: tuple[str, ...] = ()
    quantize_embedding: bool = False  # w4a16: the tied embedding and the head it serves
    quantize_head: bool = True  # w4a8-gptq: `lm_head`
    tied: bool = False
    # A K the group does not divide: an error when a checkpoint's config does not fit its model (converter, vLLM
    # method); bf16 with the reason when the planner weighs a path it may refuse anyway.
    strict: bool = True

    @classmethod
    def from_config(cls, path: str, qconfig: Mapping[str, Any] | None, *, tied: bool) -> QuantRules:
        qconfig = qconfig or {}
        return cls(
            path=path,
            group_size=qconfig.get("group_size"),
            ignore=tuple(qconfig.get("ignore") or ()),
            quantize_embedding=bool(qconfig.get("quantize_embedding", False)),
            quantize_head=bool(qconfig.get("lm_head", path == "w4a8-gptq")),
            tied=tied,
        )

    @property
    def n_multiple(self) -> int:
        return rules.PACK_N_MULTIPLE if self.path == "w4a16-tinygemm" else rules.GPTQ_PARTITION_MULTIPLE

    def ignored(self, prefix: str) -> bool:
        return matches(prefix, self.ignore)

    def weight(self, prefix: str, n: int, k: int) -> Decision:
        """One checkpoint weight [N, K] named by its prefix (model.layers.3.mlp.down_proj, lm_head,
        model.embed_tokens). A K the group does not divide raises InputError when `strict`: the config does not
        fit the model, and silently keeping bf16 would break the plan's memory ledger."""
        if self.path not in QUANTIZED_PATHS:
            return Decision("bf16", f"path {self.path} keeps every weight bf16")
        name = kind(prefix)
        if name == EMBEDDING or (name == HEAD and self.tied and self.path == "w4a16-tinygemm"):
            return self._embedding(prefix, n, k)
        if name == HEAD and not self.quantize_head and self.path == "w4a8-gptq":
            return Decision("bf16", "quantization_config.lm_head is not true")
        if self.ignored(prefix):
            return Decision("bf16", "listed in quantization_config.ignore")
        return self._shape(prefix, n, k)

    def _embedding(self, prefix: str, n: int, k: int) -> Decision:
        if self.path == "w4a8-gptq":
            return Decision("bf16", "a lookup: vLLM's GPTQ keeps the embedding bf16 (the head is untied from it)")
        if not self.quantize_embedding:
            why = "" if self.tied else "an untied embedding is a lookup: "
            return Decision("bf16", f"{why}quantization_config.quantize_embedding is not true")
        embedding = prefix.removesuffix(HEAD) + f"model.{EMBEDDING}" if kind(prefix) == HEAD else prefix
        if self.ignored(embedding) or self.ignored(HEAD):
            return Decision("bf16", "the tied embedding or its head is listed in quantization_config.ignore")
        return self._shape(prefix, n, k)

    def _shape(self, prefix: str, n: int, k: int) -> Decision:
        multiple = self.n_multiple
        if n % multiple:
            return Decision("bf16", f"N={n} is not a multiple of {multiple}")
        group = self.group_size
        if group is None or (self.path == "w4a8-gptq" and k % multiple) or (group > 0 and k % group):
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
        for shard, n in shards:
            decision = self.weight(base + shard, n, k)
            if not decision.quantized:
                return Decision("bf16", f"fused with {shard}, which stays bf16 ({decision.why})")
        return INT4

    def weights(self, shapes: Mapping[str, tuple[int, int]]) -> dict[str, Decision]:
        """Every checkpoint weight (prefix -> (N, K)), the fused-sibling rule applied."""
        decided = {prefix: self.weight(prefix, n, k) for prefix, (n, k) in shapes.items()}
        for prefix, decision in list(decided.items()):
            fused = FUSED.get(kind(prefix))
            if decision.quantized or fused is None:
                continue
            base = prefix.removesuffix(kind(prefix))
            for sibling in SHARDS[fused]:
                if decided.get(base + sibling, decision).quantized:
                    decided[base + sibling] = Decision(
                        "bf16", f"fused with {kind(prefix)} in vLLM's {fused}, which stays bf16 ({decision.why})"
                    )
        return decided


def rules_for(model: ModelShape, path: str, group_size: int | None, ignore: Sequence[str] = ()) -> QuantRules:
    """The rules a plan writes for this model: a tied embedding is quantized with its head (w4a16)."""
    return QuantRules(
        path=path,
        group_size=group_size,
        ignore=tuple(ignore),
        quantize_embedding=model.tie_word_embeddings,
        quantize_head=True,
        tied=model.tie_word_embeddings,
        strict=False,
    )


def model_layers(model: ModelShape, quant: QuantRules) -> list[LayerDecision]:
    """Per kind of weight in `model` (the embedding first), what `quant` stores it as."""
    shapes = {EMBEDDING: (model.vocab_size, model.hidden_size, 1)}
    shapes |= {lin.name: (lin.n, lin.k, lin.count) for lin in model.linears}
    if HEAD not in shapes:
        shapes[HEAD] = (model.vocab_size, model.hidden_size, 1)
    decided = quant.weights({name: (n, k) for name, (n, k, _) in shapes.items()})
    return [
        LayerDecision(name=name, format=decided[name].format, why=decided[name].why, n=n, k=k, count=count)
        for name, (n, k, count) in shapes.items()
    ]


def kept_bf16(layers: Sequence[LayerDecision]) -> list[str]:
    """The linears a quantized path leaves bf16, as `quantization_config.ignore` names them."""
    return [layer.name for layer in layers if layer.name != EMBEDDING and layer.format == "bf16"]
