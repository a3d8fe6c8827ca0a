"""The int8-activation decode kernel's own layout (kernels.ops.avx2_int4.decode_layout: 8 output channels
interleaved) and the kernel that reads it (edge_avx2::w4a8_linear on 3-D tensors, avx2_int4.cpp block8_a8).

The layout holds the row-major checkpoint's codes and grid unchanged (a pure-PyTorch inverse reads them back), the
kernel on it gives the int64 reference bit for bit on exact inputs (tests/kernels/test_avx2_int4.py's _exact_case)
and the row-major kernel's integer sums (so its result to fp32 summation order) on random ones, and the plugin
serves it only where nothing else reads the row-major copy.
"""

import pytest
import torch

from kernels.ops import avx2_int4
from kernels.ops.int4 import unpack_nibbles
from tests.kernels.test_avx2_int4 import _exact_case, _layer, needs_kernel


def _row_major_codes(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes from decode_layout's qweight [N/8, K/8, 32], written from its docstring's definition."""
    nb, chunks, _ = blocks.shape
    per_channel = blocks.view(nb, chunks, 8, 4)  # [b, j, c, t]
    low, high = per_channel & 0x0F, per_channel >> 4  # k = 8j + t, k = 8j + 4 + t
    codes = torch.cat((low, high), dim=-1)  # [b, j, c, 8]
    return codes.permute(0, 2, 1, 3).reshape(nb * 8, chunks * 8)


@pytest.mark.parametrize("n, k, group", [(8, 64, 32), (960, 576, 32), (64, 1536, 64), (16, 256, 128)])
def test_the_layout_holds_the_checkpoints_codes_and_grid(n, k, group):
    qweight, scales, zeros = _layer(n, k, group)
    blocks, block_scales, block_zeros = avx2_int4.decode_layout(qweight, scales, zeros, 8)
    assert blocks.shape == (n // 8, k // 8, 32) and block_scales.shape == block_zeros.shape == (n // 8, k // group, 8)
    assert blocks.nbytes + block_scales.nbytes + block_zeros.nbytes == qweight.nbytes + scales.nbytes + zeros.nbytes
    assert torch.equal(_row_major_codes(blocks), unpack_nibbles(qweight))
    assert torch.equal(block_scales.permute(0, 2, 1).reshape(n, -1), scales)
    assert torch.equal(block_zeros.permute(0, 2, 1).reshape(n, -1), zeros)
    assert avx2_int4.out_features(blocks) == avx2_int4.out_features(qweight) == n


def test_int16_activations_and_ragged_channels_keep_the_row_major_tensors(monkeypatch):
    qweight, scales, zeros = _layer(960, 576, 32)
    assert avx2_int4.decode_layout(qweight, scales, zeros, 16) == (qweight, scales, zeros)
    ragged = _layer(37, 576, 32)
    assert avx2_int4.decode_layout(*ragged, 8) == ragged
    monkeypatch.setenv(avx2_int4.LAYOUT_ENV, avx2_int4.ROW_MAJOR)
    assert avx2_int4.decode_layout(qweight, scales, zeros, 8) == (qweight, scales, zeros)


@needs_kernel
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n, k, m", [(8, 1024, 1), (64, 384, 3), (200, 2048, 2), (16, 128, 5)])
def test_integer_inputs_give_the_int64_reference_bit_for_bit(group, n, k, m):
    if k % group:
        pytest.skip(f"K={k} is not whole groups of {group}")
    x, qweight, scales, zeros, reference = _exact_case(n, k, group, m, 8, seed=n * k + group)
    tensors = avx2_int4.decode_layout(qweight, scales, zeros, 8)
    assert tensors[0].dim() == 3  # the decode layout, not the row-major tensors
    assert torch.equal(avx2_int4.linear(x, *tensors, group, 8), reference)


@needs_kernel
@pytest.mark.parametrize("n, k, group", [(960, 576, 32), (576, 576, 32), (3072, 576, 32), (576, 1536, 32),
                                         (2048, 2048, 64), (512, 1024, 128)])  # fmt: skip
@pytest.mark.parametrize("m", [1, 2, 3])
def test_random_inputs_give_the_row_major_kernels_result_to_fp32_summation_order(n, k, group, m):
    """The same activation rounding and integer sums as the row-major kernel; only the order of the fp32 sum over
    groups differs (8 lanes then a tree there, one lane a channel here)."""
    qweight, scales, zeros = _layer(n, k, group, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).float()
    row_major = avx2_int4.linear(x, qweight, scales, zeros, group, 8)
    interleaved = avx2_int4.linear(x, *avx2_int4.decode_layout(qweight, scales, zeros, 8), group, 8)
    assert interleaved.shape == (m, n)
    assert torch.allclose(interleaved, row_major, rtol=1e-5, atol=1e-5 * row_major.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("group", [32, 64])
def test_bf16_activations_give_the_fp32_result_rounded_once(group):
    """bf16 in, bf16 out: the vectorized activation rounding and the kernel's own bf16 store (round to nearest
    even, as c10) against the fp32 path, which rounds the same activations with the scalar code."""
    qweight, scales, zeros = _layer(960, 1536, group)
    tensors = avx2_int4.decode_layout(qweight, scales, zeros, 8)
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    y = avx2_int4.linear(x, *tensors, group, 8)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, avx2_int4.linear(x.float(), *tensors, group, 8).to(torch.bfloat16))
    x_half = x.to(torch.float16)
    assert avx2_int4.linear(x_half, *tensors, group, 8).dtype == torch.float16


@needs_kernel
def test_a_layout_mixed_with_row_major_scales_or_the_int16_kernel_is_refused():
    qweight, scales, zeros = _layer(64, 576, 32)
    blocks, block_scales, block_zeros = avx2_int4.decode_layout(qweight, scales, zeros, 8)
    x = torch.randn(1, 576).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="scales/zeros: expected bf16 \\[8, 18, 8\\]"):
        avx2_int4.linear(x, blocks, scales, zeros, 32, 8)
    with pytest.raises(RuntimeError, match="qweight"):
        avx2_int4.linear(x, blocks, block_scales, block_zeros, 32, 16)


@needs_kernel
def test_the_fake_implementation_reads_n_from_either_layout():
    from torch._subclasses.fake_tensor import FakeTensorMode

    qweight, scales, zeros = _layer(64, 576, 32)
    blocks = avx2_int4.decode_layout(qweight, scales, zeros, 8)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(2, 576).to(torch.bfloat16))
        fake = [mode.from_tensor(t) for t in blocks]
        assert torch.ops.edge_avx2.w4a8_linear(x, *fake, 32).shape == (2, 64)


@needs_kernel
@pytest.mark.parametrize(("layout", "interleaved"), [("direct", True), ("kernel-only", True), ("dual", False)])
def test_the_plugin_serves_the_int8_kernel_from_the_layout_where_nothing_else_reads_the_copy(layout, interleaved):
    """DUAL dequantizes wide batches from the row-major copy, so it keeps it; the others hand it to the decode
    kernel alone, in its layout. Either way a decode row gives the row-major kernel's result."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from kernels.vllm_plugin.cpu_int4 import CpuInt4Config
    from tests.kernels.test_cpu_int4 import HIDDEN, INTERMEDIATE, checkpoint, load, quant_config

    config = CpuInt4Config.from_config({**quant_config(layout), "decode_kernel": "avx2-w4a8"})
    layer = ReplicatedLinear(INTERMEDIATE, HIDDEN, bias=False, quant_config=config,
                             prefix="model.layers.0.mlp.down_proj", disable_tp=True)  # fmt: skip
    tensors = checkpoint(HIDDEN, INTERMEDIATE)
    load(layer, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    assert (layer.qweight.dim() == 3) == interleaved
    x = torch.randn(1, INTERMEDIATE, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    row_major = avx2_int4.linear(x.float(), *tensors, config.group_size, 8)
    assert torch.allclose(layer.quant_method.apply(layer, x).float(), row_major, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("n, chunk_rows", [(960, 512), (960, 64), (200, 8), (64, 1000), (72, 20)])
def test_the_in_place_conversion_rewrites_the_tensors_own_storage_chunk_by_chunk(n, chunk_rows):
    """What the plugin runs at load (no second copy of the layer): the same tensors as decode_layout, in the
    storage the checkpoint's tensors were loaded into, whatever the chunk (a chunk that is not whole blocks of 8 is
    cut to them)."""
    qweight, scales, zeros = _layer(n, 576, 32)
    expected = avx2_int4.decode_layout(qweight, scales, zeros, 8)
    pointers = [t.data_ptr() for t in (qweight, scales, zeros)]
    converted = avx2_int4.decode_layout_(qweight, scales, zeros, 8, chunk_rows)
    assert [t.data_ptr() for t in converted] == pointers
    for mine, theirs in zip(converted, expected, strict=True):
        assert torch.equal(mine, theirs)
