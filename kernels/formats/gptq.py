"""The GPTQ format's torch half (edge.formats.gptq): its converter step and the timers of vLLM's kernels that
read it, with each kernel's own repack as vLLM 0.28 does it at load."""

from __future__ import annotations

import platform
from collections.abc import Sequence
from typing import Any

import torch

from edge.formats.gptq import GPTQ
from kernels.formats.common import Absent, Builder, Run, Weights, vllm_ops
from kernels.ops.gptq import dequantize_gptq, gptq_from_codes, gptq_tensors

FORMAT = GPTQ


def convert(
    prefix: str, chunks: Sequence[torch.Tensor], qconfig: dict[str, Any], *, name: str
) -> dict[str, torch.Tensor]:
    """A weight the plan quantizes, from its output-channel chunks (symmetric, kernels.ops.gptq)."""
    parts = [gptq_tensors(prefix, rows, qconfig["group_size"]) for rows in chunks]
    # GPTQ tensors are [K/8, N], [K/g, N], [K/g, N/8]: output channels run along dim 1
    return {key: torch.cat([part[key] for part in parts], dim=1) for key in parts[0]}


def from_source(prefix: str, grid, name: str) -> dict[str, torch.Tensor]:
    """A Q4_0 tensor: its codes and d are uint4b8's, copied."""
    from kernels.source.gguf_source import gptq_codes

    return gptq_from_codes(prefix, *gptq_codes(grid, name))


def _gptq(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The project's symmetric GPTQ export (kernels.ops.gptq): qweight int32 [K/8, N], scales bf16 [K/g, N], and the
    fp32 weights they stand for."""
    tensors = gptq_tensors("w", w, group, search=False, scale_dtype=torch.bfloat16)
    return tensors["w.qweight"], tensors["w.scales"], dequantize_gptq(tensors, group)


def _isa_hint() -> str:
    """vLLM 0.28 mixed_precision/cpu.py _get_isa_hint for bf16 scales (importing that module costs 1.8 s)."""
    if torch.cpu._is_amx_tile_supported():
        return "amx"
    return "rvv" if platform.machine().startswith("riscv") else "vec"


def _vllm_wna16(w: torch.Tensor, group: int) -> Weights:
    ops = vllm_ops("cpu_gemm_wna16")
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        pack_quantized_values_into_int32,
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    qweight, scales, reference = _gptq(w, group)
    k = qweight.shape[0] * 8
    # vLLM 0.28 CPUWNA16LinearKernel._process_gptq_weights_w4a16: repack along N, blocks of 16 channels k-major.
    codes = unpack_quantized_values_into_int32(qweight, scalar_types.uint4b8, 0)  # [K, N] int32
    weight = pack_quantized_values_into_int32(codes, scalar_types.uint4b8, 1)  # [K, N/8]
    weight = weight.view(k, -1, 2).permute(1, 0, 2).reshape(-1, k * 2).contiguous()  # [N/16, 2K] int32
    hint = _isa_hint()

    def copy() -> Run:
        held, held_scales = weight.clone(), scales.clone()
        return lambda x: ops.cpu_gemm_wna16(x, held, held_scales, None, None, None, 8, hint)

    return Weights(reference, weight.nbytes + scales.nbytes, copy)


def _vllm_w4a8(w: torch.Tensor, group: int) -> Weights:
    ops = vllm_ops("convert_weight_packed_scale_zp", "int4_scaled_mm_cpu", "dynamic_scaled_int8_quant")
    from kernels.vllm_plugin.cpu_w4a8 import to_w4a8

    qweight, scales, reference = _gptq(w, group)
    # vLLM 0.28 CPUWNA16LinearKernel._process_gptq_weights_w4a8, as the plugin's cpu_w4a8 repacks at load
    blocked = to_w4a8(qweight, scales)  # weight, zeros, scales

    def copy() -> Run:
        held_w, held_z, held_s = (t.clone() for t in blocked)
        return lambda x: ops.int4_scaled_mm_cpu(x, held_w, held_z, held_s, None)

    return Weights(reference, sum(t.nbytes for t in blocked), copy)


def _kleidiai_w4a8(w: torch.Tensor, group: int) -> Weights:
    """ARM's kernel on the same checkpoint (kernels/ops/kleidiai.py), at its one group, 32, whatever the record's."""
    from kernels.ops import kleidiai

    if not kleidiai.accelerated():  # x86: torch's reference code for the ops would be timed, not KleidiAI
        raise Absent(f"torch {torch.__version__} runs _dyn_quant_matmul_4bit without KleidiAI on this CPU")
    qweight, scales, reference = _gptq(w, kleidiai.GROUP)
    n, k = w.shape
    packed = kleidiai.pack(*kleidiai.from_gptq(qweight, scales))

    def copy() -> Run:
        held = packed.clone()
        return lambda x: kleidiai.linear(x, held, k, n)

    return Weights(reference, packed.nbytes, copy)


TIMERS: dict[str, Builder] = {"vllm-wna16": _vllm_wna16, "vllm-w4a8": _vllm_w4a8, "kleidiai-w4a8": _kleidiai_w4a8}
