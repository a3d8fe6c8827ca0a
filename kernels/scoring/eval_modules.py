"""Finding and replacing a layer of a PyTorch model by its checkpoint prefix: what every evaluation installer
(kernels/scoring/eval_cpu_int4.py, eval_cpu_w4a8.py, eval_gptq.py) does to swap in its quantized modules."""

from __future__ import annotations

import torch
from torch import nn

from edge.errors import InputError


def submodule(model: nn.Module, prefix: str) -> nn.Module:
    try:
        return model.get_submodule(prefix)
    except AttributeError:
        raise InputError("CANDIDATE tensor", f"{prefix}.qweight", "a layer the source model has") from None


def prefix_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def replace_module(model: nn.Module, prefix: str, module: nn.Module) -> None:
    parent, _, child = prefix.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


class ScaledEmbedding(nn.Module):
    """A quantized embedding times the scale the source's embedding module applied: transformers' Gemma, Gemma 2
    and Gemma 3 multiply inside the module (`*ScaledWordEmbedding`, embed_scale = sqrt(hidden)), vLLM 0.28 right
    after it (models/gemma*.py: `embed_tokens(ids) * normalizer`, a buffer in the model's dtype); both round the
    scale to the activations' dtype first, as here."""

    def __init__(self, embedding: nn.Module, scale: torch.Tensor) -> None:
        super().__init__()
        self.embedding = embedding
        self.register_buffer("embed_scale", scale.detach().clone(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.embedding(ids)
        return rows * self.embed_scale.to(rows.dtype)


def replace_embedding(model: nn.Module, prefix: str, module: nn.Module) -> None:
    """Put a quantized embedding where the source's was, keeping the scale that module multiplied by, if any."""
    scale = getattr(submodule(model, prefix), "embed_scale", None)
    replace_module(model, prefix, module if scale is None else ScaledEmbedding(module, torch.as_tensor(scale)))
