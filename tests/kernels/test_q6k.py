"""A Q6_K tensor at its own size (kernels/ops/q6k.py) and its decode-layout kernel, torch.ops.edge_avx2.q6k_linear.

- The codes, scales and d stand for exactly gguf-py's float32 dequantization of the blocks.
- The layout holds the file's bytes (210 per 256 weights), rearranged.
- Exact: powers of two for d, small integer activations with one +-127 a group of 32 (so the int8 rounding is the
  identity) keep every product and partial sum exact in fp32, in any order: the kernel must equal the float64
  reference bit for bit, so a top bit pair, a nibble, a scale or the -32 offset from the wrong place fails.
- Bounded: random blocks and bf16 activations, within the int8 rounding of the activations per group of 32.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernels.ops import avx2_int4, q6k

REASON = avx2_int4.load()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"AVX2 kernels unavailable here: {REASON}")


def random_blocks(n: int, k: int, seed: int, d=None) -> np.ndarray:
    """uint8 [N, K/256, 210]: random codes and int8 scales (any bytes are a valid Q6_K block); d small positive
    fp16 values, or drawn from the given choices."""
    rng = np.random.default_rng(seed)
    nb = k // 256
    blocks = rng.integers(0, 256, size=(n, nb, 210), dtype=np.uint8)
    d = rng.choice(d, (n, nb)) if d is not None else rng.random((n, nb)) * 0.001 + 1e-5
    blocks[..., 208:210] = d.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return blocks


def gguf_weights(blocks: np.ndarray) -> torch.Tensor:
    n, nb, _ = blocks.shape
    return torch.from_numpy(quants.dequantize(blocks.reshape(-1), GGMLQuantizationType.Q6_K).reshape(n, nb * 256))


@pytest.mark.parametrize("n, k", [(3, 256), (16, 1024)])
def test_the_codes_scales_and_d_are_gguf_pys_weights_bit_for_bit(n, k):
    blocks = random_blocks(n, k, seed=n)
    codes, sc, d = q6k.from_blocks(blocks)
    assert codes.shape == (n, k) and int(codes.max()) <= 63 and sc.shape == (n, k // 16) and d.shape == (n, k // 256)
    assert torch.equal(q6k.dequantize(codes, sc, d), gguf_weights(blocks))


def test_the_decode_layout_holds_the_files_bytes_rearranged():
    n, k = 16, 512
    codes, sc, d = q6k.from_blocks(random_blocks(n, k, seed=2))
    packed = q6k.decode_layout(codes, sc, d)
    assert packed.shape == (2, 2, 1680) and packed.nbytes == q6k.nbytes(n, k)
    c, blk, s = 3, 1, 5  # channel 11 (block 1, lane 3), weight block 1, sub-block 5
    row, base = 8 + c, blk * 256 + 16 * s
    assert packed[1, blk, 2 * c : 2 * c + 2].view(torch.float16).item() == d[row, blk].item()
    assert packed[1, blk, 16 + 8 * s + c].view(torch.int8).item() == sc[row, blk * 16 + s].item()
    sub = packed[1, blk, 144 + 96 * s : 144 + 96 * (s + 1)]
    for t in range(4):
        for j in range(2):
            byte = int(sub[32 * j + 4 * c + t])
            assert byte & 0x0F == int(codes[row, base + 8 * j + t]) & 0x0F
            assert byte >> 4 == int(codes[row, base + 8 * j + 4 + t]) & 0x0F
        pairs = int(sub[64 + 4 * c + t])
        for i, offset in enumerate((0, 4, 8, 12)):
            assert (pairs >> (2 * i)) & 3 == int(codes[row, base + offset + t]) >> 4


def test_the_layout_refuses_a_channel_count_that_is_not_a_multiple_of_8():
    with pytest.raises(ValueError, match="N a multiple of 8"):
        q6k.decode_layout(*q6k.from_blocks(random_blocks(12, 256, seed=0)))


@needs_kernel
@pytest.mark.parametrize("n, k, m", [(8, 256, 1), (64, 512, 2), (16, 2048, 3), (136, 256, 5)])
def test_the_kernel_equals_the_float64_reference_bit_for_bit_on_exact_inputs(n, k, m):
    blocks = random_blocks(n, k, seed=n + k + m, d=[2.0**-8, 2.0**-9])
    codes, sc, d = q6k.from_blocks(blocks)
    generator = torch.Generator().manual_seed(m)
    x = torch.randint(-7, 8, (m, k), generator=generator).float()
    x.view(m, k // 32, 32)[:, :, 0] = 127 * (1 - 2 * torch.randint(0, 2, (m, k // 32), generator=generator))
    y = q6k.linear(x, q6k.decode_layout(codes, sc, d))
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert torch.equal(y, (x.double() @ gguf_weights(blocks).double().t()).float())


@needs_kernel
@pytest.mark.parametrize("m", [1, 2])
def test_bf16_activations_stay_within_their_int8_rounding(m):
    n, k = 64, 2048
    blocks = random_blocks(n, k, seed=m)
    packed = q6k.decode_layout(*q6k.from_blocks(blocks))
    w = gguf_weights(blocks).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    half_step = x.double().abs().reshape(m, -1, 32).amax(-1) / 127 / 2  # [M, K/32]
    bound = half_step @ w.abs().reshape(n, -1, 32).sum(-1).t() + 1e-5 * (x.double().abs() @ w.abs().t())
    y = q6k.linear(x.float(), packed)
    assert ((y.double() - x.double() @ w.t()).abs() <= bound).all()
    assert torch.equal(q6k.linear(x, packed), y.to(torch.bfloat16))  # bf16 written straight, rounded once


@needs_kernel
def test_the_kernel_names_the_tensor_whose_shape_is_wrong():
    packed = q6k.decode_layout(*q6k.from_blocks(random_blocks(8, 512, seed=0)))
    with pytest.raises(RuntimeError, match=r"blocks: expected uint8 \[N/8, K/256, 1680\]"):
        q6k.linear(torch.zeros(1, 512), packed[..., :1000])
    with pytest.raises(RuntimeError, match="x: expected last dim K=512"):
        q6k.linear(torch.zeros(1, 256), packed)


def test_the_layout_made_in_place_and_dequantized_back_is_the_files_weights():
    n, k = 24, 512
    blocks = random_blocks(n, k, seed=4)
    raw = torch.from_numpy(blocks.reshape(n, -1).copy())
    storage = raw.data_ptr()
    packed = q6k.decode_layout_(raw, chunk_rows=8)
    assert packed.data_ptr() == storage and torch.equal(packed, q6k.decode_layout(*q6k.from_blocks(blocks)))
    assert torch.equal(q6k.dequantize_x8(packed, torch.float32), gguf_weights(blocks))
