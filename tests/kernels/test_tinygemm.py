"""tinygemm buffer: chunked repack, the kernel's linear, and the direct dequantizer reading the buffer in place."""

from __future__ import annotations

import pytest
import torch

from edge.errors import InputError
from kernels.ops.int4 import dequantize, quantize_packed, unpack_nibbles
from kernels.ops.layout import TinygemmLayout, host_layout, pack_codes
from kernels.ops.tinygemm import dequantize_tinygemm, linear, scales_and_zeros, tiles, to_tinygemm

# Kernel output vs x @ dequantize().T, bf16 in and out: 52.4-52.6 dB measured here at M=8 (2026-11-29);
# 40 dB is the brief's bf16-rounding bar.
LINEAR_SNR_FLOOR_DB = 40.0


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
        to_tinygemm(qweight, scales, zeros, 64, chunk_rows=host_layout().block + 16)


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


@pytest.mark.parametrize(("n", "k", "group"), [(1536, 576, 64), (576, 1536, 32)])
def test_the_kernel_itself_holds_the_weights_dequantize_computes(n, k, group):
    """One-hot rows read tinygemm's own weights out, bf16-rounded: the (q - 8) * scale + zero convention."""
    qweight, scales, zeros = checkpoint(n, k, group)
    packed, interleaved = to_tinygemm(qweight, scales, zeros, group)
    kernel_weights = linear(torch.eye(k, dtype=torch.bfloat16), packed, interleaved, group).t()  # [N, K]
    assert same_bits(kernel_weights, dequantize(qweight, scales, zeros, group))
