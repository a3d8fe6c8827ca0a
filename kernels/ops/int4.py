"""Group-wise asymmetric int4 weights in the portable, row-major checkpoint format.

Checkpoint tensors for one linear layer with weight [N, K] (N output channels, K inputs):
    <prefix>.qweight  uint8 [N, K/2]     byte j of row n: k=2j in the low nibble, k=2j+1 in the high nibble
    <prefix>.scales   bf16  [N, K/group]
    <prefix>.zeros    bf16  [N, K/group]
    w = (q - 8) * scale + zero            q in 0..15

That is tinygemm's own convention, read in PyTorch 2.13's CPU kernel
(aten/src/ATen/native/cpu/int4mm_kernel.cpp): the AVX-512 `tinygemm_kernel` dequantizes through a lookup table
of q - 8 and `fmadd(q - 8, scale, zero)`; the AVX2 one folds the offset into the zero (`zero = -8 * scale + zero`)
and computes `fmadd(q, scale, zero)`; the scalar fallback reads `lut[q] * scale + zero` with lut = -8..7. The
host-specific tinygemm buffer is built from these tensors at load time (kernels/ops/tinygemm.py).

Quantization is min/max per group (gpt-fast / torchao style): the group's range is spread over the 16 codes,
zero = min + 8 * scale. Codes are rounded against the bf16-rounded scale and zero actually stored, so storage
rounding does not add to the error.
"""

from __future__ import annotations

import sys

import torch

from edge.catalog.shape_rules import PACK_N_MULTIPLE, TINYGEMM_GROUP_SIZES
from edge.errors import InputError

# What tinygemm accepts: group sizes and N's multiple (edge.catalog.shape_rules owns them: the planner asks the same).
GROUP_SIZES = TINYGEMM_GROUP_SIZES
N_MULTIPLE = PACK_N_MULTIPLE
ZERO_CODE = 8  # the code that dequantizes to `zero`
CHUNK_ELEMENTS = 1 << 18  # see apply_scales
_MIN_SCALE = 1e-6  # a constant group gets this scale: every code lands on 8, i.e. on the group's value


def quantize(
    w: torch.Tensor, group: int, *, name: str = "w", search: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize w [N, K] (any float dtype) to codes uint8 [N, K] in 0..15, scales and zeros bf16 [N, K/group].

    search: the scale-and-minimum search with a least-squares refit (kernels/ops/asym_search.py) instead of min/max.
    """
    n, k = _check_weight(w, group, name)
    groups = w.detach().to(torch.float32).reshape(n, k // group, group)  # [N, K/g, g]
    if search:
        from kernels.ops import asym_search

        flat = groups.reshape(-1, group)  # [N*K/g, g]
        scale, zero = asym_search.stored(*asym_search.search(flat))  # [N*K/g] fp32, bf16-representable
        codes = asym_search.codes_for(flat, scale, zero).to(torch.uint8)
        shape = (n, k // group)
        return codes.reshape(n, k), scale.reshape(shape).to(torch.bfloat16), zero.reshape(shape).to(torch.bfloat16)
    low = groups.amin(dim=-1)  # [N, K/g]
    high = groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=_MIN_SCALE).to(torch.bfloat16)  # [N, K/g]
    zeros = (low + ZERO_CODE * scales.float()).to(torch.bfloat16)  # [N, K/g]
    s = scales.float().unsqueeze(-1)  # [N, K/g, 1]
    z = zeros.float().unsqueeze(-1)
    codes = ((groups - z) / s).round_().add_(ZERO_CODE).clamp_(0, 15).to(torch.uint8)  # [N, K/g, g]
    return codes.reshape(n, k), scales, zeros


def pack_nibbles(codes: torch.Tensor, *, name: str = "codes") -> torch.Tensor:
    """Pack codes uint8 [N, K] (0..15) into uint8 [N, K/2]: k=2j in the low nibble of byte j, k=2j+1 high."""
    if codes.dim() != 2 or codes.dtype != torch.uint8:
        raise InputError(name, (codes.dtype, tuple(codes.shape)), "a 2-D uint8 tensor [N, K]")
    if codes.shape[1] % 2:
        raise InputError(name, tuple(codes.shape), "K (dim 1) even, to pack two codes per byte")
    pairs = codes.view(codes.shape[0], -1, 2)  # [N, K/2, 2]
    return pairs[..., 0] | (pairs[..., 1] << 4)  # [N, K/2]


def unpack_nibbles(packed: torch.Tensor, *, name: str = "qweight") -> torch.Tensor:
    """Unpack uint8 [N, K/2] into codes uint8 [N, K]; the inverse of pack_nibbles."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise InputError(name, (packed.dtype, tuple(packed.shape)), "a 2-D uint8 tensor [N, K/2]")
    # Widen each byte to 16 bits and spread its nibbles into the two bytes of that int16: (b | b << 4) & 0x0F0F
    # holds the low nibble in its first byte and the high nibble in its second (little-endian). 4x faster than
    # stacking the two nibble planes: 0.22 vs 0.91 ms at 1536x576, 7.0 vs 12.4 ms at 4096x4096 (1 thread, thread
    # CPU time, median of 7 interleaved runs, this host, 2026-11-29).
    assert sys.byteorder == "little", "the int16 nibble spread assumes a little-endian host"
    spread = packed.to(torch.int16)  # [N, K/2]
    spread.bitwise_or_(spread << 4).bitwise_and_(0x0F0F)
    return spread.view(torch.uint8).view(packed.shape[0], -1)  # [N, K]


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    dtype: torch.dtype = torch.bfloat16,
    *,
    name: str = "qweight",
) -> torch.Tensor:
    """Rebuild w [N, K] in `dtype` from qweight uint8 [N, K/2] and scales, zeros bf16 [N, K/group]."""
    codes = unpack_nibbles(qweight, name=name)  # [N, K]
    check_params(codes.shape, scales, zeros, group, name)
    return apply_scales(codes, scales, zeros, group, dtype)


def apply_scales(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """(codes - 8) * scale + zero for codes uint8 [N, K] and scales, zeros [N, K/group] -> [N, K] in dtype.

    Arithmetic in fp32, rounded once: (q - 8) * scale is exact in fp32 (a 4-bit code times an 8-bit mantissa),
    so the only rounding is the add, as in the AVX-512 kernel's fused multiply-add. The AVX2 kernel first folds
    zero - 8 * scale (exact unless the two differ by more than 2^16 in magnitude); read back through one-hot rows
    its weights equal these bit for bit (tests/kernels/test_tinygemm.py). Shared by the row-major and the direct
    (tinygemm-buffer) dequantizers, so the two agree bit for bit.

    Runs over chunks of about CHUNK_ELEMENTS so the fp32 temporaries stay in cache: 4096x4096 g64 took 114 ms
    in one piece and 54 ms in 256K-element chunks (64K-element chunks: 77 ms; 1 thread, thread CPU time, median of 5
    interleaved runs, this host, 2026-11-29). A [K, N]-major output for the fp32 GEMM was tried and was slower.
    """
    n, k = codes.shape
    s = scales.to(torch.float32).unsqueeze(-1)  # [N, K/g, 1]
    z = zeros.to(torch.float32).unsqueeze(-1)
    out = torch.empty(n, k, dtype=dtype)
    rows = max(1, CHUNK_ELEMENTS // k)
    for start in range(0, n, rows):
        chunk = slice(start, start + rows)
        centred = (codes[chunk].view(torch.int8) - ZERO_CODE).view(-1, k // group, group)  # int8 in -8..7
        if dtype == torch.float32:  # compute in place in the output
            w = out[chunk].view(-1, k // group, group)  # [rows, K/g, g]
            w.copy_(centred).mul_(s[chunk]).add_(z[chunk])
        else:
            out[chunk] = centred.to(torch.float32).mul_(s[chunk]).add_(z[chunk]).view(-1, k)
    return out


def quantize_packed(
    w: torch.Tensor, group: int, *, name: str = "w", search: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize() then pack_nibbles(): (qweight uint8 [N, K/2], scales bf16 [N, K/g], zeros bf16 [N, K/g])."""
    codes, scales, zeros = quantize(w, group, name=name, search=search)
    return pack_nibbles(codes, name=name), scales, zeros


def check_group(group: int) -> None:
    if group not in GROUP_SIZES:
        raise InputError("group", group, f"one of {GROUP_SIZES} (tinygemm's group sizes)")


def _check_weight(w: torch.Tensor, group: int, name: str) -> tuple[int, int]:
    check_group(group)
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise InputError(name, (w.dtype, tuple(w.shape)), "a 2-D float tensor [N, K]")
    n, k = w.shape
    if k % 2:
        raise InputError(name, tuple(w.shape), "K (dim 1) even, to pack two codes per byte")
    if k % group:
        raise InputError(name, tuple(w.shape), f"K (dim 1) divisible by group {group}")
    if n % N_MULTIPLE:
        raise InputError(name, tuple(w.shape), f"N (dim 0) divisible by {N_MULTIPLE} (tinygemm cannot pack it)")
    return n, k


def check_params(
    codes_shape: torch.Size, scales: torch.Tensor, zeros: torch.Tensor, group: int, name: str
) -> None:
    check_group(group)
    n, k = codes_shape
    if k % group:
        raise InputError(name, tuple(codes_shape), f"K (dim 1) divisible by group {group}")
    expected = (n, k // group)
    for field, tensor in (("scales", scales), ("zeros", zeros)):
        if tuple(tensor.shape) != expected:
            raise InputError(field, tuple(tensor.shape), f"shape {expected} for {name}'s [N, K] = {tuple(codes_shape)}")
