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

`decode_layout` gives the same bytes in the layout the decode kernel reads best (N a multiple of 8): the codes
interleaved by 8 output channels as the int4 kernels' decode layout (kernels/ops/avx2_int4.py), and per block of 8
channels and 256 weights the 8 channels' 16 meta bytes rearranged into 128 so that one group's 8 scales and 8 mins
come out of a few vector ops (avx2_int4.cpp block8_q4k):

    meta_x8 uint8 [N/8, K/256, 128]:  fp16 d[8] | fp16 dmin[8] | 64 bytes of low nibbles (byte i: value i in bits
                                      0-3, value i+64 in bits 4-7) | 32 bytes of top bit pairs (byte i: values i,
                                      i+32, i+64, i+96 at bits 0, 2, 4, 6); value 8j+c = channel c's sc_j, 64+8j+c
                                      its m_j
"""

from __future__ import annotations

import numpy as np
import torch

from edge.model.gguf_metadata import GGML_BLOCKS

BLOCK, BLOCK_BYTES = GGML_BLOCKS["Q4_K"]  # 256 weights in the file's 144 bytes: d, dmin, 12 scale bytes, 128 of codes
META_BYTES = 16  # d, dmin and the 12 scale bytes, kept as they are


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


def k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A block's 12 scale bytes [..., 12] -> (sc, m) uint8 [..., 8], 6 bits each: as 32-bit lanes [L, H, X],
    sc_0..3 = L & 63, m_0..3 = H & 63, sc_4..7 = X's low nibbles with L's top 2 bits above them, m_4..7 = X's high
    nibbles with H's top 2 bits above them (ggml's get_scale_min_k4)."""
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc, mins


def six_bit_values(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sc, m) uint8 [N, K/256, 8] each: each sub-block's 6-bit scale and min, from the 12 bytes a block."""
    sc, mins = k_scales(meta.numpy().reshape(meta.shape[0], -1, META_BYTES)[..., 4:])
    return torch.from_numpy(sc), torch.from_numpy(mins)


def scales_and_mins(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d sc_j, dmin m_j) float32 [N, K/32] each: the scale and the subtracted min of every sub-block, exact."""
    n = meta.shape[0]
    m = meta.numpy().reshape(n, -1, META_BYTES)
    d = np.ascontiguousarray(m[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    dmin = np.ascontiguousarray(m[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    sc, mins = (t.numpy() for t in six_bit_values(meta))
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


def row_major(qweight: torch.Tensor, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_layout undone: (qweight [N, K/2], meta [N, K/256 * 16]) as from_blocks gives them; row-major pairs come
    back as they are. New tensors."""
    if qweight.dim() != 3:
        return qweight, meta
    from kernels.ops.avx2_int4 import decoded_codes

    codes = decoded_codes(qweight)  # [N, K], one code a byte
    blocks8, nb = meta.shape[0], meta.shape[1]
    d, dmin = meta[..., 0:16].reshape(blocks8, nb, X8, 2), meta[..., 16:32].reshape(blocks8, nb, X8, 2)
    low, pairs = meta[..., 32:96], meta[..., 96:128]
    nibbles = torch.cat([low & 0x0F, low >> 4], dim=-1)  # [b, block, 128]: value i
    tops = torch.cat([(pairs >> (2 * q)) & 0x03 for q in range(4)], dim=-1)  # value i's top bits at i
    values = (nibbles | (tops << 4)).view(blocks8, nb, 2, 8, X8)  # [b, block, sc|m, j, c]
    sc, mins = values[:, :, 0].permute(0, 3, 1, 2), values[:, :, 1].permute(0, 3, 1, 2)  # [b, c, block, j]
    packed = torch.zeros(blocks8, X8, nb, 12, dtype=torch.uint8)  # get_scale_min_k4's 12 bytes, inverted
    packed[..., 0:4] = (sc[..., 0:4] & 0x3F) | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = (mins[..., 0:4] & 0x3F) | ((mins[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mins[..., 4:8] & 0x0F) << 4)
    head = torch.cat([d.permute(0, 2, 1, 3), dmin.permute(0, 2, 1, 3)], dim=-1)  # [b, c, block, 4]
    rows = torch.cat([head, packed], dim=-1).reshape(blocks8 * X8, nb * META_BYTES)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), rows


def dequantize_any(qweight: torch.Tensor, meta: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dequantize for the pair row-major or in decode_layout's layout, in dtype (bf16: the float32 values rounded
    once); the decode layout in C++ where the AVX2 extension loads (kernels/ops/avx2_int4.cpp q4k_dequantize)."""
    from kernels.ops import avx2_int4

    if qweight.dim() == 3 and avx2_int4.load() is None:
        return avx2_int4.op("q4k_dequantize")(qweight, meta, dtype == torch.float32)
    return dequantize(*row_major(qweight, meta)).to(dtype)


def nbytes(n: int, k: int) -> int:
    """Bytes of the pair for an [N, K] tensor: the file's own, 144 per 256 weights."""
    return n * (k // BLOCK) * BLOCK_BYTES


X8 = 8  # output channels a block of the decode layout interleaves
X8_META_BYTES = X8 * META_BYTES  # 128: what the block's 8 channels hold in the file, rearranged


def decode_layout(qweight: torch.Tensor, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [N, K/2], meta [N, K/256 * 16]) -> (qweight [N/8, K/8, 32], meta [N/8, K/256, 128]): the same bytes
    in the decode kernel's layout (module docstring); N must be a multiple of 8. New tensors."""
    from kernels.ops.avx2_int4 import interleaved_codes

    n, half_k = qweight.shape
    if n % X8 or meta.shape != (n, half_k // 128 * META_BYTES):
        raise ValueError(f"qweight {list(qweight.shape)}, meta {list(meta.shape)}: expected [N, K/2] and "
                         f"[N, K/256 * {META_BYTES}] with N a multiple of {X8}")  # fmt: skip
    nb = half_k // 128
    raw = meta.view(n // X8, X8, nb, META_BYTES).permute(0, 2, 1, 3)  # [b, block, c, 16]
    d, dmin = raw[..., 0:2].reshape(n // X8, nb, 16), raw[..., 2:4].reshape(n // X8, nb, 16)
    sc, mins = (t.view(n // X8, X8, nb, 8).permute(0, 2, 3, 1).reshape(n // X8, nb, 64) for t in six_bit_values(meta))
    values = torch.cat([sc, mins], dim=-1)  # [b, block, 128]: 8j+c = sc_j of channel c, 64+8j+c = m_j
    low = (values[..., :64] & 0x0F) | ((values[..., 64:] & 0x0F) << 4)
    top = values >> 4
    pairs = top[..., 0:32] | (top[..., 32:64] << 2) | (top[..., 64:96] << 4) | (top[..., 96:128] << 6)
    return interleaved_codes(qweight), torch.cat([d, dmin, low, pairs], dim=-1).contiguous()


def decode_layout_(
    qweight: torch.Tensor, meta: torch.Tensor, chunk_rows: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_layout in the tensors' own storage (contiguous), chunk_rows output channels at a time (a block of 8
    channels' bytes are those rows' own), so a load holds one chunk's temporaries beyond the layer, as the int4
    kernels' avx2_int4.decode_layout_. Returns views of the same storage."""
    assert qweight.is_contiguous() and meta.is_contiguous(), "in place needs contiguous tensors"
    n, half_k = qweight.shape
    step = max(X8, chunk_rows - chunk_rows % X8)
    for r0 in range(0, n, step):
        rows = slice(r0, min(n, r0 + step))
        codes, moved = decode_layout(qweight[rows], meta[rows])
        qweight[rows].view(-1).copy_(codes.view(-1))
        meta[rows].view(-1).copy_(moved.view(-1))
    return qweight.view(n // X8, half_k // 4, 32), meta.view(n // X8, half_k // 128, X8_META_BYTES)


def int4_grid(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros) bf16 [N, K/32]: the cpu_int4 grid of the same codes (w = (q - 8) scale + zero, so scale
    = d sc_j and zero = 8 scale - dmin m_j), computed in float32 and rounded once to bf16 as
    kernels.source.gguf_source.cpu_int4_tensors writes them: what the prefill path's tinygemm buffer is built from."""
    scales, mins = scales_and_mins(meta)
    return scales.to(torch.bfloat16), (8 * scales - mins).to(torch.bfloat16)


def linear(x: torch.Tensor, qweight: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T; x [..., K] any float dtype -> [..., N] in x's dtype (the AVX2 build must load: avx2_int4). The
    pair row-major (from_blocks) or in decode_layout's layout."""
    from kernels.ops.avx2_int4 import op

    return op("q4k_linear")(x, qweight, meta)
