"""A Q8_0 or Q5_0 tensor at its own size (kernels/ops/g32.py) and its decode-layout kernel,
torch.ops.edge_avx2.g32_linear.

- The codes and d stand for exactly gguf-py's float32 dequantization of the blocks; a Q5_0 tensor written as Q8_0
  blocks is the same weights.
- The layout holds the file's bytes (34 or 22 per 32 weights), rearranged.
- Exact: powers of two for d, small integer activations with one +-127 a group of 32 (so the int8 rounding is the
  identity) keep every product and partial sum exact in fp32, in any order: the kernel must equal the float64
  reference bit for bit, so a fifth bit, a nibble, a d or the offset from the wrong place fails.
- Bounded: random blocks and bf16 activations, within the int8 rounding of the activations per group of 32.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernels.ops import avx2_int4, g32

REASON = avx2_int4.load()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"AVX2 kernels unavailable here: {REASON}")
TYPES = ("Q8_0", "Q5_0")


def random_blocks(type_name: str, n: int, k: int, seed: int, d=None) -> np.ndarray:
    """uint8 [N, K/32, bytes]: random codes (any bytes are a valid block's codes); d small positive fp16 values, or
    drawn from the given choices."""
    rng = np.random.default_rng(seed)
    nb, size = k // 32, g32.kind(type_name).bytes
    blocks = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    d = rng.choice(d, (n, nb)) if d is not None else rng.random((n, nb)) * 0.001 + 1e-5
    blocks[..., :2] = d.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return blocks


def gguf_weights(type_name: str, blocks: np.ndarray) -> torch.Tensor:
    n, nb, _ = blocks.shape
    values = quants.dequantize(blocks.reshape(-1), GGMLQuantizationType[type_name])
    return torch.from_numpy(values.reshape(n, nb * 32))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n, k", [(3, 32), (16, 576)])
def test_the_codes_and_d_are_gguf_pys_weights_bit_for_bit(type_name, n, k):
    blocks = random_blocks(type_name, n, k, seed=n)
    q, d = g32.from_blocks(type_name, blocks)
    assert q.shape == (n, k) and q.dtype == torch.int8 and d.shape == (n, k // 32)
    if type_name == "Q5_0":
        assert int(q.min()) >= -16 and int(q.max()) <= 15
    assert torch.equal(g32.dequantize(q, d), gguf_weights(type_name, blocks))


def test_a_q5_0_tensor_as_q8_0_blocks_is_the_same_weights():
    blocks = random_blocks("Q5_0", 24, 576, seed=3)
    widened = g32.q8_0_blocks(*g32.from_blocks("Q5_0", blocks)).numpy()
    assert widened.shape == (24, 18 * 34)
    assert torch.equal(gguf_weights("Q8_0", widened.reshape(24, 18, 34)), gguf_weights("Q5_0", blocks))


@pytest.mark.parametrize("type_name", TYPES)
def test_the_decode_layout_holds_the_files_bytes_rearranged(type_name):
    n, k = 16, 96
    q, d = g32.from_blocks(type_name, random_blocks(type_name, n, k, seed=2))
    packed = g32.decode_layout(type_name, q, d)
    assert packed.shape == (2, 3, g32.kind(type_name).x8_bytes) and packed.nbytes == g32.nbytes(type_name, n, k)
    c, blk = 3, 1  # channel 11 (block 1, lane 3), weight block 1
    row, base = 8 + c, 32 * blk
    codes = packed[1, blk]
    assert codes[2 * c : 2 * c + 2].view(torch.float16).item() == d[row, blk].item()
    for t in range(4):
        if type_name == "Q8_0":
            for v in range(8):
                assert codes[16 + 32 * v + 4 * c + t].view(torch.int8).item() == int(q[row, base + 4 * v + t])
            continue
        bits = int(codes[144 + 4 * c + t])
        for j in range(4):
            byte = int(codes[16 + 32 * j + 4 * c + t])
            for part in range(2):
                u = int(q[row, base + 8 * j + 4 * part + t]) + 16
                assert (byte >> (4 * part)) & 0x0F == u & 0x0F
                assert (bits >> (2 * j + part)) & 1 == u >> 4


def test_the_layout_refuses_a_channel_count_that_is_not_a_multiple_of_8():
    with pytest.raises(ValueError, match="N a multiple of 8"):
        g32.decode_layout("Q8_0", *g32.from_blocks("Q8_0", random_blocks("Q8_0", 12, 32, seed=0)))


@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n, k, m", [(8, 32, 1), (64, 576, 2), (16, 2048, 3), (136, 96, 5)])
def test_the_kernel_equals_the_float64_reference_bit_for_bit_on_exact_inputs(type_name, n, k, m):
    blocks = random_blocks(type_name, n, k, seed=n + k + m, d=[2.0**-8, 2.0**-9])
    q, d = g32.from_blocks(type_name, blocks)
    generator = torch.Generator().manual_seed(m)
    x = torch.randint(-7, 8, (m, k), generator=generator).float()
    x.view(m, k // 32, 32)[:, :, 0] = 127 * (1 - 2 * torch.randint(0, 2, (m, k // 32), generator=generator))
    y = g32.linear(x, g32.decode_layout(type_name, q, d))
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert torch.equal(y, (x.double() @ gguf_weights(type_name, blocks).double().t()).float())


@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 2])
def test_bf16_activations_stay_within_their_int8_rounding(type_name, m):
    n, k = 64, 1536
    blocks = random_blocks(type_name, n, k, seed=m)
    packed = g32.decode_layout(type_name, *g32.from_blocks(type_name, blocks))
    w = gguf_weights(type_name, blocks).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    half_step = x.double().abs().reshape(m, -1, 32).amax(-1) / 127 / 2  # [M, K/32]
    bound = half_step @ w.abs().reshape(n, -1, 32).sum(-1).t() + 1e-5 * (x.double().abs() @ w.abs().t())
    y = g32.linear(x.float(), packed)
    assert ((y.double() - x.double() @ w.t()).abs() <= bound).all()
    assert torch.equal(g32.linear(x, packed), y.to(torch.bfloat16))  # bf16 written straight, rounded once


@needs_kernel
def test_the_kernel_names_the_tensor_whose_shape_is_wrong():
    packed = g32.decode_layout("Q5_0", *g32.from_blocks("Q5_0", random_blocks("Q5_0", 8, 64, seed=0)))
    with pytest.raises(RuntimeError, match=r"blocks: expected uint8 \[N/8, K/32, 272\]"):
        torch.ops.edge_avx2.g32_linear(torch.zeros(1, 64), packed, 8)
    with pytest.raises(RuntimeError, match="x: expected last dim K=64"):
        g32.linear(torch.zeros(1, 32), packed)
    with pytest.raises(RuntimeError, match="bits: expected 8 .Q8_0. or 5 .Q5_0., got 4"):
        torch.ops.edge_avx2.g32_linear(torch.zeros(1, 64), packed, 4)


@pytest.mark.parametrize("type_name", TYPES)
def test_the_layout_made_in_place_and_dequantized_back_is_the_files_weights(type_name):
    n, k = 24, 576
    blocks = random_blocks(type_name, n, k, seed=4)
    raw = torch.from_numpy(blocks.reshape(n, -1).copy())
    storage = raw.data_ptr()
    packed = g32.decode_layout_(type_name, raw, chunk_rows=8)
    assert packed.data_ptr() == storage
    assert torch.equal(packed, g32.decode_layout(type_name, *g32.from_blocks(type_name, blocks)))
    assert g32.type_of(packed) == type_name
    assert torch.equal(g32.dequantize_x8(packed, torch.float32), gguf_weights(type_name, blocks))


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q6_K"])
def test_the_c_plus_plus_dequantize_wide_batches_run_is_the_layouts_weights_bit_for_bit(type_name):
    """edge_avx2::blocks_dequantize (what a wide batch multiplies by) gives dequantize_x8's bf16 values exactly."""
    from kernels.ops import q6k
    from tests.kernels import test_q6k

    if type_name == "Q6_K":
        packed = q6k.decode_layout(*q6k.from_blocks(test_q6k.random_blocks(24, 512, seed=8)))
        reference = q6k.dequantize_x8(packed)
    else:
        packed = g32.decode_layout(type_name, *g32.from_blocks(type_name, random_blocks(type_name, 24, 576, seed=8)))
        reference = g32.dequantize_x8(packed)
    assert torch.equal(torch.ops.edge_avx2.blocks_dequantize(packed), reference)
    with pytest.raises(RuntimeError, match=r"blocks: expected uint8 \[N/8, K/block, 1680 \(Q6_K\), 272"):
        torch.ops.edge_avx2.blocks_dequantize(packed[..., :100])
