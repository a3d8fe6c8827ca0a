"""int4 checkpoint format: min/max group quantization, nibble packing, row-major dequantization.

Shapes are SmolLM2-135M's (hidden 576, intermediate 1536, kv projection 3 heads x 64 = 192).
"""

from __future__ import annotations

import pytest
import torch

from edge.errors import InputError
from kernels.ops.int4 import dequantize, pack_nibbles, quantize, quantize_packed, unpack_nibbles

# SQNR of quantize -> dequantize on N(0, 0.02) weights, measured 2026-11-29 here over seeds 0-2 and all four
# shapes: group 32: 22.09-22.14 dB, 64: 20.94-20.96 dB, 128: 20.02-20.03 dB. Floors sit 0.5 dB below.
SQNR_FLOOR_DB = {32: 21.5, 64: 20.5, 128: 19.5}
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
CASES = [(n, k, g) for g in (32, 64, 128) for n, k in SHAPES if k % g == 0]


def sqnr_db(signal: torch.Tensor, approx: torch.Tensor) -> float:
    noise = (signal.float() - approx.float()).pow(2).sum()
    return (10 * torch.log10(signal.float().pow(2).sum() / noise)).item()


def smollm_like(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02


@pytest.mark.parametrize(("n", "k", "group"), CASES)
def test_round_trip_sqnr_stays_above_the_measured_floor(n, k, group):
    w = smollm_like(n, k)
    qweight, scales, zeros = quantize_packed(w, group)
    assert sqnr_db(w, dequantize(qweight, scales, zeros, group)) > SQNR_FLOOR_DB[group]


def test_quantize_returns_codes_scales_zeros_in_the_checkpoint_dtypes_and_shapes():
    codes, scales, zeros = quantize(smollm_like(576, 1536), 64)
    assert (codes.dtype, tuple(codes.shape)) == (torch.uint8, (576, 1536))
    assert int(codes.max()) <= 15
    assert (scales.dtype, tuple(scales.shape)) == (torch.bfloat16, (576, 24))
    assert (zeros.dtype, tuple(zeros.shape)) == (torch.bfloat16, (576, 24))


def test_dequantize_follows_the_tinygemm_convention_q_minus_8_times_scale_plus_zero():
    codes = torch.arange(16, dtype=torch.uint8).repeat(32, 4)  # [32, 64]: every code in both groups of 32
    scales = torch.tensor([[0.5, 2.0]], dtype=torch.bfloat16).repeat(32, 1)  # [32, 2]
    zeros = torch.tensor([[1.0, -3.0]], dtype=torch.bfloat16).repeat(32, 1)
    w = dequantize(pack_nibbles(codes), scales, zeros, 32, torch.float32)
    expected_first_group = (torch.arange(16.0) - 8) * 0.5 + 1.0
    expected_second_group = (torch.arange(16.0) - 8) * 2.0 - 3.0
    assert torch.equal(w[0, :16], expected_first_group)
    assert torch.equal(w[0, 32:48], expected_second_group)


def test_a_constant_group_dequantizes_to_its_value():
    w = torch.full((16, 64), 0.125)
    assert torch.equal(dequantize(*quantize_packed(w, 64), 64, torch.float32), w)


def test_quantize_spans_each_group_min_to_max():
    w = smollm_like(192, 576)
    codes, _, _ = quantize(w, 64)
    groups = codes.view(192, 9, 64)
    assert int(groups.amin(-1).max()) == 0
    assert int(groups.amax(-1).min()) == 15


def test_pack_puts_even_k_in_the_low_nibble_and_odd_k_in_the_high_nibble():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x43]]


def test_unpack_inverts_pack():
    codes = torch.randint(0, 16, (576, 1536), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = pack_nibbles(codes)
    assert tuple(packed.shape) == (576, 768)
    assert torch.equal(unpack_nibbles(packed), codes)


def test_k_not_divisible_by_group_names_the_tensor_and_the_group():
    with pytest.raises(InputError, match=r"model\.up_proj: expected K \(dim 1\) divisible by group 64") as error:
        quantize(torch.zeros(64, 100), 64, name="model.up_proj")
    assert error.value.field == "model.up_proj"


def test_smollm_hidden_576_does_not_take_group_128():
    with pytest.raises(InputError, match="divisible by group 128"):
        quantize(smollm_like(576, 576), 128)


def test_n_not_divisible_by_16_cannot_be_packed_for_tinygemm():
    with pytest.raises(InputError, match=r"N \(dim 0\) divisible by 16"):
        quantize(torch.zeros(40, 64), 32)


def test_odd_k_cannot_be_packed():
    with pytest.raises(InputError, match=r"K \(dim 1\) even") as error:
        pack_nibbles(torch.zeros(16, 33, dtype=torch.uint8))
    assert error.value.field == "codes"


def test_group_sizes_tinygemm_does_not_run_are_refused():
    with pytest.raises(InputError, match="group: expected one of"):
        quantize(torch.zeros(16, 64), 16)


def test_scales_of_the_wrong_shape_are_named():
    qweight, scales, zeros = quantize_packed(smollm_like(192, 576), 64)
    with pytest.raises(InputError, match="scales: expected shape") as error:
        dequantize(qweight, scales[:, :8], zeros, 64)
    assert error.value.field == "scales"
