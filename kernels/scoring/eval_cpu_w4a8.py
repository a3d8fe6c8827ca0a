"""`cpu_w4a8` layers as plain nn.Modules, for edge-eval: the engine's op outside the engine.

A 4-bit linear holds what kernels.vllm_plugin.cpu_w4a8 keeps on a vLLM layer after loading
(kernels.vllm_plugin.cpu_w4a8.to_w4a8 of the checkpoint's GPTQ qweight and scales) and calls the body of the op vLLM
runs (kernels.vllm_plugin.cpu_w4a8.w4a8_linear_impl: int4_scaled_mm_cpu, activations quantized to int8 per row, for
every batch). The 8-bit set (the embedding, the head: qweight int8 [N, K], scales [N]) runs
kernels.scoring.eval_cpu_int4's int8 modules, as the engine runs kernels.vllm_plugin.cpu_int4's int8 methods, and its
weights kept as a GGUF's own blocks (q6k, q8_0, q5_0) that module's BlocksLinear; a tied head shares the embedding's
tensors. The settings come from the checkpoint's quantization_config through the engine's
own parser (CpuW4A8Config.from_config).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edge.errors import InputError
from kernels.scoring.eval_cpu_int4 import BlocksLinear, Int4Settings, Int8Embedding, Int8Linear, blocks_type
from kernels.scoring.eval_gptq import gptq_parts
from kernels.scoring.eval_modules import prefix_of, replace_embedding, replace_module, submodule


class W4A8Linear(nn.Module):
    """y = x @ w.T (+ bias) through kernels.vllm_plugin.cpu_w4a8.w4a8_linear_impl, from GPTQ qweight [K/8, N], scales
    [K/g, N]."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 qzeros: torch.Tensor | None = None) -> None:  # fmt: skip
        super().__init__()
        from kernels.ops.gptq import zeros_of
        from kernels.vllm_plugin.cpu_w4a8 import to_w4a8

        # an asymmetric (gptq_v2) checkpoint's zeros; None: symmetric, zero 8
        zeros_in = None if qzeros is None else zeros_of(qzeros)
        weight, zeros, blocked_scales = to_w4a8(qweight, scales.to(torch.bfloat16), zeros_in)
        self.register_buffer("weight", weight)  # [N/32, K/g, ...] uint8, the op's blocked layout
        self.register_buffer("zeros", zeros)  # [N/32, K/g, 32] int8 (8 everywhere: symmetric)
        self.register_buffer("scales", blocked_scales)  # [N/32, K/g, 32] fp32
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.vllm_plugin.cpu_w4a8 import w4a8_linear_impl

        return w4a8_linear_impl(x, self.weight, self.zeros, self.scales, self.bias)


def install_cpu_w4a8(
    model: nn.Module, quantized: dict[str, dict[str, torch.Tensor]], qconfig: dict[str, Any], tied: bool
) -> dict[str, Any]:
    """Each GPTQ layer becomes a W4A8Linear, each int8 one (the 8-bit set) an int8 module; returns the report's
    kernel description. InputError where this host's vLLM library has no int4_scaled_mm_cpu."""
    from kernels.vllm_plugin.cpu_w4a8 import CpuW4A8Config, op_available

    config = CpuW4A8Config.from_config(qconfig)
    if not op_available():
        raise InputError("quantization_config.quant_method", "cpu_w4a8",
                         "a host whose vLLM library registers int4_scaled_mm_cpu (_C)")  # fmt: skip
    # the int8 modules read only the threshold and the rows that take the AVX2 int8 kernel
    settings = Int4Settings(config.group_size, 0, config.dequant_threshold, False, int8_rows=config.int8_rows)
    embedding_prefix = prefix_of(model, model.get_input_embeddings())
    head_prefix = prefix_of(model, model.get_output_embeddings())
    int4, int8, tied_head = [], [], None
    for prefix, parts in quantized.items():
        module = submodule(model, prefix)
        bias = getattr(module, "bias", None)
        if "blocks" in parts:  # a GGUF's own Q6_K, Q8_0 or Q5_0 blocks in the 8-bit set: a linear or an untied head
            int8.append(prefix)
            replace_module(model, prefix, BlocksLinear(parts["blocks"], blocks_type(prefix, qconfig), settings,
                                                       bias=bias))  # fmt: skip
            continue
        if parts.get("qweight") is None or parts["qweight"].dtype != torch.int8:
            if not isinstance(module, nn.Linear):
                raise InputError(f"{prefix}.qweight", type(module).__name__, "a linear layer of the source (GPTQ)")
            int4.append(prefix)
            qzeros = None if config.sym else _qzeros(prefix, parts)
            replace_module(model, prefix, W4A8Linear(*gptq_parts(prefix, parts, module, config.group_size), bias,
                                                     qzeros))  # fmt: skip
            continue
        int8.append(prefix)
        weights = (parts["qweight"], parts.get("scales"))
        if weights[1] is None:
            raise InputError(f"{prefix}.scales", "missing", "qweight and scales for each int8 layer")
        if prefix != embedding_prefix:
            replace_module(model, prefix, Int8Linear(*weights, settings, bias=bias))
            continue
        replace_embedding(model, prefix, Int8Embedding(*weights))
        if tied:
            replace_module(model, head_prefix, Int8Linear(*weights, settings))
            tied_head = "int8, the embedding's tensors"
    return {
        "kernel": "kernels.vllm_plugin.cpu_w4a8.w4a8_linear_impl (int4_scaled_mm_cpu, int8 activations per row; the "
        "body of vLLM's cpu_w4a8_linear op)"
        + (", int8_linear_impl / int8_embedding_impl for the 8-bit set" if int8 else ""),
        "group_size": config.group_size,
        "int4_layers": len(int4),
        "int8_layers": sorted(int8),
        "tied_head": tied_head,
        "quantization_config": qconfig,
    }


def _qzeros(prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """An asymmetric checkpoint's qzeros [K/g, N/8] (checked against qweight's N by the conversion)."""
    qzeros = parts.get("qzeros")
    if qzeros is None or qzeros.dtype != torch.int32:
        raise InputError(f"{prefix}.qzeros", "missing" if qzeros is None else str(qzeros.dtype),
                         "int32 zeros for each group (quantization_config.sym is false)")  # fmt: skip
    return qzeros
