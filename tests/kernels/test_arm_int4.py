"""ARM's own 4-bit kernel (kernels/ops/kleidiai.py) against float32, at the default model's real shapes.

scripts/test-arm runs this file under qemu-user on an emulated Cortex-A76 (Pi 5, RK3588) and a 256-bit SVE core
(Graviton3), where torch runs KleidiAI's micro-kernels; on x86 torch runs its reference code for the same ops, which
checks the conversion and the call, never KleidiAI. Torch only: no vLLM (none runs under emulation).

The bound: the kernel rounds each row of activations to int8 (KleidiAI: asymmetric, per row), so against float32 on
the dequantized weights the relative error is that rounding's: 0.69-0.80 % at these shapes with torch's reference code
on x86 (2026-12-06); a swapped nibble order gave 134-147 % and scales twice too large 100 %. The test holds it under
2 % on every host.
"""

from __future__ import annotations

import platform

import pytest
import torch

from edge.errors import InputError
from kernels.ops import kleidiai
from kernels.ops.gptq import dequantize_gptq, gptq_tensors

# SmolLM2-135M's linears (N x K): q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
MAX_RELATIVE_ERROR = 0.02

pytestmark = pytest.mark.skipif(not kleidiai.available(), reason="torch before 2.6 has no _dyn_quant ops")


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GPTQ checkpoint's tensors for a random weight (group 32, plain absmax scales) and its float32 dequantized."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    tensors = gptq_tensors("layer", w, kleidiai.GROUP, search=False)
    reference = dequantize_gptq(tensors, kleidiai.GROUP, prefix="layer")  # [N, K] float32
    return tensors["layer.qweight"], tensors["layer.scales"], reference


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def test_torch_runs_kleidiai_on_arm():
    """Under emulation the ops must be KleidiAI's, or this file would test torch's reference code there too."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        assert kleidiai.accelerated()


def test_the_codes_read_from_a_gptq_checkpoint_are_its_weights():
    qweight, scales, reference = _weights(192, 576)
    codes, bf16_scales = kleidiai.from_gptq(qweight, scales)
    assert codes.shape == (192, 288) and codes.dtype == torch.uint8
    assert torch.equal(kleidiai.dequantize(codes, bf16_scales), reference)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [1, 16])
def test_the_kernel_matches_float32_at_the_default_models_shapes(n, k, rows):
    qweight, scales, reference = _weights(n, k, seed=n + k)
    packed = kleidiai.pack(*kleidiai.from_gptq(qweight, scales))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = kleidiai.linear(x, packed, k, n)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert _relative_error(y, x @ reference.t()) < MAX_RELATIVE_ERROR


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_kernel_hands_back_the_models_dtype(dtype):
    n, k = 576, 576
    qweight, scales, reference = _weights(n, k)
    packed = kleidiai.pack(*kleidiai.from_gptq(qweight, scales))
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    y = kleidiai.linear(x, packed, k, n)
    assert y.shape == (2, 3, n) and y.dtype == dtype
    assert _relative_error(y.reshape(6, n), x.reshape(6, k).float() @ reference.t()) < MAX_RELATIVE_ERROR


def test_a_wrong_nibble_order_would_be_caught():
    """The bound is tight enough to see the mistakes it guards against."""
    n, k = 576, 576
    qweight, scales, reference = _weights(n, k)
    codes, bf16_scales = kleidiai.from_gptq(qweight, scales)
    swapped = (codes << 4) | (codes >> 4)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(3))
    y = kleidiai.linear(x, kleidiai.pack(swapped, bf16_scales), k, n)
    assert _relative_error(y, x @ reference.t()) > 10 * MAX_RELATIVE_ERROR


def test_other_groups_and_shapes_are_refused_naming_the_field():
    with pytest.raises(InputError) as refused:
        kleidiai.check(576, 576, group=64)
    assert refused.value.field == "group_size"
    codes = torch.zeros(8, 24, dtype=torch.uint8)  # K = 48: not a multiple of 32
    with pytest.raises(InputError) as refused:
        kleidiai.pack(codes, torch.ones(8, 1))
    assert refused.value.field == "weight"
