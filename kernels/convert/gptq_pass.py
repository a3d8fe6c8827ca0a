"""GPTQ with activation smoothing over a float source, before the converter writes it (`rounding: gptq` in a
w4a8-gptq plan's quantization_config).

The source runs as plain PyTorch (transformers, bf16; the layer being solved in float32), one decoder layer at a time
over the calibration windows:
1. the inputs of layer 0 are captured once (the embeddings, the rotary tables, the mask);
2. per layer, in float32: the largest |x| per input channel of each linear (smoothing's statistics), the scales
   folded in (kernels/ops/smoothing.py), then 2 X Xᵀ / n of each linear's inputs in the smoothed layer, GPTQ for each
   linear the plan quantizes (kernels/ops/gptq_solve.py), and the layer run again with its quantized weights: the next
   layer calibrates on what this one will really give it (the paper's sequential order).

Calibration text: the default text's last windows (kernels/scoring/eval_text.py). edge-eval scores its first windows,
so the prose that judges the result is never the prose that made it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edge.errors import InputError
from kernels.ops import smoothing
from kernels.ops.gptq_solve import Hessian, Quantized, gptq

WINDOW = 512  # tokens a calibration window (edge-eval's chunk)
DEFAULT_WINDOWS = 16  # 8192 tokens


@dataclass(frozen=True)
class Solved:
    """What the converter writes instead of rounding to nearest: `quantized` by the source's weight name
    ("model.layers.0.self_attn.q_proj.weight"), and `replaced`: float tensors smoothing changed that stay float
    (the norms' weights), by name."""

    quantized: dict[str, Quantized]
    replaced: dict[str, torch.Tensor]
    windows: int
    alpha: float | None


def calibration_windows(tokenizer: Any, count: int, length: int = WINDOW) -> torch.Tensor:
    """count windows [count, length] of the default text's token ids, from its end; BOS first where the tokenizer
    puts one in front of text."""
    from kernels.scoring.eval_text import read_text, tokenize

    ids, bos = tokenize(tokenizer, read_text(None).content)
    if count * length > len(ids) // 2:
        raise InputError("calibration.windows", count, f"at most {len(ids) // 2 // length} windows of {length} "
                         f"tokens: the default text's second half ({len(ids)} tokens in all)")  # fmt: skip
    windows = torch.tensor(ids[len(ids) - count * length :], dtype=torch.int64).view(count, length).clone()
    if bos is not None:
        windows[:, 0] = bos
    return windows


def solve(source_dir: Path, quantize: set[str], *, group: int, sym: bool, alpha: float | None, windows: int,
          act_order: bool = True, progress: Callable[[int, int], None] | None = None) -> Solved:  # fmt: skip
    """GPTQ codes for every weight named in `quantize` (linears of the decoder layers), smoothed at `alpha` first
    (None: no smoothing)."""
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # bf16 as the source holds it; each layer in float32 only while it is solved (the whole model in float32 was
    # 4 bytes a weight more at the conversion's peak)
    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.bfloat16, local_files_only=True).eval()
    model_type = getattr(model.config, "model_type", None)
    if alpha is not None and not smoothing.supports(model_type):
        raise InputError("quantization_config.smoothing", alpha,
                         f"no smoothing for model_type {model_type!r}: it folds into Llama-style decoder layers "
                         f"({', '.join(sorted(smoothing.LLAMA_LAYERS))})")  # fmt: skip
    calibration = calibration_windows(AutoTokenizer.from_pretrained(source_dir, local_files_only=True), windows)
    layers = _decoder_layers(model)
    inputs = _first_layer_inputs(model, layers[0], calibration)
    quantized: dict[str, Quantized] = {}
    replaced: dict[str, torch.Tensor] = {}
    prefix = _layers_prefix(model, layers)
    for index, layer in enumerate(layers):
        layer.float()
        here = f"{prefix}.{index}."
        linears = {name: module for name, module in layer.named_modules()
                   if isinstance(module, nn.Linear) and f"{here}{name}.weight" in quantize}  # fmt: skip
        if alpha is not None:
            smoothing.smooth_layer(layer, _input_maxima(layer, inputs), alpha)
            replaced |= _smoothed_unsolved(layer, here, linears)
        hessians = _hessians(layer, linears, inputs)
        with torch.no_grad():
            for name, module in linears.items():
                q = gptq(module.weight, hessians[name].matrix(), group, sym=sym, scale_dtype=torch.bfloat16,
                         act_order=act_order)  # fmt: skip
                quantized[f"{here}{name}.weight"] = q
                module.weight.copy_(q.dequantize())
        inputs = _run_layer(layer, inputs)
        layer.to(torch.bfloat16)
        if progress is not None:
            progress(index + 1, len(layers))
    missing = quantize - quantized.keys()
    if missing:
        raise InputError("quantization_config.rounding", "gptq",
                         f"decoder-layer linears only; not found there: {sorted(missing)[:3]}")  # fmt: skip
    return Solved(quantized, replaced, windows, alpha)


def _smoothed_unsolved(layer: nn.Module, here: str, solved: dict[str, nn.Linear]) -> dict[str, torch.Tensor]:
    """Every tensor the scales changed that GPTQ does not write: the norms, and a fold's linear the plan keeps in
    float (a layer in `ignore`), with its bias: written as they now are, or the fold would be half applied."""
    changed: dict[str, torch.Tensor] = {}
    for fold in smoothing.FOLDS:
        for name in (fold.source, *fold.consumers):
            if name in solved:
                continue
            module = layer.get_submodule(name)
            changed[f"{here}{name}.weight"] = module.weight.detach().clone()
            if getattr(module, "bias", None) is not None:
                changed[f"{here}{name}.bias"] = module.bias.detach().clone()
    return changed


class _Captured(Exception):
    """Raised by the hook on layer 0 once it has its inputs: the rest of the model need not run."""


def _first_layer_inputs(model: nn.Module, first: nn.Module, windows: torch.Tensor) -> list[tuple[Any, dict]]:
    captured: list[tuple[Any, dict]] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.append((args[0] if args else kwargs.pop("hidden_states"), kwargs))
        raise _Captured

    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.inference_mode():
            for window in windows:
                with contextlib.suppress(_Captured):
                    model(input_ids=window.unsqueeze(0), use_cache=False)
    finally:
        handle.remove()
    return [(x.to(torch.float32), _float32(kwargs)) for x, kwargs in captured]


def _float32(value: Any) -> Any:
    """The layer's keyword inputs (the rotary tables, the mask) in float32, as the layers are while solved."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.float32) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_float32(item) for item in value)
    if isinstance(value, dict):
        return {key: _float32(item) for key, item in value.items()}
    return value


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and hasattr(module[0], "mlp"):
            return module
    raise InputError("model", type(model).__name__, "a decoder-only model with a list of layers (model.layers)")


def _layers_prefix(model: nn.Module, layers: nn.ModuleList) -> str:
    return next(name for name, module in model.named_modules() if module is layers)


def _input_maxima(layer: nn.Module, inputs: list) -> dict[str, torch.Tensor]:
    """The largest |x| per input channel of every linear a scale folds into (smoothing.FOLDS' consumers)."""
    maxima: dict[str, torch.Tensor] = {}

    def record(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            seen = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).to(torch.float32)
            maxima[name] = torch.maximum(maxima[name], seen) if name in maxima else seen

        return hook

    consumers = {consumer for fold in smoothing.FOLDS for consumer in fold.consumers}
    _with_hooks(layer, {name: record(name) for name in consumers}, inputs)
    return maxima


def _hessians(layer: nn.Module, linears: dict[str, nn.Linear], inputs: list) -> dict[str, Hessian]:
    hessians = {name: Hessian(module.in_features) for name, module in linears.items()}
    _with_hooks(layer, {name: (lambda module, args, h=hessians[name]: h.add(args[0])) for name in linears}, inputs)
    return hessians


def _with_hooks(layer: nn.Module, hooks: dict[str, Callable], inputs: list) -> None:
    handles = [layer.get_submodule(name).register_forward_pre_hook(hook) for name, hook in hooks.items()]
    try:
        _run_layer(layer, inputs)
    finally:
        for handle in handles:
            handle.remove()


def _run_layer(layer: nn.Module, inputs: list) -> list[tuple[Any, dict]]:
    outputs = []
    with torch.inference_mode():
        for x, kwargs in inputs:
            y = layer(x, **kwargs)
            outputs.append((y[0] if isinstance(y, tuple) else y, kwargs))
    return outputs
