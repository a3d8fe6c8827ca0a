"""The 8-bit set's torch half (edge.formats.int8): its converter step and the timers of the kernels reading it."""

from __future__ import annotations

import torch

from edge.formats.int8 import INT8
from kernels.formats.common import Builder, Run, Weights, avx2_ops, vllm_ops
from kernels.ops.int8 import dequantize_int8, quantize_int8

FORMAT = INT8


def convert(prefix: str, tensor: torch.Tensor, group: int | None, *, name: str) -> dict[str, torch.Tensor]:
    """int8 codes [N, K] and scales: bf16 [N] per channel, float32 [N, K/g] per group."""
    qweight, scales = quantize_int8(tensor, name=name, group=group)
    return {f"{prefix}.qweight": qweight, f"{prefix}.scales": scales}


def from_source(prefix: str, grid, name: str, group: int | None) -> dict[str, torch.Tensor]:
    """A GGUF tensor on an 8-bit grid: the file's own codes and scales, not re-rounded."""
    from kernels.source.gguf_source import int8_tensors

    qweight, scales = int8_tensors(grid, name, group)
    return {f"{prefix}.qweight": qweight, f"{prefix}.scales": scales}


def from_source_blocks(prefix: str, grid, name: str, type_name: str) -> dict[str, torch.Tensor]:
    """A GGUF Q6_K, Q8_0 or Q5_0 tensor as the file's own blocks (kernels/ops/q6k.py, g32.py): `{prefix}.blocks` uint8
    [N, K/block * block bytes], rows in HF order, each row's blocks as the file holds them. A Q5_0 tensor planned as
    Q8_0 (fused with Q8_0 ones: edge.catalog.quantized_layers.WIDENS_TO) is written as Q8_0 blocks of the same
    weights."""
    from kernels.source.gguf_source import own_blocks

    held = grid.tensors[name].type
    if held == type_name:
        return {f"{prefix}.blocks": own_blocks(grid, name, type_name)}
    from kernels.ops import g32

    raw = own_blocks(grid, name, held).numpy()
    q, d = g32.from_blocks(held, raw.reshape(raw.shape[0], -1, g32.kind(held).bytes))
    assert type_name == "Q8_0", f"{name}: {held} written as {type_name}"
    return {f"{prefix}.blocks": g32.q8_0_blocks(q, d)}


def _int8(w: torch.Tensor, group: int) -> Weights:
    qweight, scales = quantize_int8(w)  # [N, K] int8, [N] bf16

    def copy() -> Run:
        held = qweight.clone()
        # torch 2.13's AVX-512 kernel segfaults on int8 weights not 64-byte aligned (kernels/ops/int4_ops.py); torch's
        # allocator aligns to 64, so a clone always is.
        assert held.data_ptr() % 64 == 0, "an unaligned int8 weight would crash _weight_int8pack_mm"
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, held, scales)

    return Weights(dequantize_int8(qweight, scales, torch.float32), qweight.nbytes + scales.nbytes, copy)


def _avx2_int8(w: torch.Tensor, group: int) -> Weights:
    """The AVX2 int8-weight kernel on the 8-bit set's format (built on first use)."""
    avx2_int4 = avx2_ops()
    qweight, scales = quantize_int8(w)  # [N, K] int8, [N] bf16

    def copy() -> Run:
        held = qweight.clone()
        return lambda x: avx2_int4.int8_linear(x, held, scales)

    return Weights(dequantize_int8(qweight, scales, torch.float32), qweight.nbytes + scales.nbytes, copy)


def _onednn_int8(w: torch.Tensor, group: int) -> Weights:
    ops = vllm_ops("create_onednn_scaled_mm_handler", "dynamic_scaled_int8_quant", "onednn_scaled_mm")
    qweight, scales = quantize_int8(w)  # [N, K] int8, [N] bf16
    # vLLM 0.28 CPUInt8ScaledMMLinearKernel.process_weights_for_onednn, dynamic per-token symmetric activations.
    weight = qweight.t()  # [K, N] view
    channel_scales = scales.float().view(-1, 1)  # [N, 1] fp32
    azp_adj = weight.sum(dim=0, keepdim=True, dtype=torch.float32) * channel_scales.squeeze()  # [1, N]

    def copy() -> Run:
        handler = ops.create_onednn_scaled_mm(weight, channel_scales, torch.bfloat16, True, False, 32)

        # The handler copies the weight but keeps a pointer to the scales: freed, they gave inf and NaN here
        # (measured 2026-11-30). The default argument keeps them alive as long as the closure.
        def run(x: torch.Tensor, _scales: torch.Tensor = channel_scales) -> torch.Tensor:
            x_q, x_scales, x_zp = ops.onednn_scaled_int8_quant(x, None, None, True)
            out = torch.empty(x.shape[0], handler.n, dtype=torch.bfloat16)
            return ops.onednn_scaled_mm(handler, x_q, out, x_scales, x_zp, azp_adj, None)

        return run

    return Weights(dequantize_int8(qweight, scales, torch.float32), qweight.nbytes, copy)


TIMERS: dict[str, Builder] = {"int8": _int8, "avx2-int8": _avx2_int8, "onednn-int8": _onednn_int8}
