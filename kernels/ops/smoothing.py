"""Activation smoothing for W4A8 (SmoothQuant: Xiao, Lin, Seznec, Wu, Demouth, Han, ICML 2023; written from the
paper, no library code copied).

vLLM's int4 x int8 kernel rounds each input row to int8 with one scale for the row, so a few outlier channels set
the step for all the others. Per input channel j, s_j = max|X_j|^α / max|W_:,j|^(1-α) moves part of the outlier's
range into the weights: X diag(1/s) · diag(s) Wᵀ is the same product, and 1/s folds exactly into whatever wrote X
(an RMSNorm's weight, or the rows of the linear before). Nothing in the kernel changes.

Measured on the default model (docs/reports/2026-12-07-w4a8-gptq.md): float weights with int8 activations per row
cost KLD 0.0258; smoothed at α 0.5, 0.0092.

Where the scales fold (`FOLDS`, Llama's decoder layer, which SmolLM2, Llama, Mistral and Qwen2/3 share): the input
norm into q/k/v, the post-attention norm into gate/up, and up's rows into down (silu(gate) * up is linear in up).
v's rows into o would need one scale per kv-head channel; measured, it changed nothing (0.0093 against 0.0092), so
it is not folded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# model_type values whose decoder layer is Llama's: y = x / rms(x) * weight, then the projections below
LLAMA_LAYERS = frozenset({"llama", "mistral", "qwen2", "qwen3"})
TINY = 1e-5  # a channel never seen (max 0) or a zero weight column gets no scale of its own


@dataclass(frozen=True)
class Fold:
    """Where one vector of scales folds: `source` divides its output channels (a norm's weight or a linear's rows),
    `consumers` multiply their input columns."""

    source: str
    consumers: tuple[str, ...]


FOLDS = (
    Fold("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    Fold("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    Fold("mlp.up_proj", ("mlp.down_proj",)),
)


def supports(model_type: str | None) -> bool:
    return model_type in LLAMA_LAYERS


def scales(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [K] for one fold: act_max [K] (the largest |x_j| seen), the consumers' weights [N_i, K]."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothing alpha must be in 0..1, got {alpha}")
    w_max = torch.stack([w.detach().abs().amax(dim=0).to(torch.float32) for w in weights]).amax(dim=0)
    s = act_max.to(torch.float32).clamp(min=TINY) ** alpha / w_max.clamp(min=TINY) ** (1.0 - alpha)
    return s.clamp(min=TINY)


@torch.no_grad()
def smooth_layer(layer: nn.Module, act_max: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """Fold the scales into one decoder layer in place; act_max: the input maxima of each consumer, by its name
    in the layer ("self_attn.q_proj", ...). Returns the scales by fold source."""
    applied = {}
    for fold in FOLDS:
        consumers = [layer.get_submodule(name) for name in fold.consumers]
        s = scales(act_max[fold.consumers[0]], [c.weight for c in consumers], alpha)
        source = layer.get_submodule(fold.source)
        if isinstance(source, nn.Linear):
            source.weight.div_(s[:, None].to(source.weight.dtype))
            if source.bias is not None:
                source.bias.div_(s.to(source.bias.dtype))
        else:  # an RMSNorm: y = x / rms(x) * weight
            source.weight.div_(s.to(source.weight.dtype))
        for consumer in consumers:
            consumer.weight.mul_(s[None, :].to(consumer.weight.dtype))
        applied[fold.source] = s
    return applied
