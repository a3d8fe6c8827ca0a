"""tinygemm buffer: chunked repack, the kernel's linear, and the direct dequantizer reading the buffer in place.

Runs on x86 and on aarch64 (scripts/test-arm: under qemu, a NEON core and a 256-bit SVE core). The block comes from
the measured host layout; where the kernel's arithmetic differs by ISA (its bf16 output), the expectation follows
platform.machine().
"""

from __future__ import annotations

import platform

import pytest
import torch

from edge.catalog.shape_rules import PACK_N_MULTIPLE
from edge.errors import InputError
from kernels.ops.int4 import dequantize, quantize_packed, unpack_nibbles
from kernels.ops.layout import TinygemmLayout, host_layout, pack_codes
from kernels.ops.tinygemm import dequantize_tinygemm, linear, scales_and_zeros, tiles, to_tinygemm

# Kernel output vs x @ dequantize().T, bf16 in and out: 52.4-52.6 dB measured here at M=8 (AVX2, 2026-11-29), 55.5-55.6
# on AVX-512 (torch 2.13.0), 49.4-49.7 on ARM, NEON and SVE256 alike, where the output is truncated to bf16 (torch
# 2.10.0 under qemu, M = 1, 8, 64, 2026-12-05); 40 dB is the brief's bf16-rounding bar.
LINEAR_SNR_FLOOR_DB = 40.0
# How tinygemm's float32 accumulators become its bf16 output, per platform.machine(): x86 rounds to nearest even,
# aarch64 truncates (drops the low 16 bits) in every element (docs/FACTS.md, "ARM under emulation").
BF16_OUTPUT_ROUNDING = {"x86_64": "nearest", "aarch64": "truncate"}
MACHINE = platform.machine()


def checkpoint(n: int, k: int, group: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    return quantize_packed(w, group)


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    noise = (reference.float() - approx.float()).pow(2).sum()
    return (10 * torch.log10(reference.float().pow(2).sum() / noise)).item()


def whole_matrix_pack(qweight: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(qweight).to(torch.int32), 1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def truncated_to_bf16(w: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 by dropping the low 16 bits of each element (the conversion itself is then exact)."""
    return (w.contiguous().view(torch.int32) & -0x10000).view(torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("n", [2048 + 32, 2048 + 16, 576])
def test_chunked_repack_equals_packing_the_whole_matrix(n):
    qweight, scales, zeros = checkpoint(n, 576, 64)
    packed, _ = to_tinygemm(qweight, scales, zeros, 64, chunk_rows=2048)
    assert torch.equal(packed, whole_matrix_pack(qweight))


def test_small_chunks_equal_packing_the_whole_matrix():
    qweight, scales, zeros = checkpoint(576, 1536, 64)
    packed, _ = to_tinygemm(qweight, scales, zeros, 64, chunk_rows=host_layout().block)
    assert torch.equal(packed, whole_matrix_pack(qweight))


def test_chunk_rows_must_be_a_multiple_of_the_block():
    qweight, scales, zeros = checkpoint(192, 576, 64)
    with pytest.raises(InputError, match="chunk_rows: expected a positive multiple"):
        to_tinygemm(qweight, scales, zeros, 64, chunk_rows=host_layout().block * 3 // 2)


def test_scales_and_zeros_interleave_per_group_and_channel():
    _, scales, zeros = checkpoint(192, 576, 64)
    interleaved = scales_and_zeros(scales, zeros)
    assert (interleaved.dtype, tuple(interleaved.shape)) == (torch.bfloat16, (9, 192, 2))
    assert interleaved[4, 100, 0] == scales[100, 4]
    assert interleaved[4, 100, 1] == zeros[100, 4]


@pytest.mark.parametrize(
    ("n", "k", "group"),
    [(576, 1536, 64), (1536, 576, 64), (1536, 576, 32), (49152, 576, 64), (2048 + 64, 576, 64)],
)
def test_direct_dequantize_is_bit_exact_with_the_row_major_dequantize(n, k, group):
    qweight, scales, zeros = checkpoint(n, k, group)
    packed, interleaved = to_tinygemm(qweight, scales, zeros, group, chunk_rows=2048)
    direct = dequantize_tinygemm(packed, interleaved, group, host_layout())
    assert same_bits(direct, dequantize(qweight, scales, zeros, group))


@pytest.mark.parametrize(("block", "nibbles"), [(64, "halves"), (32, "halves"), (16, "pairs")])
def test_direct_dequantize_reads_a_buffer_built_in_another_hosts_layout(block, nibbles):
    layout = TinygemmLayout(block, nibbles, "model", "AVX512" if block == 64 else "model")
    qweight, scales, zeros = checkpoint(1536, 576, 64)
    packed = pack_codes(unpack_nibbles(qweight), layout)  # as torch would have laid it out there
    direct = dequantize_tinygemm(packed, scales_and_zeros(scales, zeros), 64, layout)
    assert same_bits(direct, dequantize(qweight, scales, zeros, 64))


def test_direct_dequantize_in_fp32_matches_row_major():
    qweight, scales, zeros = checkpoint(576, 576, 32)
    packed, interleaved = to_tinygemm(qweight, scales, zeros, 32)
    direct = dequantize_tinygemm(packed, interleaved, 32, host_layout(), torch.float32)
    assert torch.equal(direct, dequantize(qweight, scales, zeros, 32, torch.float32))


def test_reading_the_buffer_as_the_wrong_block_gives_wrong_weights():
    """Why the layout is measured: an AVX2 buffer read as AVX-512's 64 block is garbage (docs/FACTS.md)."""
    here = host_layout()
    other = TinygemmLayout(64 if here.block != 64 else 32, "halves", "model", "model")
    qweight, scales, zeros = checkpoint(1536, 576, 64)
    packed, interleaved = to_tinygemm(qweight, scales, zeros, 64)
    wrong = dequantize_tinygemm(packed, interleaved, 64, other)
    assert not torch.equal(wrong, dequantize(qweight, scales, zeros, 64))


def test_48_channels_do_not_tile_a_32_block():
    assert not tiles(48, TinygemmLayout(32, "halves", "model", "AVX2"))
    assert tiles(1536, TinygemmLayout(32, "halves", "model", "AVX2"))
    assert not tiles(1536 + 32, TinygemmLayout(64, "halves", "model", "AVX512"))


def test_a_ragged_last_block_on_this_host_is_refused_by_the_direct_reader():
    """N = 2048 + half a block packs (N % 16 == 0) but its last block is narrower than this host's: torch packs
    it in another nibble order (kernels/ops/layout.py), so the direct reader refuses and the layer runs dual."""
    if host_layout().block // 2 % PACK_N_MULTIPLE:
        pytest.skip(f"every N torch packs (a multiple of {PACK_N_MULTIPLE}) tiles this host's block: none is ragged")
    n = 2048 + host_layout().block // 2
    qweight, scales, zeros = checkpoint(n, 576, 64)
    packed, interleaved = to_tinygemm(qweight, scales, zeros, 64)
    assert not tiles(n, host_layout())
    with pytest.raises(AssertionError, match="does not tile"):
        dequantize_tinygemm(packed, interleaved, 64, host_layout())


def test_direct_dequantize_refuses_a_layer_that_does_not_tile_the_block():
    qweight, scales, zeros = checkpoint(48, 576, 64)
    packed, interleaved = to_tinygemm(qweight, scales, zeros, 64)
    with pytest.raises(AssertionError, match="does not tile"):
        dequantize_tinygemm(packed, interleaved, 64, TinygemmLayout(32, "halves", "model", "AVX2"))


@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize(("n", "k"), [(1536, 576), (576, 1536)])
def test_tinygemm_linear_agrees_with_the_dequantized_matmul(m, n, k):
    qweight, scales, zeros = checkpoint(n, k, 64)
    packed, interleaved = to_tinygemm(qweight, scales, zeros, 64)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    reference = x.float() @ dequantize(qweight, scales, zeros, 64, torch.float32).T
    assert snr_db(reference, linear(x, packed, interleaved, 64)) > LINEAR_SNR_FLOOR_DB


def test_linear_keeps_leading_batch_dimensions():
    qweight, scales, zeros = checkpoint(192, 576, 64)
    packed, interleaved = to_tinygemm(qweight, scales, zeros, 64)
    x = torch.randn(2, 3, 576).to(torch.bfloat16)
    y = linear(x, packed, interleaved, 64)
    assert tuple(y.shape) == (2, 3, 192)
    assert torch.equal(y[1], linear(x[1], packed, interleaved, 64))


@pytest.mark.skipif(MACHINE not in BF16_OUTPUT_ROUNDING, reason=f"the kernel's bf16 output is unmeasured on {MACHINE}")
@pytest.mark.parametrize(("n", "k", "group"), [(1536, 576, 64), (576, 1536, 32)])
def test_the_kernel_itself_holds_the_weights_dequantize_computes(n, k, group):
    """One-hot rows read tinygemm's own weights out: the (q - 8) * scale + zero convention in float32, made bf16 the
    host's way; rounded to nearest on x86 that is dequantize()'s own bf16, truncated on ARM. About a quarter of the
    elements differ between the two roundings (240k of 885k here), so each host's expectation fails on the other."""
    qweight, scales, zeros = checkpoint(n, k, group)
    packed, interleaved = to_tinygemm(qweight, scales, zeros, group)
    kernel_weights = linear(torch.eye(k, dtype=torch.bfloat16), packed, interleaved, group).t()  # [N, K]
    if BF16_OUTPUT_ROUNDING[MACHINE] == "nearest":
        expected = dequantize(qweight, scales, zeros, group)
    else:
        expected = truncated_to_bf16(dequantize(qweight, scales, zeros, group, torch.float32))
    assert same_bits(kernel_weights, expected)
