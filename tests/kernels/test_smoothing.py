"""Activation smoothing (kernels/ops/smoothing.py) on a Llama decoder layer of the default model's widths: the layer
computes the same function after the fold, and the inputs the int8 rows see lose their outliers."""

from __future__ import annotations

import pytest
import torch

from kernels.ops import smoothing


def llama_layer():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         num_hidden_layers=1, rms_norm_eps=1e-5)  # fmt: skip
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, layer_idx=0).float().eval()
    with torch.no_grad():  # norms away from 1, as a trained model's are
        layer.input_layernorm.weight.uniform_(0.2, 3.0)
        layer.post_attention_layernorm.weight.uniform_(0.2, 3.0)
    return layer, LlamaRotaryEmbedding(config)


def run(layer, rotary, x):
    positions = torch.arange(x.shape[1])[None]
    return layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary(x, positions))


def consumer_maxima(layer, rotary, x) -> dict[str, torch.Tensor]:
    maxima, handles = {}, []
    for fold in smoothing.FOLDS:
        for name in fold.consumers:
            def hook(module, args, name=name):
                maxima[name] = args[0].reshape(-1, args[0].shape[-1]).abs().amax(0)
            handles.append(layer.get_submodule(name).register_forward_pre_hook(hook))
    with torch.no_grad():
        run(layer, rotary, x)
    for handle in handles:
        handle.remove()
    return maxima


def test_the_folded_layer_computes_the_same_function():
    layer, rotary = llama_layer()
    x = torch.randn(1, 64, 576)
    x[..., 7] *= 30.0  # an outlier channel in the residual stream
    with torch.no_grad():
        before = run(layer, rotary, x)
        smoothing.smooth_layer(layer, consumer_maxima(layer, rotary, x), alpha=0.5)
        after = run(layer, rotary, x)
    assert torch.allclose(before, after, rtol=1e-4, atol=1e-4)


def test_the_consumers_inputs_are_flatter_after_the_fold():
    """The ratio of the largest channel maximum to the median one: what an int8 step per row pays for."""
    layer, rotary = llama_layer()
    x = torch.randn(1, 64, 576)
    x[..., 7] *= 30.0
    maxima = consumer_maxima(layer, rotary, x)
    smoothing.smooth_layer(layer, maxima, alpha=0.5)
    after = consumer_maxima(layer, rotary, x)
    def spread(m: torch.Tensor) -> float:
        return float(m.max() / m.median())

    for name in ("self_attn.q_proj", "mlp.gate_proj"):  # behind the norms: the residual's outlier channel
        assert spread(after[name]) < 0.5 * spread(maxima[name]), (name, spread(maxima[name]), spread(after[name]))
    assert spread(after["mlp.down_proj"]) < spread(maxima["mlp.down_proj"])


def test_alpha_outside_zero_to_one_is_refused_naming_it():
    with pytest.raises(ValueError, match="alpha must be in 0..1, got 1.5"):
        smoothing.scales(torch.ones(4), [torch.ones(2, 4)], 1.5)


def test_only_llama_style_layers_are_smoothed():
    assert smoothing.supports("llama") and smoothing.supports("qwen3")
    assert not smoothing.supports("gemma3_text")  # its norms are (1 + w), its feed-forward norm another module
