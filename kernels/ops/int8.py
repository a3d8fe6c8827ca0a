"""Int8 weight-only, one scale per output channel: the 8-bit set (the embedding, the head, sensitive layers).

Checkpoint tensors for a weight [N, K]:
    <prefix>.qweight  int8 [N, K]     symmetric codes in -127..127
    <prefix>.scales   bf16 [N]        w = q * scale
The layout PyTorch's `_weight_int8pack_mm(x bf16 [M, K], qweight int8 [N, K], scales bf16 [N])` reads as is, so
nothing is repacked at load and a tied embedding's lookups gather the same rows the head multiplies with.

Why 8 bits for these: llama.cpp keeps the output tensor and a tied embedding at 6-8 bits (Q4_K_M), Meta's
quantized Llama 3.2 keeps both at 8 bits, and the default model's own GGUF stores them as Q8_0 (docs/FACTS.md).
Speed, 49152x576 (the default model's head), 1 thread, M=1, median of 20 (AMD EPYC Zen 5, 2026-11-30):
int8 1.90 ms, bf16 3.79 ms; under ATEN_CPU_CAPABILITY=avx2: int8 2.99 ms, bf16 3.78 ms. From ~16 rows the bf16
GEMM is faster (int8 7.5 vs 5.5 ms), so wide batches dequantize (kernels.ops.int4_ops.cpu_int8_linear).
"""

from __future__ import annotations

import torch

from edge.errors import InputError

MAX_CODE = 127
CHUNK_ROWS = 4096  # quantize in slices of output channels: the fp32 temporaries stay per chunk


def quantize_int8(w: torch.Tensor, *, name: str = "w") -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (qweight int8 [N, K], scales bf16 [N]); codes rounded against the bf16 scale
    actually stored, so storing the scale adds no error."""
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise InputError(name, (w.dtype, tuple(w.shape)), "a 2-D float tensor [N, K]")
    codes, scales = [], []
    for rows in w.split(CHUNK_ROWS):
        x = rows.detach().to(torch.float32)  # [chunk, K]
        scale = (x.abs().amax(dim=1) / MAX_CODE).clamp(min=1e-12).to(torch.bfloat16)  # [chunk]
        codes.append((x / scale.float().unsqueeze(1)).round_().clamp_(-MAX_CODE, MAX_CODE).to(torch.int8))
        scales.append(scale)
    return torch.cat(codes), torch.cat(scales)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(qweight int8 [N, K], scales [N]) -> w [N, K] in `dtype`, computed in fp32."""
    return (qweight.to(torch.float32) * scales.to(torch.float32).unsqueeze(1)).to(dtype)


def check_params(qweight: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    if qweight.dim() != 2 or qweight.dtype != torch.int8:
        raise InputError(f"{name}.qweight", (qweight.dtype, tuple(qweight.shape)), "a 2-D int8 tensor [N, K]")
    if tuple(scales.shape) != (qweight.shape[0],):
        raise InputError(f"{name}.scales", tuple(scales.shape), f"shape ({qweight.shape[0]},)")
