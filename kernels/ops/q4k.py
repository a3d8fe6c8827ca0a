"""A GGUF Q4_K tensor at its own size: 144 bytes per 256 weights (4.5 bits a weight), read by
torch.ops.edge_avx2.q4k_linear (kernels/ops/avx2_int4.cpp) without becoming a second grid.

    qweight uint8 [N, K/2]        the file's codes as cpu_int4's row-major nibbles (kernels/ops/int4.py): byte j of
                                  row n holds k=2j in its low nibble and k=2j+1 in its high one
    meta    uint8 [N, K/256 * 16] each block's first 16 bytes as the file holds them: fp16 d | fp16 dmin | 12 bytes
                                  of 6-bit (sc_j, m_j) for its 8 sub-blocks of 32 (layout: kernels/source/gguf_source)
    w[n, k] = d sc_j q - dmin m_j   (j = the sub-block of k)

So 128 + 16 bytes a block, the file's 144: the codes move within their block (the file keeps sub-block 2p in the
low nibbles of qs bytes 32p..32p+31 and 2p+1 in their high ones), the scales do not change at all. Against the
cpu_int4 grid at group 32 that today's path makes of the same tensor (bf16 scale and zero a group, 5 bits a weight)
nothing is rounded: scale d sc_j and zero dmin m_j are applied in float32 from the file's fp16 values.
The kernel quantizes activations to int8 per group of 32 (as w4a8_linear); `linear` is y = x @ w.T, and
`dequantize` the float32 weights it stands for (the tests' reference, and the prefill path's).
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 256  # weights per Q4_K block
BLOCK_BYTES = 144  # the file's: d, dmin, 12 scale bytes, 128 bytes of codes
META_BYTES = 16  # d, dmin and the 12 scale bytes, kept as they are
_SCALE_BYTES = 12


def from_blocks(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K tensor's blocks uint8 [N, K/256, 144] (rows in HF order) -> (qweight [N, K/2], meta [N, K/256 * 16])."""
    if blocks.ndim != 3 or blocks.shape[2] != BLOCK_BYTES or blocks.dtype != np.uint8:
        raise ValueError(f"blocks: expected uint8 [N, K/256, {BLOCK_BYTES}], got {blocks.dtype} {list(blocks.shape)}")
    n, nb, _ = blocks.shape
    qs = blocks[..., META_BYTES:].reshape(n, nb, 4, 32)  # [N, block, pair p, 32]
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb * BLOCK)  # K order: sub-block 2p, then 2p+1
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    meta = np.ascontiguousarray(blocks[..., :META_BYTES]).reshape(n, nb * META_BYTES)
    return torch.from_numpy(np.ascontiguousarray(qweight)), torch.from_numpy(meta)


def scales_and_mins(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d sc_j, dmin m_j) float32 [N, K/32] each: the scale and the subtracted min of every sub-block, exact."""
    n = meta.shape[0]
    m = meta.numpy().reshape(n, -1, META_BYTES)
    d = np.ascontiguousarray(m[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    dmin = np.ascontiguousarray(m[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    low, high, mixed = (m[..., 4 + 4 * i : 8 + 4 * i] for i in range(_SCALE_BYTES // 4))
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 6) << 4)], axis=-1)
    return (
        torch.from_numpy((d[..., None] * sc).reshape(n, -1)),
        torch.from_numpy((dmin[..., None] * mins).reshape(n, -1)),
    )


def dequantize(qweight: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: the weights the pair stands for, as gguf-py's float32 dequantization of the file."""
    n, half_k = qweight.shape
    codes = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).reshape(n, -1, 32).float()  # [N, K/32, 32]
    scales, mins = scales_and_mins(meta)
    return (codes * scales[..., None] - mins[..., None]).reshape(n, 2 * half_k)


def nbytes(n: int, k: int) -> int:
    """Bytes of the pair for an [N, K] tensor: the file's own, 144 per 256 weights."""
    return n * (k // BLOCK) * BLOCK_BYTES


def linear(x: torch.Tensor, qweight: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T; x [..., K] any float dtype -> [..., N] in x's dtype (the AVX2 build must load: avx2_int4)."""
    from kernels.ops.avx2_int4 import op

    return op("q4k_linear")(x, qweight, meta)
