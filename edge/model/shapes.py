"""ModelShape: the shapes of a model that decide how it runs (read by edge.model.reader)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from edge.bounds import MAX_DIMENSIONS


def _dimension(key: str) -> type[int]:
    """A positive int bounded as config.json's `key` is when read (edge.bounds; edge.model.reader names the field)."""
    return Annotated[int, Field(gt=0, le=MAX_DIMENSIONS[key])]  # type: ignore[return-value]


class LinearShape(BaseModel):
    """One kind of linear layer: `count` matrices of N output by K input channels (weight [N, K])."""

    name: str  # e.g. "q_proj", "gate_proj", "lm_head"
    n: int  # output channels
    k: int  # input channels
    count: int  # how many layers carry one (num_hidden_layers for per-block linears, 1 for the head)


class ModelShape(BaseModel):
    name: str
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    hidden_size: _dimension("hidden_size")
    intermediate_size: _dimension("intermediate_size")
    num_layers: _dimension("num_hidden_layers")
    num_heads: _dimension("num_attention_heads")
    num_kv_heads: _dimension("num_key_value_heads")
    head_dim: _dimension("head_dim")
    vocab_size: _dimension("vocab_size")
    tie_word_embeddings: bool
    max_position_embeddings: _dimension("max_position_embeddings")
    rotary_dim: int  # channels per head that RoPE rotates (head_dim unless partial rotary)
    layer_types: list[str] | None = Field(
        default=None, description="Per-layer attention type where the config has one (e.g. sliding/full)."
    )
    sliding_window: int | None = None
    torch_dtype: str | None = None  # as written in config.json
    source_grid: int | None = Field(
        default=None,
        description="Group size of a 4-bit grid the weights already lie on: 32 for a model dequantized from a "
        "Q4_0/Q4_1 GGUF (its edge-source.json). A plan keeps that grid and reads the codes from the source.",
    )
    linears: list[LinearShape]  # every linear that can be quantized, the head included (name "lm_head")
    source_types: dict[str, dict[str, int]] | None = Field(
        default=None,
        description="A GGUF source's tensor types per kind of weight (embed_tokens, q_proj, ..., lm_head): how "
        "many of each, e.g. {'v_proj': {'Q4_K': 26, 'Q6_K': 4}}. None for a Hugging Face source.",
    )
    source_layers: dict[str, dict[str, list[int]]] | None = Field(
        default=None,
        description="A GGUF source's kinds of decoder linear held in more than one type: which layers (indices of "
        "model.layers) hold each type, e.g. {'v_proj': {'Q4_K': [3, 4, ...], 'Q6_K': [0, 1, 2, 5, ...]}}. A kind "
        "held in one type throughout is absent (source_types says it); None when there is none, and for a Hugging "
        "Face source.",
    )

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def linear_params(self) -> int:
        return sum(lin.n * lin.k * lin.count for lin in self.linears)

    @property
    def norm_params(self) -> int:
        return (2 * self.num_layers + 1) * self.hidden_size

    @property
    def total_params(self) -> int:
        """Parameters as stored: a tied head shares the embedding and is not counted twice."""
        head = 0 if not self.tie_word_embeddings else -self.vocab_size * self.hidden_size
        has_head = any(lin.name == "lm_head" for lin in self.linears)
        return self.embedding_params + self.linear_params + self.norm_params + (head if has_head else 0)
