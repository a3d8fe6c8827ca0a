"""A GGUF Q6_K tensor at its own size: 210 bytes per 256 weights (6.5625 bits a weight), read by
torch.ops.edge_avx2.q6k_linear (kernels/ops/avx2_int4.cpp block8_q6k) without becoming a second grid.

ggml's block_q6_K holds 256 weights as ql (128 bytes of low nibbles), qh (64 bytes of top bit pairs), 16 int8 scales
(one a sub-block of 16) and an fp16 d: w = d sc_j (q - 32), q in 0..63. `from_blocks` reads them into codes uint8
[N, K] (q, K order), sc int8 [N, K/16] and d float16 [N, K/256], exactly; `dequantize` is gguf-py's float32 value.

`decode_layout` packs 8 output channels' blocks into the kernel's layout, the same 1680 bytes (8 x 210):

    blocks uint8 [N/8, K/256, 1680]:  fp16 d[8 channels] | int8 sc[16 sub-blocks][8 channels] | per sub-block s,
                                      96 bytes: the low nibbles of weights 16s..16s+7 and 16s+8..16s+15 of the 8
                                      channels, each 8 as the int4 decode layout's chunk (32 bytes, byte 4c+t:
                                      k = 8j+t in the low nibble, 8j+4+t in the high one), then 32 bytes of top bit
                                      pairs: byte 4c+t holds those of 16s+t, 16s+4+t, 16s+8+t, 16s+12+t at bits 0,
                                      2, 4, 6

Against today's path for a Q6_K tensor (int8 codes with a float32 scale per 16, 10 bits a weight,
kernels/ops/int8.py) nothing is rounded: the scale d sc_j is applied in float32 from the file's values.
The kernel quantizes activations to int8 per group of 32, as the other decode-layout kernels.
"""

from __future__ import annotations

import numpy as np
import torch

from edge.model.gguf_metadata import GGML_BLOCKS

BLOCK, BLOCK_BYTES = GGML_BLOCKS["Q6_K"]  # 256 in 210 bytes, ggml's block_q6_K: ql 128 | qh 64 | int8 scales 16 | d
X8 = 8  # output channels a block of the decode layout interleaves
X8_BLOCK_BYTES = X8 * BLOCK_BYTES  # 1680


def from_blocks(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q6_K tensor's blocks uint8 [N, K/256, 210] (rows in HF order) -> (codes uint8 [N, K] in 0..63, sc int8
    [N, K/16], d float16 [N, K/256])."""
    if blocks.ndim != 3 or blocks.shape[2] != BLOCK_BYTES or blocks.dtype != np.uint8:
        raise ValueError(f"blocks: expected uint8 [N, K/256, {BLOCK_BYTES}], got {blocks.dtype} {list(blocks.shape)}")
    n, nb, _ = blocks.shape
    ql = blocks[..., :128].reshape(n, nb, 2, 64)  # per half of 128 weights
    qh = blocks[..., 128:192].reshape(n, nb, 2, 32)
    low = ql[..., :32], ql[..., 32:]
    # ggml's dequantize_row_q6_K: weights l, l+32, l+64, l+96 of a half from ql[l] low, ql[l+32] low, ql[l] high,
    # ql[l+32] high, with qh[l]'s bit pairs 0, 1, 2, 3 on top
    parts = [(low[0] & 0x0F) | ((qh & 0x03) << 4), (low[1] & 0x0F) | (((qh >> 2) & 0x03) << 4),
             (low[0] >> 4) | (((qh >> 4) & 0x03) << 4), (low[1] >> 4) | (((qh >> 6) & 0x03) << 4)]  # fmt: skip
    codes = np.stack(parts, axis=3).reshape(n, nb * BLOCK)  # [N, block, half, quarter, 32] in K order
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(n, nb * 16)
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16).reshape(n, nb)
    return torch.from_numpy(codes), torch.from_numpy(sc), torch.from_numpy(d)


def dequantize(codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: d sc_j (q - 32), as gguf-py's float32 dequantization of the file."""
    n, k = codes.shape
    scale = (d.float().repeat_interleave(16, dim=1) * sc.float()).view(n, k // 16, 1)
    return ((codes.float() - 32).view(n, k // 16, 16) * scale).view(n, k)


def nbytes(n: int, k: int) -> int:
    """The file's bytes for an [N, K] tensor, which the decode layout keeps: 210 per 256 weights."""
    return n * (k // BLOCK) * BLOCK_BYTES


def decode_layout(codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(codes [N, K], sc [N, K/16], d [N, K/256]) -> blocks uint8 [N/8, K/256, 1680] (module docstring); N a multiple
    of 8."""
    n, k = codes.shape
    if n % X8 or k % BLOCK or sc.shape != (n, k // 16) or d.shape != (n, k // BLOCK):
        raise ValueError(f"codes {list(codes.shape)}, sc {list(sc.shape)}, d {list(d.shape)}: expected [N, K], "
                         f"[N, K/16], [N, K/256] with N a multiple of {X8} and K of {BLOCK}")  # fmt: skip
    b, nb = n // X8, k // BLOCK
    d8 = d.view(b, X8, nb).permute(0, 2, 1).contiguous().view(torch.uint8).view(b, nb, 16)
    sc8 = sc.view(b, X8, nb, 16).permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(b, nb, 128)
    # [b, c, block, s, half j, part (lo t / hi t+4), t] -> chunks of 32 bytes per (s, j): byte 4c+t
    q = codes.view(b, X8, nb, 16, 2, 2, 4)
    nibbles = (q[..., 0, :] & 0x0F) | ((q[..., 1, :] & 0x0F) << 4)  # [b, c, block, s, j, t]
    nibbles = nibbles.permute(0, 2, 3, 4, 1, 5).reshape(b, nb, 16, 64)  # [b, block, s, (j, c, t)]
    tops = (q >> 4).permute(0, 2, 3, 4, 5, 1, 6).reshape(b, nb, 16, 4, 32)  # [b, block, s, (j, part), (c, t)]
    pairs = tops[..., 0, :] | (tops[..., 1, :] << 2) | (tops[..., 2, :] << 4) | (tops[..., 3, :] << 6)
    sub = torch.cat([nibbles, pairs], dim=-1).reshape(b, nb, 16 * 96)
    return torch.cat([d8, sc8, sub], dim=-1).contiguous()


def decode_layout_(raw: torch.Tensor, chunk_rows: int = 512) -> torch.Tensor:
    """The file's blocks as converted (uint8 [N, K/256 * 210], kernels.source.gguf_source.own_blocks) rearranged into
    decode_layout's in their own storage, chunk_rows output channels at a time (8 channels' blocks are those rows'
    bytes): a load holds one chunk's temporaries beyond the layer. Returns a [N/8, K/256, 1680] view of it."""
    assert raw.is_contiguous(), "in place needs a contiguous tensor"
    n, row_bytes = raw.shape
    step = max(X8, chunk_rows - chunk_rows % X8)
    for r0 in range(0, n, step):
        rows = raw[r0 : min(n, r0 + step)]
        blocks = rows.numpy().reshape(rows.shape[0], row_bytes // BLOCK_BYTES, BLOCK_BYTES)
        rows.view(-1).copy_(decode_layout(*from_blocks(blocks)).view(-1))
    return raw.view(n // X8, row_bytes // BLOCK_BYTES, X8_BLOCK_BYTES)


def dequantize_x8(blocks: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[N, K] in `dtype`: the weights decode_layout's blocks stand for (d sc_j (q - 32) in float32, then cast), what
    wide batches multiply by."""
    b, nb, _ = blocks.shape
    d = blocks[..., :16].contiguous().view(torch.float16).float()  # [b, block, c]
    sc = blocks[..., 16:144].contiguous().view(torch.int8).view(b, nb, 16, X8).float()  # [b, block, s, c]
    sub = blocks[..., 144:].reshape(b, nb, 16, 96)
    nibbles = sub[..., :64].reshape(b, nb, 16, 2, X8, 4)  # [b, block, s, j, c, t]
    pairs = sub[..., 64:].reshape(b, nb, 16, 1, X8, 4)  # [b, block, s, -, c, t]
    shifts = torch.arange(4, dtype=torch.uint8).view(2, 2, 1, 1)  # (j, part) -> bit pair j*2 + part
    tops = (pairs.unsqueeze(4) >> (2 * shifts)) & 0x03  # [b, block, s, j, part, c, t]
    low = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=4)  # [b, block, s, j, part, c, t]
    q = (low | (tops << 4)).float() - 32
    scale = (d.view(b, nb, 1, X8) * sc).view(b, nb, 16, 1, 1, X8, 1)
    w = (q * scale).permute(0, 5, 1, 2, 3, 4, 6)  # [b, c, block, s, j, part, t]

    return w.reshape(b * X8, nb * BLOCK).to(dtype)


def linear(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T; x [..., K] any float dtype -> [..., N] in x's dtype; blocks in decode_layout's layout (the AVX2
    build must load: avx2_int4)."""
    from kernels.ops.avx2_int4 import op

    return op("q6k_linear")(x, blocks)
