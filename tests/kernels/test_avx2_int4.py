"""The AVX2 int4 kernels (kernels/ops/avx2_int4.py) against plain PyTorch references.

Two kinds of check:
- Exact: inputs whose every value is an integer or a power of two small enough that each group's integer dot
  product, the per-group scaling and the fp32 sum over groups are exact in any order; there the kernel must equal
  the int64 reference bit for bit, so any code read from the wrong nibble, a wrong zero or a lost group fails.
- Bounded: random weights and activations against dequantize-then-fp32-matmul. The kernel computes sum w * x^
  where x^ is x rounded per row and group to a = max|x_g| / QMAX (QMAX 32767 for act_bits 16, 127 for 8), so
  |y - ref| <= sum_g (a_g / 2) * sum_{k in g} |w_k|  (the rounding)  +  1e-5 * sum_k |w_k x_k| (fp32 ordering).
"""

import os

import pytest
import torch

from kernels.ops import avx2_int4
from kernels.ops.int4 import apply_scales, dequantize, quantize_packed

REASON = avx2_int4.load()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"AVX2 int4 kernel unavailable here: {REASON}")
RELATIVE = 1e-5
QMAX = {16: 32767, 8: 127}


def _layer(n: int, k: int, group: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    padded = -(-n // 32) * 32  # quantize_packed wants N % 32 == 0 (tinygemm's rule); the kernel does not
    w = torch.randn(padded, k, generator=generator)
    qweight, scales, zeros = quantize_packed(w, group)
    return qweight[:n].contiguous(), scales[:n].contiguous(), zeros[:n].contiguous()


def _rounding_bound(x: torch.Tensor, w: torch.Tensor, group: int, act_bits: int) -> torch.Tensor:
    """[M, N]: sum_g (max|x_g| / QMAX / 2) * sum_{k in g} |w_k|."""
    m, k = x.shape
    half_step = x.float().abs().reshape(m, k // group, group).amax(-1) / QMAX[act_bits] / 2  # [M, G]
    w_abs = w.abs().reshape(w.shape[0], k // group, group).sum(-1)  # [N, G]
    return half_step @ w_abs.t()


def _check(n: int, k: int, group: int, m: int, dtype=torch.float32, seed: int = 0, act_bits: int = 16):
    qweight, scales, zeros = _layer(n, k, group, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    w = dequantize(qweight, scales, zeros, group, torch.float32)  # [N, K]
    reference = x.float() @ w.t()  # [M, N]
    bound = _rounding_bound(x, w, group, act_bits) + RELATIVE * (x.float().abs() @ w.abs().t()) + 1e-6
    y = avx2_int4.linear(x, qweight, scales, zeros, group, act_bits)
    assert y.shape == (m, n) and y.dtype == dtype
    if dtype == torch.float32:
        assert ((y - reference).abs() <= bound).all()
    else:  # the kernel's fp32 result rounded once to x's dtype
        assert torch.equal(y, (avx2_int4.linear(x.float(), qweight, scales, zeros, group, act_bits)).to(dtype))


@needs_kernel
@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("threads", [1, "all"])
def test_matches_dequantize_then_matmul_per_group_size_rows_and_threads(group, m, threads, act_bits):
    before = torch.get_num_threads()
    torch.set_num_threads(1 if threads == 1 else max(1, len(os.sched_getaffinity(0))))
    try:
        _check(960, 1536 if group != 128 else 1024, group, m, act_bits=act_bits)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize(
    "n, k, group",
    [(576, 576, 64), (3072, 576, 32), (576, 1536, 64), (1, 256, 128), (37, 192, 64), (101, 576, 32), (5, 96, 32)],
)
def test_ragged_and_the_default_models_shapes(n, k, group, act_bits):
    _check(n, k, group, 3, act_bits=act_bits)


def _exact_case(n: int, k: int, group: int, m: int, act_bits: int, seed: int):
    """Codes 0..15, scales 1/2, 1 or 2, zeros = 8 s + s/2 * c (c in -1..1), integer activations |x| <= 15 with one
    +-QMAX in every group (so each group's a = 1 and x^ = x; that element meets code 0, so it adds (z - 8 s) QMAX).
    The kernel forms s * sum q x and (z - 8 s) * sum x per group; both are multiples of 1/4 and their sums over
    groups stay below 2^22 (checked here), so the result is exact in fp32 in any order."""
    generator = torch.Generator().manual_seed(seed)
    groups = k // group
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    codes.view(n, groups, group)[:, :, 0] = 0
    qweight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    scales = (2.0 ** torch.randint(-1, 2, (n, groups), generator=generator)).to(torch.bfloat16).float()
    zeros = 8 * scales + scales / 2 * torch.randint(-1, 2, (n, groups), generator=generator)
    x = torch.randint(-15, 16, (m, k), generator=generator).float()
    sign = torch.where(torch.rand(m, groups, generator=generator) < 0.5, -1.0, 1.0)
    x.view(m, groups, group)[:, :, 0] = QMAX[act_bits] * sign
    xg = x.double().reshape(m, groups, group)
    code_part = torch.einsum("mgk,ngk->mng", xg.abs(), codes.double().reshape(n, groups, group)) * scales.double()
    zero_part = xg.sum(-1).abs()[:, None, :] * (zeros - 8 * scales).double().abs()
    assert (code_part + zero_part).sum(-1).max() < 2**22  # the premise: exact in fp32 whatever the order
    w = (codes.double() - 8) * scales.double().repeat_interleave(group, 1) + zeros.double().repeat_interleave(group, 1)
    return x, qweight, scales.to(torch.bfloat16), zeros.to(torch.bfloat16), (x.double() @ w.t()).float()


@needs_kernel
@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n, k, m", [(64, 1024, 1), (37, 384, 3), (8, 2048, 2)])
def test_integer_inputs_give_the_int64_reference_bit_for_bit(act_bits, group, n, k, m):
    x, qweight, scales, zeros, reference = _exact_case(n, k, group, m, act_bits, seed=n * k + group + act_bits)
    y = avx2_int4.linear(x, qweight, scales, zeros, group, act_bits)
    assert torch.equal(y, reference)


@needs_kernel
@pytest.mark.parametrize("n, k", [(101, 576), (6, 192), (3, 64), (8, 2048), (5, 96)])
def test_one_row_at_group_32_with_int8_activations_gives_the_int64_reference_bit_for_bit(n, k):
    """A decode row (M=1, as every decode step of the default model's plan) gives the exact result for ragged
    channel counts and for group counts that are not a multiple of 8 (the 128-bit tail), odd ones included."""
    x, qweight, scales, zeros, reference = _exact_case(n, k, 32, 1, 8, seed=n + k)
    assert torch.equal(avx2_int4.linear(x, qweight, scales, zeros, 32, 8), reference)


@needs_kernel
@pytest.mark.parametrize("act_bits", [16, 8])
def test_bf16_activations_give_the_fp32_result_rounded_once(act_bits):
    _check(576, 576, 64, 4, dtype=torch.bfloat16, act_bits=act_bits)


@needs_kernel
def test_int16_activations_err_far_less_than_int8_and_about_as_little_as_fp32():
    """The int16 kernel's error against the fp32 reference is within 2x of tinygemm-free fp32 arithmetic's
    (dequantize then bf16 activations in fp32), while int8 activations err several times more."""
    qweight, scales, zeros = _layer(1024, 2048, 64)
    x = torch.randn(4, 2048, generator=torch.Generator().manual_seed(7))
    w = dequantize(qweight, scales, zeros, 64, torch.float32)
    reference = x @ w.t()
    error = {bits: (avx2_int4.linear(x, qweight, scales, zeros, 64, bits) - reference).norm() / reference.norm()
             for bits in (16, 8)}  # fmt: skip
    bf16_input = (x.to(torch.bfloat16).float() @ w.t() - reference).norm() / reference.norm()
    assert error[16] < 0.05 * bf16_input  # int16 rounding is far below bf16's rounding of the same activations
    assert error[8] > 5 * error[16]


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
        ys = [torch.ops.edge_avx2.w4a16_linear(x, *fake, 64), torch.ops.edge_avx2.w4a8_linear(x, *fake, 64)]
    assert all(y.shape == (5, 96) and y.dtype == torch.bfloat16 for y in ys)


def test_without_a_compiler_the_reason_says_so_and_names_the_fallback():
    reason = avx2_int4.missing_prerequisite({"avx2", "fma", "f16c"}, None)
    assert "no C++ compiler" in reason and "tinygemm" in reason


def test_a_cpu_without_avx2_or_fma_is_named():
    assert avx2_int4.missing_prerequisite({"sse4_2", "f16c"}, "/usr/bin/c++") == (
        "this CPU lacks avx2, fma (the AVX2 int4 kernel needs AVX2, FMA and F16C)"
    )


@needs_kernel
@pytest.mark.parametrize("front", ["python", "c++"])
def test_the_cpu_int4_op_sends_up_to_avx2_rows_to_the_kernel_and_wider_batches_to_tinygemm(front):
    """Both doors: the Python op (int4_linear_impl) and the C++ op in front of it (edge_avx2::int4_linear, what a
    layer with avx2_rows calls through int4_ops.int4_linear), for 2-D rows, a 3-D batch and fp32 input."""
    from kernels.ops.int4_ops import DIRECT, int4_linear, int4_linear_impl
    from kernels.ops.tinygemm import linear as tinygemm_linear
    from kernels.ops.tinygemm import to_tinygemm

    call = int4_linear_impl if front == "python" else int4_linear
    qweight, scales, zeros = _layer(576, 576, 64)
    packed, scales_and_zeros = to_tinygemm(qweight, scales, zeros, 64)
    for shape in ((1, 576), (2, 576), (3, 576), (1, 2, 576), (1, 3, 576)):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(shape).to(dtype)
            y = call(x, packed, scales_and_zeros, qweight, scales, zeros, 64, DIRECT, 128, False, 2)
            y8 = call(x, packed, scales_and_zeros, qweight, scales, zeros, 64, DIRECT, 128, False, 2, 8)
            assert y.shape == (*shape[:-1], 576) and y.dtype == y8.dtype == torch.bfloat16
            x16 = x.to(torch.bfloat16)
            if shape[-2] <= 2:
                assert torch.equal(y, avx2_int4.linear(x16, qweight, scales, zeros, 64))
                assert torch.equal(y8, avx2_int4.linear(x16, qweight, scales, zeros, 64, 8))
            else:
                expected = tinygemm_linear(x16.reshape(-1, 576), packed, scales_and_zeros, 64).view(y.shape)
                assert torch.equal(y, expected) and torch.equal(y8, y)


@needs_kernel
@pytest.mark.parametrize("front", ["python", "c++"])
def test_the_int8_op_sends_up_to_avx2_rows_to_the_kernel_and_wider_batches_to_python(front):
    """Both doors of an 8-bit-set layer or head: the Python op and edge_avx2::int8_linear in front of it (what a layer
    with int8_rows calls through int4_ops.int8_linear), per channel and per group, 2-D and 3-D."""
    from kernels.ops.int4_ops import int8_linear, int8_linear_impl
    from kernels.ops.int8 import quantize_int8

    call = int8_linear_impl if front == "python" else int8_linear
    w = torch.randn(96, 576, generator=torch.Generator().manual_seed(4)) * 0.02
    for group in (None, 16):
        qweight, scales = quantize_int8(w, group=group)
        for shape in ((1, 576), (2, 576), (3, 576), (1, 2, 576)):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
            y = call(x, qweight, scales, 128, 2)
            assert y.shape == (*shape[:-1], 96) and y.dtype == torch.bfloat16
            assert torch.equal(y, int8_linear_impl(x, qweight, scales, 128, 2))
            if shape[-2] <= 2:
                assert torch.equal(y, avx2_int4.int8_linear(x.reshape(-1, 576), qweight, scales).view(y.shape))


@needs_kernel
@pytest.mark.parametrize("group", [None, 16, 32])
def test_the_int8_embedding_op_gathers_what_the_python_op_gathers_bit_for_bit(group):
    from kernels.ops.int4_ops import int8_embedding, int8_embedding_impl
    from kernels.ops.int8 import quantize_int8

    w = torch.randn(300, 576, generator=torch.Generator().manual_seed(6)) * 0.05
    qweight, scales = quantize_int8(w, group=group)
    for ids in (torch.tensor([7]), torch.tensor([0, 299, 7, 7]), torch.tensor([[1, 2], [3, 299]])):
        y = int8_embedding(ids, qweight, scales, cpp=True)
        assert y.shape == (*ids.shape, 576) and y.dtype == torch.bfloat16
        assert torch.equal(y, int8_embedding_impl(ids, qweight, scales))
    with pytest.raises(RuntimeError, match=r"ids: expected values in \[0, 300\), got 300"):
        int8_embedding(torch.tensor([300]), qweight, scales, cpp=True)


@needs_kernel
def test_the_c_plus_plus_front_op_has_a_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kernels.ops.tinygemm import to_tinygemm

    qweight, scales, zeros = _layer(96, 128, 64)
    packed, scales_and_zeros = to_tinygemm(qweight, scales, zeros, 64)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 128, dtype=torch.bfloat16))
        fake = [mode.from_tensor(t) for t in (packed, scales_and_zeros, qweight, scales, zeros)]
        y = torch.ops.edge_avx2.int4_linear(x, *fake, 64, 2, 128, False, 4, 8)
    assert y.shape == (3, 96) and y.dtype == torch.bfloat16


@needs_kernel
def test_a_checkpoint_asking_for_the_avx2_kernel_keeps_its_rows_and_a_wrong_name_is_refused():
    from edge.catalog.kernel_registry import decode_rows
    from edge.errors import InputError
    from kernels.vllm_plugin.cpu_int4 import CpuInt4Config, quantization_config

    config = CpuInt4Config.from_config(quantization_config("direct", decode_kernel="avx2"))
    assert (config.decode_kernel, config.avx2_rows, config.avx2_bits) == ("avx2", decode_rows("avx2"), 16)
    int8 = CpuInt4Config.from_config(quantization_config("direct", decode_kernel="avx2-w4a8"))
    assert (int8.avx2_rows, int8.avx2_bits) == (decode_rows("avx2"), 8)
    assert config.to_dict()["decode_kernel"] == "avx2"
    assert CpuInt4Config.from_config(quantization_config("direct")).avx2_rows == 0
    with pytest.raises(InputError, match="decode_kernel"):
        CpuInt4Config.from_config({**quantization_config("direct"), "decode_kernel": "avx3"})


_PLAIN_SCRIPT = """
import sys, torch
from kernels.ops import avx2_int4
from kernels.ops import q4k
from tests.kernels.test_avx2_int4 import _blocks_cases, _int8_cases, _q4k_cases, _vnni_cases
assert avx2_int4.load() is None and not torch.ops.edge_avx2.uses_vnni()
torch.save([avx2_int4.linear(*case) for case in _vnni_cases()]
           + [avx2_int4.int8_linear(*case) for case in _int8_cases()]
           + [q4k.linear(*case) for case in _q4k_cases()]
           + [linear(x, packed) for linear, x, packed in _blocks_cases()], sys.argv[1])
"""


def _vnni_cases():
    cases = []
    for group, m, bits in [(32, 1, 16), (64, 2, 16), (128, 3, 16), (32, 1, 8), (64, 4, 8), (128, 5, 8)]:
        qweight, scales, zeros = _layer(200, 1024, group, seed=group + m)
        x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        cases.append((x, qweight, scales, zeros, group, bits))
        if bits == 8:  # the int8 kernel on its decode layout too (avx2_int4.cpp block8_a8)
            cases.append((x, *avx2_int4.decode_layout(qweight, scales, zeros, bits), group, bits))
    return cases


def _int8_cases():
    """The int8 weights kernel per channel and per group of 16 and 32."""
    from kernels.ops.int8 import quantize_int8

    w = torch.randn(200, 1024, generator=torch.Generator().manual_seed(9)) * 0.02
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    return [(x, *quantize_int8(w, group=group)) for group in (None, 16, 32)]


def _q4k_cases():
    """The Q4_K kernel on random blocks (kernels/ops/q4k.py), bf16 activations."""
    from kernels.ops.q4k import from_blocks
    from tests.kernels.test_q4k import random_blocks

    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    return [(x[:m], *from_blocks(random_blocks(200, 1024, seed=m))) for m in (1, 3)]


def _blocks_cases():
    """The kernels on a GGUF's own blocks in their decode layouts (Q4_K, Q6_K, Q8_0, Q5_0), bf16 activations:
    (linear, x, packed)."""
    from kernels.ops import g32, q4k, q6k
    from tests.kernels import test_g32, test_q4k, test_q6k

    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    q4k_packed = q4k.decode_layout(*q4k.from_blocks(test_q4k.random_blocks(64, 1024, seed=1)))
    packed = [(lambda x, p: q4k.linear(x, *p), q4k_packed),
              (q6k.linear, q6k.decode_layout(*q6k.from_blocks(test_q6k.random_blocks(64, 1024, seed=1))))]
    packed += [(g32.linear, g32.decode_layout(t, *g32.from_blocks(t, test_g32.random_blocks(t, 64, 1024, seed=1))))
               for t in test_g32.TYPES]
    return [(linear, x[:m], p) for linear, p in packed for m in (1, 3)]


@needs_kernel
def test_the_avx_vnni_build_gives_the_plain_avx2_builds_results_bit_for_bit(tmp_path):
    """Where the CPU has AVX-VNNI the op runs vpdpwssd/vpdpbusd; EDGE_AVX2_VNNI=0 (a child process: the choice is
    made once) runs the plain AVX2 instructions. The integer sums are the same, so the outputs are identical."""
    import subprocess
    import sys
    from pathlib import Path

    if not torch.ops.edge_avx2.uses_vnni():
        pytest.skip("this CPU has no AVX-VNNI: the plain AVX2 build is the only one that runs here")
    out = tmp_path / "plain.pt"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "EDGE_AVX2_VNNI": "0", "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", _PLAIN_SCRIPT, str(out)], env=env, cwd=root, check=True, timeout=600)
    plain = torch.load(out)
    from kernels.ops import q4k

    ours = [avx2_int4.linear(*case) for case in _vnni_cases()] + [avx2_int4.int8_linear(*c) for c in _int8_cases()]
    ours += [q4k.linear(*case) for case in _q4k_cases()]
    ours += [linear(x, packed) for linear, x, packed in _blocks_cases()]
    for i, (mine, expected) in enumerate(zip(ours, plain, strict=True)):
        assert torch.equal(mine, expected), i


@needs_kernel
@pytest.mark.parametrize("n, k, m", [(64, 576, 1), (37, 1024, 3), (9, 96, 2)])
def test_the_int8_weights_kernel_gives_the_int64_reference_bit_for_bit_on_integer_inputs(n, k, m):
    """Power-of-two scales, integer activations with one +-32767 per group of 32 (a = 1): exact in fp32."""
    generator = torch.Generator().manual_seed(n + k + m)
    qweight = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    qweight.view(n, k // 32, 32)[:, :, 0] = 0  # the +-32767 element meets a zero weight: sums stay small
    scales = (2.0 ** torch.randint(-2, 2, (n,), generator=generator)).to(torch.bfloat16)
    x = torch.randint(-15, 16, (m, k), generator=generator).float()
    x.view(m, k // 32, 32)[:, :, 0] = 32767.0
    assert (x.double().abs() @ qweight.double().abs().t()).max() < 2**22
    reference = ((x.double() @ qweight.double().t()) * scales.double()).float()
    assert torch.equal(avx2_int4.int8_linear(x, qweight, scales), reference)


@needs_kernel
def test_the_int8_weights_kernel_matches_the_dequantized_product_within_the_int16_rounding():
    generator = torch.Generator().manual_seed(3)
    qweight = torch.randint(-127, 128, (300, 576), generator=generator, dtype=torch.int8)
    scales = (torch.rand(300, generator=generator) * 0.01).to(torch.bfloat16)
    x = torch.randn(4, 576, generator=generator)
    w = qweight.float() * scales.float()[:, None]
    bound = _rounding_bound(x, w, 32, 16) + RELATIVE * (x.abs() @ w.abs().t()) + 1e-6
    assert ((avx2_int4.int8_linear(x, qweight, scales) - x @ w.t()).abs() <= bound).all()


@needs_kernel
def test_the_int8_op_sends_up_to_avx2_rows_to_the_kernel():
    from kernels.ops.int4_ops import int8_linear_impl

    qweight = torch.randint(-127, 128, (256, 576), dtype=torch.int8)
    scales = (torch.rand(256) * 0.01).to(torch.bfloat16)
    for rows in (1, 2, 3):
        x = torch.randn(rows, 576).to(torch.bfloat16)
        y = int8_linear_impl(x, qweight, scales, 128, 2)
        narrow = rows <= 2
        expected = avx2_int4.int8_linear(x, qweight, scales) if narrow else int8_linear_impl(x, qweight, scales, 128)
        assert torch.equal(y, expected)


@needs_kernel
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("n, k, m", [(64, 576, 1), (37, 1024, 3), (9, 96, 4)])
def test_the_int8_weights_kernel_with_a_scale_per_group_gives_the_int64_reference_bit_for_bit(n, k, m, group):
    """float32 scales per group of 16 or 32 (a GGUF's Q6_K or Q8_0/Q5_0 grid): power-of-two scales and integer
    activations with one +-32767 per activation group of 32 (a = 1), so every product is exact in fp32."""
    generator = torch.Generator().manual_seed(n + k + m + group)
    qweight = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    qweight.view(n, k // 32, 32)[:, :, 0] = 0
    scales = 2.0 ** torch.randint(-3, 2, (n, k // group), generator=generator).float()
    x = torch.randint(-15, 16, (m, k), generator=generator).float()
    x.view(m, k // 32, 32)[:, :, 0] = 32767.0
    w = (qweight.double().view(n, -1, group) * scales.double().unsqueeze(-1)).view(n, k)
    reference = (x.double() @ w.t()).float()
    assert torch.equal(avx2_int4.int8_linear(x, qweight, scales), reference)


@needs_kernel
@pytest.mark.parametrize("group", [16, 32])
def test_the_int8_weights_kernel_with_group_scales_matches_the_dequantized_product(group):
    from kernels.ops.int8 import dequantize_int8, quantize_int8

    generator = torch.Generator().manual_seed(group)
    w = torch.randn(300, 576, generator=generator) * 0.02
    w[:, :32] *= 40  # one group per row far wider than the rest: what per-channel scales lose
    qweight, scales = quantize_int8(w, group=group)
    x = torch.randn(4, 576, generator=generator)
    dequantized = dequantize_int8(qweight, scales, torch.float32)
    bound = _rounding_bound(x, dequantized, 32, 16) + RELATIVE * (x.abs() @ dequantized.abs().t()) + 1e-6
    assert ((avx2_int4.int8_linear(x, qweight, scales) - x @ dequantized.t()).abs() <= bound).all()
    per_channel = dequantize_int8(*quantize_int8(w), torch.float32)
    assert (dequantized - w).norm() < (per_channel - w).norm() / 4  # what the groups buy on such rows


@needs_kernel
def test_the_int8_weights_kernel_refuses_scales_of_another_shape_or_dtype():
    qweight = torch.zeros(8, 64, dtype=torch.int8)
    x = torch.zeros(1, 64)
    for scales in (torch.ones(8, 64 // 8), torch.ones(8, 2, dtype=torch.bfloat16), torch.ones(7, 2)):
        with pytest.raises(RuntimeError, match="scales: expected"):
            avx2_int4.int8_linear(x, qweight, scales)


@needs_kernel
def test_a_per_group_int8_layer_takes_the_kernel_below_the_threshold_and_dequantizes_from_it():
    """PyTorch's int8 GEMM takes one scale per channel: a per-group layer's narrow batches run this kernel
    (avx2_rows, the plugin's int8_rows), and every other batch dequantizes, whatever the threshold."""
    from kernels.ops.int4_ops import int8_linear_impl
    from kernels.ops.int8 import dequantize_int8, quantize_int8

    qweight, scales = quantize_int8(torch.randn(256, 576) * 0.02, group=32)
    for rows in (1, 3, 200):
        x = torch.randn(rows, 576).to(torch.bfloat16)
        y = int8_linear_impl(x, qweight, scales, 128, 127)
        if rows <= 127:
            assert torch.equal(y, avx2_int4.int8_linear(x, qweight, scales))
        else:
            assert torch.equal(y, torch.mm(x, dequantize_int8(qweight, scales).t()))
        assert torch.equal(int8_linear_impl(x, qweight, scales, 2), torch.mm(x, dequantize_int8(qweight, scales).t()))


def test_ninja_from_the_ninja_package_joins_path_when_none_is_on_it(monkeypatch, tmp_path):
    """`.venv/bin/edge-serve` run without activating the venv: the package's ninja is found all the same."""
    ninja = pytest.importorskip("ninja", reason="the ninja package is a dependency of the vllm extra")
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no ninja, no compiler
    assert avx2_int4.ninja_on_path() is None
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR


# --- the decode layout dequantized (a layer holding no tinygemm buffer) ----------------------------------------------


@pytest.mark.parametrize(("n", "k", "group"), [(1536, 576, 32), (576, 1536, 64), (64, 256, 128), (8, 64, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_decode_layout_dequantizes_bit_for_bit_as_the_row_major_tensors(n, k, group, dtype):
    from kernels.ops.int4 import dequantize as row_major_dequantize

    g = torch.Generator().manual_seed(n + k)
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales, zeros = ((torch.randn(n, k // group, generator=g) * 0.01).to(torch.bfloat16) for _ in range(2))
    laid = avx2_int4.decode_layout(qweight, scales, zeros, 8)
    assert laid[0].dim() == 3
    expected = row_major_dequantize(qweight, scales, zeros, group, dtype)
    assert torch.equal(avx2_int4.dequantize(*laid, group, dtype), expected)  # C++ where it loads
    codes, row_scales, row_zeros = avx2_int4.row_major(*laid)  # the Python fallback's undoing of the layout
    assert torch.equal(apply_scales(codes, row_scales, row_zeros, group, dtype), expected)


@needs_kernel
def test_the_dequantizer_names_a_tensor_that_is_not_the_decode_layout():
    qweight = torch.zeros(8, 32, dtype=torch.uint8)
    scales = torch.zeros(8, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"qweight: expected uint8 \[N/8, K/8, 32\]"):
        avx2_int4.op("int4_dequantize")(qweight, scales, scales, 32, False)
