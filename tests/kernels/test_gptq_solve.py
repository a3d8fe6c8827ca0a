"""The GPTQ algorithm (kernels/ops/gptq_solve.py) on the default model's shapes: its codes cut the error of the layer's
output on the calibration inputs below round-to-nearest's on the same grids, weights already on a grid keep their
codes, and the act-order variant keeps the groups contiguous."""

from __future__ import annotations

import pytest
import torch

from kernels.ops.gptq_solve import Hessian, asym_grid, gptq, round_to_nearest

K, N = 576, 192  # k_proj of the default model (SmolLM2-135M: hidden 576, 3 kv heads x 64)


def correlated_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Activations as a transformer's are: channels of very different scale (a few outliers), correlated."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    scale = torch.ones(k)
    scale[torch.randperm(k, generator=g)[:8]] = 20.0  # outlier channels
    return (torch.randn(rows, k, generator=g) @ mixing) * scale


def output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float((x @ (w - w_hat).t()).square().mean())


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_is_below_round_to_nearest_on_the_same_grid(sym, act_order):
    x = correlated_inputs(2048, K)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1)) * 0.05
    h = Hessian(K)
    for rows in x.split(512):  # added in parts, as calibration windows are
        h.add(rows)
    solved = gptq(w, h.matrix(), 32, sym=sym, scale_dtype=torch.bfloat16, act_order=act_order)
    nearest = round_to_nearest(w, 32, sym=sym, scale_dtype=torch.bfloat16)
    held_out = correlated_inputs(1024, K, seed=0)[:, :]  # the same distribution
    assert output_error(held_out, w, solved.dequantize()) < 0.7 * output_error(held_out, w, nearest.dequantize())


def test_codes_scales_and_zeros_are_in_range_and_groups_contiguous():
    x = correlated_inputs(512, K)
    w = torch.randn(N, K) * 0.05
    h = Hessian(K)
    h.add(x)
    q = gptq(w, h.matrix(), 32, sym=False, scale_dtype=torch.bfloat16, act_order=True)
    assert q.codes.shape == (N, K) and q.scales.shape == (N, K // 32) and q.zeros.shape == (N, K // 32)
    assert int(q.codes.min()) >= 0 and int(q.codes.max()) <= 15
    assert int(q.zeros.min()) >= 0 and int(q.zeros.max()) <= 15
    assert torch.equal(q.scales, q.scales.to(torch.bfloat16).to(torch.float32))  # what the checkpoint stores


def test_symmetric_zeros_are_uint4b8s_eight():
    h = Hessian(K)
    h.add(correlated_inputs(256, K))
    q = gptq(torch.randn(N, K) * 0.05, h.matrix(), 64, sym=True, scale_dtype=torch.bfloat16)
    assert bool((q.zeros == 8).all())


def test_weights_already_on_an_asymmetric_grid_keep_their_codes():
    """A dequantized 4-bit model (the default model is a Q4_1 one) with integer zeros: nothing to compensate."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (N, K), generator=g)
    codes[:, 0::32], codes[:, 1::32] = 0, 15  # a min-max quantizer's groups reach both ends
    zeros = torch.randint(3, 12, (N, K // 32), generator=g)
    scales = (torch.rand(N, K // 32, generator=g) * 0.01 + 0.002).to(torch.bfloat16).float()
    w = (codes - zeros.repeat_interleave(32, 1)) * scales.repeat_interleave(32, 1)
    h = Hessian(K)
    h.add(correlated_inputs(512, K))
    q = gptq(w, h.matrix(), 32, sym=False, scale_dtype=torch.bfloat16)
    assert torch.allclose(q.dequantize(), w, atol=1e-6)


def test_a_dead_input_channel_gets_any_code_and_does_not_break_the_solve():
    x = correlated_inputs(512, K)
    x[:, 5] = 0.0  # an input that is always zero: H has a zero row and column
    h = Hessian(K)
    h.add(x)
    q = gptq(torch.randn(N, K) * 0.05, h.matrix(), 32, sym=True, scale_dtype=torch.bfloat16)
    assert bool(torch.isfinite(q.dequantize()).all())


def test_asym_grid_search_is_never_worse_than_plain_min_max():
    groups = torch.randn(4096, 32) * 0.05
    groups[::7, 3] = 0.5  # an outlier in some groups
    scales, zeros = asym_grid(groups, torch.bfloat16)
    codes = torch.clamp(torch.round(groups / scales[:, None]) + zeros[:, None], 0, 15)
    searched = ((codes - zeros[:, None]) * scales[:, None] - groups).square().sum(1)
    plain_scales, plain_zeros = asym_grid(groups, torch.bfloat16, ratios=())
    codes = torch.clamp(torch.round(groups / plain_scales[:, None]) + plain_zeros[:, None], 0, 15)
    plain = ((codes - plain_zeros[:, None]) * plain_scales[:, None] - groups).square().sum(1)
    assert bool((searched <= plain + 1e-12).all()) and float(searched.sum()) < float(plain.sum())


def test_shapes_that_do_not_split_into_groups_are_refused():
    h = Hessian(K)
    h.add(correlated_inputs(64, K))
    with pytest.raises(ValueError, match="multiples of the group"):
        gptq(torch.randn(N, K), h.matrix(), 128, sym=True, scale_dtype=torch.bfloat16)  # 576 % 128
    with pytest.raises(ValueError, match="no calibration rows"):
        Hessian(K).matrix()
