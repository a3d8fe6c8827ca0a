"""GPTQ (`w4a8-gptq`) layers as plain nn.Modules, for edge-eval: vLLM's own CPU kernel class where this host's
vLLM library has its op, else an exact dequantized reference.

vLLM 0.28 serves a GPTQ linear through CPUWNA16LinearKernel (vllm/model_executor/kernels/linear/mixed_precision/
cpu.py): `process_weights_after_loading` repacks the checkpoint's qweight and chooses W4A8
(`int4_scaled_mm_cpu`, int8 activations) when the CPU has AMX tiles, else W4A16 (`cpu_gemm_wna16`). Here that
class is instantiated on a small module holding the checkpoint's tensors, with the config vLLM's
AutoGPTQLinearMethod gives it (uint4b8, bf16 activations, no zero points, no g_idx), and its own
`apply_weights` runs the forward: the same repack, the same choice, the same op.

The ops live in the library vLLM loads for the CPU (FACTS.md): `_C` and `_C_AVX512` have `cpu_gemm_wna16`,
`_C_AVX2` has no 4-bit GEMM at all (vLLM fails at run time there). On such a host the layers run the
"dequantized reference": w = (q - 8) * scale in fp32 (kernels.ops.gptq.dequantize_gptq, exact: a 4-bit code times a
bf16 scale fits fp32), an fp32 GEMM, bf16 out. The report's `kernel` field says which ran.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edge.errors import InputError
from kernels.ops.gptq import GROUP_SIZES, PACK, dequantize_gptq
from kernels.scoring.eval_modules import replace_module, submodule

REFERENCE = "dequantized reference"


def vllm_has_op() -> bool:
    """Whether the native library vLLM loaded on this CPU has the W4A16 GPTQ op."""
    import vllm._custom_ops  # noqa: F401  (loads _C, _C_AVX512 or _C_AVX2 by the CPU flags)

    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def check_config(qconfig: dict[str, Any]) -> int:
    """The group size, after checking the fields vLLM's CPU GPTQ path depends on."""
    wanted = {"bits": 4, "sym": True}
    for key, value in wanted.items():
        if qconfig.get(key, value) != value:
            raise InputError(f"quantization_config.{key}", qconfig.get(key), f"{value!r} (uint4b8, vLLM CPU GPTQ)")
    if qconfig.get("desc_act"):
        raise InputError("quantization_config.desc_act", True, "false (edge-eval runs no act-order g_idx)")
    group = qconfig.get("group_size")
    if group not in GROUP_SIZES:
        raise InputError("quantization_config.group_size", group, f"one of {list(GROUP_SIZES)}")
    return group


class VllmGptqLinear(nn.Module):
    """y = x @ w.T through vLLM's CPUWNA16LinearKernel, from qweight int32 [K/8, N] and scales [K/g, N]."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, group: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel
        from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
        from vllm.model_executor.utils import set_weight_attrs
        from vllm.scalar_type import scalar_types

        k, n = qweight.shape[0] * PACK, qweight.shape[1]
        config = MPLinearLayerConfig(
            full_weight_shape=(k, n), partition_weight_shape=(k, n), weight_type=scalar_types.uint4b8,
            act_type=torch.bfloat16, group_size=group, zero_points=False, has_g_idx=False,
        )  # fmt: skip
        ok, why = CPUWNA16LinearKernel.can_implement(config)
        if not ok:
            raise InputError("GPTQ layer", f"[N, K] = [{n}, {k}]", f"a shape vLLM's CPU kernel takes ({why})")
        self.kernel = CPUWNA16LinearKernel(config, w_q_param_name="qweight", w_s_param_name="scales",
                                           w_zp_param_name="qzeros", w_gidx_param_name="g_idx")  # fmt: skip
        self.qweight = nn.Parameter(qweight.clone(), requires_grad=False)  # [K/8, N] int32
        set_weight_attrs(self.qweight, {"input_dim": 0, "output_dim": 1, "packed_dim": 0})
        self.scales = nn.Parameter(scales.to(torch.bfloat16), requires_grad=False)  # [K/g, N]
        set_weight_attrs(self.scales, {"input_dim": 0, "output_dim": 1})
        self.qzeros = None  # zero_points=False: vLLM drops the checkpoint's qzeros (kernels/ops/gptq.py)
        self.g_idx = None
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.out_features = n
        self.kernel.process_weights_after_loading(self)  # repacks in place; sets use_w4a8 and isa_hint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()  # [M, K]
        y = self.kernel.apply_weights(self, x2, self.bias)  # [M, N]
        return y.view(*x.shape[:-1], self.out_features)


class ReferenceGptqLinear(nn.Module):
    """y = x @ w.T with w = (q - 8) * scale exact in fp32; fp32 GEMM, bf16 out."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, group: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = dequantize_gptq({"layer.qweight": qweight, "layer.scales": scales}, group)  # [N, K] fp32
        self.register_buffer("weight", weight)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.float(), self.weight, self.bias).to(torch.bfloat16)


def install_gptq(model: nn.Module, quantized: dict[str, dict[str, torch.Tensor]], qconfig: dict[str, Any]) -> dict:
    """Replace each quantized linear of `model` by a GPTQ module; returns the report's kernel description."""
    group = check_config(qconfig)
    native = vllm_has_op()
    layer_class = VllmGptqLinear if native else ReferenceGptqLinear
    kinds = set()
    for prefix, parts in quantized.items():
        module = submodule(model, prefix)
        if not isinstance(module, nn.Linear):
            raise InputError(f"{prefix}.qweight", type(module).__name__, "a linear layer of the source (GPTQ)")
        qweight, scales = gptq_parts(prefix, parts, module, group)
        layer = layer_class(qweight, scales, group, module.bias)
        if native:
            kinds.add("int4_scaled_mm_cpu (W4A8)" if layer.use_w4a8 else "cpu_gemm_wna16 (W4A16)")
        replace_module(model, prefix, layer)
    kernel = f"vLLM CPUWNA16LinearKernel: {', '.join(sorted(kinds))}" if native else REFERENCE
    return {"kernel": kernel, "group_size": group, "quantized_layers": len(quantized), "quantization_config": qconfig}


def gptq_parts(prefix: str, parts: dict[str, torch.Tensor], module: nn.Linear, group: int) -> tuple:
    n, k = module.out_features, module.in_features
    groups = 1 if group == -1 else k // group
    expected = {"qweight": ((k // PACK, n), torch.int32), "scales": ((groups, n), None)}
    for suffix, (shape, dtype) in expected.items():
        tensor = parts.get(suffix)
        if tensor is None:
            raise InputError(f"{prefix}.{suffix}", "missing", "qweight and scales for each GPTQ layer")
        if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype):
            raise InputError(f"{prefix}.{suffix}", f"{tensor.dtype} {list(tensor.shape)}",
                             f"{list(shape)} for the source's [N, K] = [{n}, {k}], group_size {group}")  # fmt: skip
    return parts["qweight"], parts["scales"]
