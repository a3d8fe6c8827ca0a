"""Finding and replacing a layer of a PyTorch model by its checkpoint prefix: what every evaluation installer
(kernels/scoring/eval_cpu_int4.py, eval_cpu_w4a8.py, eval_gptq.py) does to swap in its quantized modules."""

from __future__ import annotations

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
