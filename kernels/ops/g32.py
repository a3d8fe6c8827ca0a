"""A GGUF Q8_0 or Q5_0 tensor at its own size: ggml's symmetric blocks of 32 weights with one fp16 scale d, read by
torch.ops.edge_avx2.g32_linear (kernels/ops/avx2_int4.cpp block8_g32) without becoming a second grid.

    Q8_0  34 bytes (8.5 bits a weight): fp16 d | int8 q[32]                          w = d q
    Q5_0  22 bytes (5.5 bits a weight): fp16 d | uint32 qh | qs[16], weight j's low   w = d (u - 16), u in 0..31
          4 bits in qs[j]'s low nibble and weight j+16's in its high one, weight i's fifth bit = bit i of qh

`from_blocks` reads either into (q int8 [N, K], d float16 [N, K/32]) with q the signed value (Q5_0's u - 16), exactly.
A Q5_0 tensor is a Q8_0 one with narrower codes: `q8_0_blocks` writes (q, d) as Q8_0's bytes, unrounded (the
converter does so where a Q5_0 weight shares a vLLM layer with Q8_0 ones: one layer keeps one kind of blocks).

`decode_layout` packs 8 output channels' blocks into the kernel's layout, the same bytes (8 x 34 or 8 x 22):

    blocks uint8 [N/8, K/32, 272 or 176]:  fp16 d[8 channels], then
        Q8_0:  8 vectors of 32 bytes, vector v byte 4c+t = channel c's q at k = 4v+t (int8, as the file's)
        Q5_0:  4 chunks of 32 bytes as the int4 decode layout's (byte 4c+t: the low 4 bits of u at k = 8j+t in its
               low nibble, of 8j+4+t in its high one), then 32 bytes of fifth bits: byte 4c+t, bit 2j that of
               k = 8j+t, bit 2j+1 that of 8j+4+t

Against the path the 8-bit set takes otherwise (int8 codes with a float32 scale per 16 or 32: 10 or 9 bits a
weight, kernels/ops/int8.py) nothing is rounded: d is applied in float32 from the file's fp16. The kernel quantizes
activations to int8 per group of 32, as the other decode-layout kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from edge.model.gguf_metadata import GGML_BLOCKS

X8 = 8  # output channels a block of the decode layout interleaves
BLOCK = 32


@dataclass(frozen=True)
class Kind:
    """One of the two block types: its name, file bytes a block, code bits and offset (w = d (u - offset))."""

    name: str
    bytes: int
    bits: int
    offset: int

    @property
    def x8_bytes(self) -> int:
        return X8 * self.bytes


KINDS: dict[str, Kind] = {
    "Q8_0": Kind("Q8_0", GGML_BLOCKS["Q8_0"][1], 8, 0),
    "Q5_0": Kind("Q5_0", GGML_BLOCKS["Q5_0"][1], 5, 16),
}


def kind(type_name: str) -> Kind:
    if type_name not in KINDS:
        raise ValueError(f"type_name: expected one of {tuple(KINDS)}, got {type_name!r}")
    return KINDS[type_name]


def from_blocks(type_name: str, blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor's blocks uint8 [N, K/32, 34 or 22] (rows in HF order) -> (q int8 [N, K], d float16 [N, K/32])."""
    t = kind(type_name)
    if blocks.ndim != 3 or blocks.shape[2] != t.bytes or blocks.dtype != np.uint8:
        raise ValueError(f"blocks: expected uint8 [N, K/32, {t.bytes}] for {t.name}, got {blocks.dtype} "
                         f"{list(blocks.shape)}")  # fmt: skip
    n, nb, _ = blocks.shape
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16).reshape(n, nb)
    if t.name == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, nb * BLOCK)
    else:
        qh = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [N, block, 1]
        fifth = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, block, 32]
        qs = blocks[..., 6:]
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # weights 0-15, then 16-31
        q = ((low | (fifth << 4)).astype(np.int16) - 16).astype(np.int8).reshape(n, nb * BLOCK)
    return torch.from_numpy(q), torch.from_numpy(d)


def dequantize(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: d q, as gguf-py's float32 dequantization of the file."""
    n, k = q.shape
    return (q.float().view(n, k // BLOCK, BLOCK) * d.float().view(n, k // BLOCK, 1)).view(n, k)


def q8_0_blocks(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(q int8 [N, K], d float16 [N, K/32]) as Q8_0's bytes, uint8 [N, K/32 * 34]: the same weights, the same d."""
    n, k = q.shape
    nb = k // BLOCK
    d_bytes = d.contiguous().view(torch.uint8).view(n, nb, 2)
    codes = q.contiguous().view(torch.uint8).view(n, nb, BLOCK)
    return torch.cat([d_bytes, codes], dim=-1).reshape(n, nb * KINDS["Q8_0"].bytes)


def nbytes(type_name: str, n: int, k: int) -> int:
    """The file's bytes for an [N, K] tensor, which the decode layout keeps."""
    return n * (k // BLOCK) * kind(type_name).bytes


def decode_layout(type_name: str, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(q int8 [N, K], d float16 [N, K/32]) -> blocks uint8 [N/8, K/32, 8 x bytes] (module docstring); N a multiple of
    8, q in Q5_0's range -16..15 for Q5_0."""
    t = kind(type_name)
    n, k = q.shape
    if n % X8 or k % BLOCK or d.shape != (n, k // BLOCK):
        raise ValueError(f"q {list(q.shape)}, d {list(d.shape)}: expected [N, K] and [N, K/32] with N a multiple of "
                         f"{X8} and K of {BLOCK}")  # fmt: skip
    b, nb = n // X8, k // BLOCK
    d8 = d.contiguous().view(b, X8, nb).permute(0, 2, 1).contiguous().view(torch.uint8).view(b, nb, 16)
    if t.name == "Q8_0":
        # [b, c, block, v, t] -> [b, block, v, c, t]
        codes = q.view(b, X8, nb, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8).view(b, nb, 256)
    else:
        u = (q.to(torch.int16) + 16).to(torch.uint8).view(b, X8, nb, 4, 2, 4)  # [b, c, block, j, part, t]
        nibbles = (u[..., 0, :] & 0x0F) | ((u[..., 1, :] & 0x0F) << 4)  # [b, c, block, j, t]
        nibbles = nibbles.permute(0, 2, 3, 1, 4).reshape(b, nb, 128)  # [b, block, (j, c, t)]
        fifth = (u >> 4).permute(0, 2, 1, 5, 3, 4).reshape(b, nb, X8, 4, 8)  # [b, block, c, t, (j, part)]
        bits = (fifth << torch.arange(8, dtype=torch.uint8)).sum(dim=-1, dtype=torch.uint8)  # bit 2j + part
        codes = torch.cat([nibbles, bits.reshape(b, nb, 32)], dim=-1)
    return torch.cat([d8, codes], dim=-1).contiguous()


def decode_layout_(type_name: str, raw: torch.Tensor, chunk_rows: int = 512) -> torch.Tensor:
    """The file's blocks as converted (uint8 [N, K/32 * bytes], kernels.source.gguf_source.own_blocks) rearranged
    into decode_layout's in their own storage, chunk_rows output channels at a time: a load holds one chunk's
    temporaries beyond the layer. Returns a [N/8, K/32, 8 x bytes] view of it."""
    assert raw.is_contiguous(), "in place needs a contiguous tensor"
    t = kind(type_name)
    n, row_bytes = raw.shape
    step = max(X8, chunk_rows - chunk_rows % X8)
    for r0 in range(0, n, step):
        rows = raw[r0 : min(n, r0 + step)]
        blocks = rows.numpy().reshape(rows.shape[0], row_bytes // t.bytes, t.bytes)
        rows.view(-1).copy_(decode_layout(t.name, *from_blocks(t.name, blocks)).view(-1))
    return raw.view(n // X8, row_bytes // t.bytes, t.x8_bytes)


def type_of(blocks: torch.Tensor) -> str:
    """Which type decode_layout's blocks are, from their last dimension (272: Q8_0, 176: Q5_0)."""
    for t in KINDS.values():
        if blocks.shape[-1] == t.x8_bytes:
            return t.name
    raise ValueError(f"blocks: expected [N/8, K/32, 272 or 176], got {list(blocks.shape)}")


def dequantize_x8(blocks: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[N, K] in `dtype`: the weights decode_layout's blocks stand for (d q in float32, then cast), what wide
    batches multiply by."""
    b, nb, _ = blocks.shape
    d = blocks[..., :16].contiguous().view(torch.float16).float()  # [b, block, c]
    if type_of(blocks) == "Q8_0":
        q = blocks[..., 16:].contiguous().view(torch.int8).view(b, nb, 8, X8, 4)
        q = q.permute(0, 3, 1, 2, 4)  # [b, c, block, v, t]
    else:
        nibbles = blocks[..., 16:144].reshape(b, nb, 4, X8, 4)  # [b, block, j, c, t]
        bits = blocks[..., 144:].reshape(b, nb, 1, X8, 4)
        shifts = torch.arange(8, dtype=torch.uint8).view(4, 2, 1, 1)  # (j, part) -> bit 2j + part
        fifth = (bits.unsqueeze(3) >> shifts) & 1  # [b, block, j, part, c, t]
        low = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=3)  # [b, block, j, part, c, t]
        q = ((low | (fifth << 4)).to(torch.int16) - 16).permute(0, 4, 1, 2, 3, 5)  # [b, c, block, j, part, t]
    w = q.float().reshape(b, X8, nb, BLOCK) * d.permute(0, 2, 1).unsqueeze(-1)
    return w.reshape(b * X8, nb * BLOCK).to(dtype)


def linear(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T; x [..., K] any float dtype -> [..., N] in x's dtype; blocks in decode_layout's layout (the AVX2
    build must load: avx2_int4)."""
    from kernels.ops.avx2_int4 import op

    return op("g32_linear")(x, blocks, kind(type_of(blocks)).bits)
