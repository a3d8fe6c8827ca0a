"""Int8 weight-only: the 8-bit set (the embedding, the head, sensitive layers, a GGUF's 5- to 8-bit tensors).

Checkpoint tensors for a weight [N, K], in one of two forms (quantization_config.int8_group_size says which):
    per channel (no int8_group_size)
        <prefix>.qweight  int8 [N, K]        symmetric codes in -127..127
        <prefix>.scales   bf16 [N]           w = q * scale
    per group of g along K (int8_group_size g, GROUP_SIZES)
        <prefix>.qweight  int8 [N, K]        symmetric codes
        <prefix>.scales   float32 [N, K/g]   w = q * scale[n, k // g]
Per channel is the layout PyTorch's `_weight_int8pack_mm(x bf16 [M, K], qweight int8 [N, K], scales bf16 [N])`
reads as is. Per group is a GGUF's own 8-bit-representable grids copied exactly (kernels.source.gguf_source
.int8_tensors: Q8_0, Q5_0 and Q4_0 at group 32, Q6_K at 16; fp16 d times a small integer, exact in float32, not
in bf16), which per-channel rounding loses: a Q5_0 row whose groups differ in range got one step for all of them
(docs/reports/2026-12-01-grid-ledger-served-decode.md). Either way nothing is repacked at load and a tied
embedding's lookups gather the same rows the head multiplies with.

Why 8 bits for these: llama.cpp keeps the output tensor and a tied embedding at 6-8 bits (Q4_K_M), Meta's
quantized Llama 3.2 keeps both at 8 bits, and the default model's own GGUF stores them as Q8_0 (docs/FACTS.md).
Speed, 49152x576 (the default model's head), 1 thread, M=1, median of 20 (AMD EPYC Zen 5, 2026-11-30):
int8 1.90 ms, bf16 3.79 ms; under ATEN_CPU_CAPABILITY=avx2: int8 2.99 ms, bf16 3.78 ms. From ~16 rows the bf16
GEMM is faster (int8 7.5 vs 5.5 ms), so wide batches dequantize (kernels.ops.int4_ops.cpu_int8_linear).
"""

from __future__ import annotations

import torch

from edge.errors import InputError
from edge.formats.int8 import INT8

MAX_CODE = 127
CHUNK_ROWS = 4096  # quantize in slices of output channels: the fp32 temporaries stay per chunk
GROUP_SIZES = INT8.group_sizes  # the format's (edge.formats.int8)
check_group = INT8.check_group


def quantize_int8(w: torch.Tensor, *, name: str = "w", group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (qweight int8 [N, K], scales): per channel (group None) bf16 [N], per group
    float32 [N, K/group]; codes rounded against the scale actually stored, so storing it adds no error."""
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise InputError(name, (w.dtype, tuple(w.shape)), "a 2-D float tensor [N, K]")
    check_group(group, w.shape[1])
    codes, scales = [], []
    for rows in w.split(CHUNK_ROWS):
        x = rows.detach().to(torch.float32)  # [chunk, K]
        if group is None:
            scale = (x.abs().amax(dim=1) / MAX_CODE).clamp(min=1e-12).to(torch.bfloat16)  # [chunk]
            stored = scale.float().unsqueeze(1)  # [chunk, 1]
        else:
            scale = (x.unflatten(1, (-1, group)).abs().amax(dim=2) / MAX_CODE).clamp(min=1e-12)  # [chunk, K/g]
            stored = scale.repeat_interleave(group, dim=1)  # [chunk, K]
        codes.append((x / stored).round_().clamp_(-MAX_CODE, MAX_CODE).to(torch.int8))
        scales.append(scale)
    return torch.cat(codes), torch.cat(scales)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(qweight int8 [N, K], scales [N] or [N, K/g]) -> w [N, K] in `dtype`, computed in fp32."""
    w = qweight.to(torch.float32)  # [N, K]
    if scales.dim() == 1:
        return (w * scales.to(torch.float32).unsqueeze(1)).to(dtype)
    group = qweight.shape[1] // scales.shape[1]
    return (w.unflatten(1, (-1, group)) * scales.to(torch.float32).unsqueeze(2)).flatten(1).to(dtype)


def check_params(qweight: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    if qweight.dim() != 2 or qweight.dtype != torch.int8:
        raise InputError(f"{name}.qweight", (qweight.dtype, tuple(qweight.shape)), "a 2-D int8 tensor [N, K]")
    n, k = qweight.shape
    if scales.dim() == 2 and scales.shape[0] == n and scales.shape[1] and k % scales.shape[1] == 0:
        check_group(k // scales.shape[1], k, name=f"{name}.scales")
        return
    if tuple(scales.shape) != (n,):
        raise InputError(f"{name}.scales", tuple(scales.shape), f"shape ({n},) or ({n}, K/g) for g in {GROUP_SIZES}")
