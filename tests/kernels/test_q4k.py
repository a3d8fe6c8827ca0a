"""A Q4_K tensor at its own size (kernels/ops/q4k.py) and its kernel, torch.ops.edge_avx2.q4k_linear.

- The layout holds exactly the file's bytes and stands for exactly gguf-py's float32 dequantization of them.
- Exact: powers of two for d and dmin and small integer activations with one +-127 a group (so the int8 rounding
  is the identity) keep every product and partial sum exact in fp32, in any order: the kernel must equal the
  float64 reference bit for bit, so a scale decoded from the wrong bits, a code from the wrong nibble or a lost min
  fails.
- Bounded: random blocks and bf16 activations against gguf-py's weights in float64, within the int8 rounding of
  the activations per group of 32 plus fp32 ordering.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernels.ops import avx2_int4, q4k

REASON = avx2_int4.load()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"AVX2 kernels unavailable here: {REASON}")


def random_blocks(n: int, k: int, seed: int, d=None, dmin=None) -> np.ndarray:
    """uint8 [N, K/256, 144]: random codes and 6-bit scales (any bytes are a valid Q4_K block); d and dmin random
    small positive fp16 values, or drawn from the given choices."""
    rng = np.random.default_rng(seed)
    nb = k // 256
    blocks = rng.integers(0, 256, size=(n, nb, 144), dtype=np.uint8)
    d = rng.choice(d, (n, nb)) if d is not None else rng.random((n, nb)) * 0.01 + 1e-4
    dmin = rng.choice(dmin, (n, nb)) if dmin is not None else rng.random((n, nb)) * 0.01
    blocks[..., 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    blocks[..., 2:4] = dmin.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return blocks


def gguf_weights(blocks: np.ndarray) -> np.ndarray:
    n, nb, _ = blocks.shape
    return quants.dequantize(blocks.reshape(-1), GGMLQuantizationType.Q4_K).reshape(n, nb * 256)


@pytest.mark.parametrize("n, k", [(5, 256), (64, 1024), (3, 5632)])
def test_the_layout_holds_the_files_bytes_and_stands_for_gguf_pys_weights_bit_for_bit(n, k):
    blocks = random_blocks(n, k, seed=n)
    qweight, meta = q4k.from_blocks(blocks)
    assert qweight.shape == (n, k // 2) and meta.shape == (n, k // 16)
    assert qweight.nbytes + meta.nbytes == blocks.nbytes == q4k.nbytes(n, k)
    assert torch.equal(q4k.dequantize(qweight, meta), torch.from_numpy(gguf_weights(blocks)))


def test_from_blocks_refuses_what_is_not_q4_k_blocks():
    with pytest.raises(ValueError, match=r"blocks: expected uint8 \[N, K/256, 144\]"):
        q4k.from_blocks(np.zeros((4, 2, 210), dtype=np.uint8))  # Q6_K's block size


def exact_case(n: int, k: int, m: int, seed: int):
    blocks = random_blocks(n, k, seed, d=[2.0**-6, 2.0**-7], dmin=[2.0**-6, 2.0**-7])
    qweight, meta = q4k.from_blocks(blocks)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-7, 8, (m, k), generator=generator).float()
    x.view(m, k // 32, 32)[:, :, 0] = 127 * (1 - 2 * torch.randint(0, 2, (m, k // 32), generator=generator))
    return x, qweight, meta, torch.from_numpy(gguf_weights(blocks))


@needs_kernel
@pytest.mark.parametrize("n, k, m", [(64, 512, 1), (37, 256, 2), (9, 512, 3), (130, 256, 5)])
def test_the_kernel_equals_the_float64_reference_bit_for_bit_on_exact_inputs(n, k, m):
    x, qweight, meta, w = exact_case(n, k, m, seed=n + k + m)
    reference = (x.double() @ w.double().t()).float()
    y = q4k.linear(x, qweight, meta)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert torch.equal(y, reference)


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 4])
def test_bf16_activations_stay_within_their_int8_rounding(m):
    n, k = 96, 2048
    blocks = random_blocks(n, k, seed=m)
    qweight, meta = q4k.from_blocks(blocks)
    w = torch.from_numpy(gguf_weights(blocks)).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    reference = x.double() @ w.t()
    half_step = x.double().abs().reshape(m, -1, 32).amax(-1) / 127 / 2  # [M, K/32]
    bound = half_step @ w.abs().reshape(n, -1, 32).sum(-1).t() + 1e-5 * (x.double().abs() @ w.abs().t())
    y = q4k.linear(x, qweight, meta)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, q4k.linear(x.float(), qweight, meta).to(torch.bfloat16))  # fp32 rounded once
    assert ((q4k.linear(x.float(), qweight, meta).double() - reference).abs() <= bound).all()


def test_the_decode_layout_holds_the_same_bytes_rearranged():
    n, k = 16, 512
    blocks = random_blocks(n, k, seed=3)
    qweight, meta = q4k.from_blocks(blocks)
    codes, meta_x8 = q4k.decode_layout(qweight, meta)
    assert codes.shape == (n // 8, k // 8, 32) and meta_x8.shape == (n // 8, k // 256, 128)
    assert codes.nbytes + meta_x8.nbytes == q4k.nbytes(n, k)
    # channel 5 of block 1, weight block 1: its d and dmin, and sub-block 6's scale and min, where the layout says
    c, blk, j = 5, 1, 6
    d, dmin = meta_x8[1, blk, 2 * c : 2 * c + 2], meta_x8[1, blk, 16 + 2 * c : 16 + 2 * c + 2]
    assert d.tolist() == blocks[8 + c, blk, 0:2].tolist() and dmin.tolist() == blocks[8 + c, blk, 2:4].tolist()
    sc, mins = q4k.six_bit_values(meta)
    for value, want in ((8 * j + c, sc[8 + c, blk, j]), (64 + 8 * j + c, mins[8 + c, blk, j])):
        low = meta_x8[1, blk, 32 + value % 64] >> (4 * (value // 64)) & 0x0F
        top = meta_x8[1, blk, 96 + value % 32] >> (2 * (value // 32)) & 0x03
        assert int(low | top << 4) == int(want)


def test_decode_layout_refuses_a_channel_count_that_is_not_a_multiple_of_8():
    qweight, meta = q4k.from_blocks(random_blocks(12, 256, seed=0))
    with pytest.raises(ValueError, match="N a multiple of 8"):
        q4k.decode_layout(qweight, meta)


@needs_kernel
@pytest.mark.parametrize("n, k, m", [(64, 512, 1), (8, 256, 2), (16, 2048, 3), (136, 256, 5)])
def test_the_decode_layout_kernel_equals_the_float64_reference_bit_for_bit(n, k, m):
    x, qweight, meta, w = exact_case(n, k, m, seed=n + k + m)
    reference = (x.double() @ w.double().t()).float()
    y = q4k.linear(x, *q4k.decode_layout(qweight, meta))
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert torch.equal(y, reference)


@needs_kernel
@pytest.mark.parametrize("m", [1, 3])
def test_the_decode_layout_kernel_gives_the_row_major_kernels_numbers_in_bf16(m):
    n, k = 96, 2048
    qweight, meta = q4k.from_blocks(random_blocks(n, k, seed=m))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    x8 = q4k.decode_layout(qweight, meta)
    y = q4k.linear(x, *x8)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # the same integer sums and fp32 scale products, summed in another order: equal within fp32 ordering
    torch.testing.assert_close(q4k.linear(x.float(), *x8), q4k.linear(x.float(), qweight, meta), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, q4k.linear(x.float(), *x8).to(torch.bfloat16))  # written as bf16 straight, rounded once


@needs_kernel
def test_the_kernel_names_the_tensor_whose_shape_is_wrong():
    qweight, meta = q4k.from_blocks(random_blocks(4, 512, seed=0))
    with pytest.raises(RuntimeError, match=r"meta: expected uint8 \[4, 32\]"):
        q4k.linear(torch.zeros(1, 512), qweight, meta[:, :16])
    with pytest.raises(RuntimeError, match="x: expected last dim K=512"):
        q4k.linear(torch.zeros(1, 256), qweight, meta)
    with pytest.raises(RuntimeError, match="qweight: expected uint8 .N, K/2. with K a multiple of 256"):
        q4k.linear(torch.zeros(1, 192), qweight[:, :96], meta)
    codes, meta_x8 = q4k.decode_layout(*q4k.from_blocks(random_blocks(8, 512, seed=0)))
    with pytest.raises(RuntimeError, match=r"meta: expected uint8 \[1, 2, 128\]"):
        q4k.linear(torch.zeros(1, 512), codes, meta_x8[:, :1])


# --- the blocks dequantized in their decode layout (a Q4_K layer holding no tinygemm buffer) -------------------------


@pytest.mark.parametrize(("n", "k"), [(8, 256), (64, 512), (576, 1536)])
def test_undoing_the_decode_layout_gives_the_pair_back(n, k):
    qweight, meta = q4k.from_blocks(random_blocks(n, k, seed=n + k))
    back = q4k.row_major(*q4k.decode_layout(qweight, meta))
    assert torch.equal(back[0], qweight) and torch.equal(back[1], meta)


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(8, 256), (64, 512), (576, 1536)])
def test_the_decode_layout_dequantizes_to_gguf_pys_float32_weights_bit_for_bit(n, k):
    blocks = random_blocks(n, k, seed=n * k)
    qweight, meta = q4k.from_blocks(blocks)
    laid = q4k.decode_layout(qweight, meta)
    expected = torch.from_numpy(gguf_weights(blocks))
    assert torch.equal(q4k.dequantize_any(*laid, torch.float32), expected)  # C++
    assert torch.equal(q4k.dequantize_any(*laid, torch.bfloat16), expected.to(torch.bfloat16))


@needs_kernel
def test_the_q4_k_dequantizer_names_meta_of_the_wrong_shape():
    qweight, meta = q4k.decode_layout(*q4k.from_blocks(random_blocks(8, 256, seed=1)))
    with pytest.raises(RuntimeError, match=r"meta: expected uint8 \[1, 1, 128\]"):
        avx2_int4.op("q4k_dequantize")(qweight, meta[..., :64], False)
