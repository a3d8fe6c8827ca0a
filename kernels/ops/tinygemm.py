"""PyTorch's CPU int4 kernel ("tinygemm"): build its buffer from a checkpoint, run it, read weights back out.

The buffer is host-specific (kernels/ops/layout.py); the checkpoint stays row-major (kernels/ops/int4.py) and is
repacked here at load time:
    packed            uint8 [N, K/2]      really [N/B][K][B/2], B = host_layout().block
    scales_and_zeros  bf16  [K/g, N, 2]   [..., 0] = scale, [..., 1] = zero; not blocked

Repacking widens every 4-bit code to int32 for `_convert_weight_to_int4pack_for_cpu`: 8x the packed size, e.g.
1024 MiB for a whole 131072x2048 tied embedding (docs/FACTS.md). So it runs over chunks of output channels;
a chunk that starts on a block boundary packs into exactly its own rows of the output, so chunks concatenate.

Chunk size, `python benchmarks/repack_chunks.py --passes 5` on this host (AVX2, torch 2.13.0, 1 thread as
vLLM runs here, 2 cores shared with other jobs so wall ~2x CPU; median of 5 interleaved passes, 2026-11-29;
transient = VmHWM growth beyond the returned tensors, glibc forced to mmap every allocation >= 64 KiB;
0.0 = below the scales_and_zeros tensor built after the loop):

    chunk rows        49152x576 (tied embedding)          11008x4096 (7B-class MLP)
                      wall ms  cpu ms  transient MiB      wall ms  cpu ms  transient MiB
    256                 602     255       0.0              1159     415       1.8
    512                 563     229       0.0              1127     426       5.8
    1024                548     237       0.9              1344     429      13.8
    2048                584     232       3.4              1387     418      31.8
    4096                558     248       8.4              1139     412      63.7
    8192                545     232      18.6              1204     434     135.7
    whole               543     236     119.8              1280     424     190.8

Time does not depend on the chunk here (CPU within 229-255 and 412-434 ms, noise), the transient grows with
it, so the default is the smallest chunk without a per-call cost: 512 rows (edge.measure.kernel_params). The reference
study (AMX, 24-32 threads, docs/FACTS.md) found 2048 fastest (79 vs 208 ms whole): with many threads a chunk
must hold enough blocks for torch's parallel_for over them, so AMX hosts take 2048.
"""

from __future__ import annotations

import torch

from edge.errors import InputError
from edge.measure import kernel_params
from kernels.ops.int4 import apply_scales, check_group, check_params, unpack_nibbles
from kernels.ops.layout import TinygemmLayout, host_layout, unpack_codes


def tiles(n: int, layout: TinygemmLayout) -> bool:
    """Whether N output channels fill whole blocks, so the direct dequantizer can read the buffer.

    A narrower last block is packed in another nibble order (kernels/ops/layout.py); keep a row-major copy instead.
    """
    return n % layout.block == 0


def to_tinygemm(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    *,
    chunk_rows: int | None = None,
    name: str = "qweight",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint tensors -> (packed uint8 [N, K/2] in the host layout, scales_and_zeros bf16 [K/g, N, 2]).

    Repacks `chunk_rows` output channels at a time (a multiple of the host block; the last chunk may be ragged),
    so the int32 transient is chunk_rows x K x 4 bytes, never the whole matrix.
    """
    n, half_k = qweight.shape
    check_params((n, 2 * half_k), scales, zeros, group, name)
    block = host_layout().block
    if chunk_rows is None:  # edge.measure.kernel_params owns the default (a checkpoint's config names its own)
        chunk_rows = kernel_params.repack_chunk_rows(amx=torch.cpu._is_amx_tile_supported(), block=block)
    if chunk_rows <= 0 or chunk_rows % block:
        raise InputError("chunk_rows", chunk_rows, f"a positive multiple of this host's tinygemm block {block}")
    packed = torch.empty(n, half_k, dtype=torch.uint8)  # [N, K/2]
    for start in range(0, n, chunk_rows):
        rows = slice(start, min(start + chunk_rows, n))
        codes = unpack_nibbles(qweight[rows], name=name).to(torch.int32)  # [chunk, K] int32: the transient
        packed[rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)  # [chunk, K/2]
        del codes
    return packed, scales_and_zeros(scales, zeros)


def scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """scales, zeros [N, K/g] -> bf16 [K/g, N, 2], the kernel's interleaved form."""
    return torch.stack((scales.t(), zeros.t()), dim=-1).to(torch.bfloat16).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """y = x @ w.T through tinygemm: x bf16 [..., K] -> [..., N] bf16."""
    check_group(group)
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group, scales_and_zeros)  # [M, N]
    return y.view(*x.shape[:-1], y.shape[-1])


def dequantize_tinygemm(
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group: int,
    layout: TinygemmLayout,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Read w [N, K] straight out of the tinygemm buffer (no row-major copy kept), in the measured layout.

    Bit-identical to kernels.ops.int4.dequantize of the checkpoint the buffer was built from. N must tile the block.
    """
    n, k = packed.shape[0], packed.shape[1] * 2
    assert tiles(n, layout), f"N={n} does not tile the {layout.block}-channel block: keep a row-major copy"
    assert scales_and_zeros.shape == (k // group, n, 2), f"scales_and_zeros {tuple(scales_and_zeros.shape)}"
    codes = unpack_codes(packed, layout)  # [N, K] uint8
    return apply_scales(codes, scales_and_zeros[..., 0].t(), scales_and_zeros[..., 1].t(), group, dtype)
