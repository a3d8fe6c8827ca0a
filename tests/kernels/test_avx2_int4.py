"""The AVX2 int4 kernel (kernels/avx2_int4.py) against a plain PyTorch reference: dequantize, then an fp32 matmul.

Tolerance: the kernel sums q * x per group in fp32 and applies scale and zero once per group; the reference sums
((q - 8) * s + z) * x. Both are fp32 with different orders of summation, so they agree to fp32 rounding over K
terms: max |y - ref| <= 1e-5 * (sum_k |w_k x_k| per output, the reduction's own scale), measured ~1e-7 relative.
"""

import os

import pytest
import torch

from kernels import avx2_int4
from kernels.int4 import dequantize, quantize_packed

REASON = avx2_int4.load()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"AVX2 int4 kernel unavailable here: {REASON}")
RELATIVE = 1e-5


def _layer(n: int, k: int, group: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    padded = -(-n // 32) * 32  # quantize_packed wants N % 32 == 0 (tinygemm's rule); the kernel does not
    w = torch.randn(padded, k, generator=generator)
    qweight, scales, zeros = quantize_packed(w, group)
    return qweight[:n].contiguous(), scales[:n].contiguous(), zeros[:n].contiguous()


def _check(n: int, k: int, group: int, m: int, dtype=torch.float32, seed: int = 0):
    qweight, scales, zeros = _layer(n, k, group, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    w = dequantize(qweight, scales, zeros, group, torch.float32)  # [N, K]
    reference = x.float() @ w.t()  # [M, N]
    bound = x.float().abs() @ w.abs().t()  # sum_k |x w|: the scale of each output's rounding
    y = avx2_int4.linear(x, qweight, scales, zeros, group)
    assert y.shape == (m, n) and y.dtype == dtype
    if dtype == torch.float32:
        assert ((y - reference).abs() <= RELATIVE * bound + 1e-6).all()
    else:  # the kernel's fp32 result rounded once to x's dtype
        assert torch.equal(y, (avx2_int4.linear(x.float(), qweight, scales, zeros, group)).to(dtype))


@needs_kernel
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("threads", [1, "all"])
def test_matches_dequantize_then_matmul_per_group_size_rows_and_threads(group, m, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(1 if threads == 1 else max(1, len(os.sched_getaffinity(0))))
    try:
        _check(960, 1536 if group != 128 else 1024, group, m)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize(
    "n, k, group", [(576, 576, 64), (3072, 576, 32), (576, 1536, 64), (1, 256, 128), (37, 192, 64), (101, 576, 32)]
)
def test_ragged_and_the_default_models_shapes(n, k, group):
    _check(n, k, group, 3)


@needs_kernel
def test_bf16_activations_give_the_fp32_result_rounded_once():
    _check(576, 576, 64, 4, dtype=torch.bfloat16)


@needs_kernel
def test_leading_dimensions_are_kept():
    qweight, scales, zeros = _layer(64, 128, 32)
    x = torch.randn(2, 3, 128)
    assert avx2_int4.linear(x, qweight, scales, zeros, 32).shape == (2, 3, 64)


@needs_kernel
def test_zero_rows_give_an_empty_result():
    qweight, scales, zeros = _layer(64, 128, 32)
    assert avx2_int4.linear(torch.empty(0, 128), qweight, scales, zeros, 32).shape == (0, 64)


@needs_kernel
def test_a_group_size_the_kernel_lacks_is_refused():
    qweight, scales, zeros = _layer(64, 128, 32)
    with pytest.raises(RuntimeError, match="group: expected 32, 64 or 128, got 16"):
        avx2_int4.linear(torch.randn(1, 128), qweight, scales, zeros, 16)


@needs_kernel
def test_the_fake_implementation_gives_shape_and_dtype_without_running():
    qweight, scales, zeros = _layer(96, 128, 64)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(5, 128, dtype=torch.bfloat16))
        fake = [mode.from_tensor(t) for t in (qweight, scales, zeros)]
        y = torch.ops.edge_avx2.w4a16_linear(x, *fake, 64)
    assert y.shape == (5, 96) and y.dtype == torch.bfloat16


def test_without_a_compiler_the_reason_says_so_and_names_the_fallback():
    reason = avx2_int4.missing_prerequisite({"avx2", "fma", "f16c"}, None)
    assert "no C++ compiler" in reason and "tinygemm" in reason


def test_a_cpu_without_avx2_or_fma_is_named():
    assert avx2_int4.missing_prerequisite({"sse4_2", "f16c"}, "/usr/bin/c++") == (
        "this CPU lacks avx2, fma (the AVX2 int4 kernel needs AVX2, FMA and F16C)"
    )


@needs_kernel
def test_the_cpu_int4_op_sends_up_to_avx2_rows_to_the_kernel_and_wider_batches_to_tinygemm():
    from kernels.int4_ops import DIRECT, _linear_impl
    from kernels.tinygemm import linear as tinygemm_linear
    from kernels.tinygemm import to_tinygemm

    qweight, scales, zeros = _layer(576, 576, 64)
    packed, scales_and_zeros = to_tinygemm(qweight, scales, zeros, 64)
    for rows in (1, 2, 3):
        x = torch.randn(rows, 576).to(torch.bfloat16)
        y = _linear_impl(x, packed, scales_and_zeros, qweight, scales, zeros, 64, DIRECT, 128, False, 2)
        if rows <= 2:
            assert torch.equal(y, avx2_int4.linear(x, qweight, scales, zeros, 64))
        else:
            assert torch.equal(y, tinygemm_linear(x, packed, scales_and_zeros, 64))


@needs_kernel
def test_a_checkpoint_asking_for_the_avx2_kernel_keeps_its_rows_and_a_wrong_name_is_refused():
    from edge.errors import InputError
    from edge.kernel_params import avx2_decode_rows
    from kernels.cpu_int4 import CpuInt4Config, quantization_config

    config = CpuInt4Config.from_config(quantization_config("direct", decode_kernel="avx2"))
    assert (config.decode_kernel, config.avx2_rows) == ("avx2", avx2_decode_rows())
    assert config.to_dict()["decode_kernel"] == "avx2"
    assert CpuInt4Config.from_config(quantization_config("direct")).avx2_rows == 0
    with pytest.raises(InputError, match="decode_kernel"):
        CpuInt4Config.from_config({**quantization_config("direct"), "decode_kernel": "avx3"})
