"""The GPTQ algorithm: 4-bit codes for a linear weight that minimise the error of its output on calibration inputs,
not of the weight itself.

Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers" (ICLR 2023), written here from the paper's Algorithm 1 (no library code copied):
- H = 2 X Xᵀ / n over the layer's n calibration input rows (`Hessian`), dampened by a fraction of its mean
  diagonal; columns whose input is always zero are dropped (their weights do not matter).
- Columns are quantized left to right. The rounding error of column j, divided by the diagonal of the upper
  Cholesky factor of H⁻¹, is spread over the columns not yet quantized through that factor's row j: the weights
  still free absorb what the rounded ones lost, as seen through the inputs. Blocks of `block` columns apply the
  update lazily (the paper's §"Lazy Batch-Updates").
- Group-wise scales (and zeros): a group's grid is chosen when its first column is reached, from the weights as the
  updates left them (the paper's grouping; no act-order: the checkpoint's groups stay contiguous, as vLLM's kernels
  read them).

The grid is vLLM's 4-bit one either way: codes 0..15 read as (q - zero) * scale, zero 8 for the symmetric GPTQ type
(`uint4b8`) or a per-group integer zero (the asymmetric AWQ-style zero points that vLLM's int4 x int8 kernel takes).
Each group's grid is picked by the same search as round-to-nearest (kernels/ops/scale_search.py): GPTQ changes
which code each weight gets, not how a grid is chosen.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kernels.ops.scale_search import CODE_MIN, keep_best, round_scales, search_scales

LEVELS = 15  # codes 0..15
DEFAULT_DAMP = 0.01  # the paper's λ: 1 % of the mean diagonal
DEFAULT_BLOCK = 128  # columns per lazy batch (the paper's B)
# Asymmetric grids tried per group: the min..max range shrunk about its middle by these ratios (1.0: plain min-max)
ASYM_RATIOS: tuple[float, ...] = tuple(round(0.7 + 0.03 * i, 2) for i in range(11))


class Hessian:
    """2 X Xᵀ / n over every input row a linear layer has seen (fp32 accumulation of fp32 products)."""

    def __init__(self, columns: int) -> None:
        self.sum = torch.zeros(columns, columns, dtype=torch.float32)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
        self.sum.addmm_(rows.t(), rows)
        self.rows += rows.shape[0]

    def matrix(self) -> torch.Tensor:
        if self.rows == 0:
            raise ValueError("no calibration rows reached this layer")
        return self.sum * (2.0 / self.rows)


@dataclass(frozen=True)
class Quantized:
    """codes [N, K] uint8 0..15, scales [N, K/g] fp32 (representable in the scale dtype), zeros [N, K/g] int32:
    w ≈ (codes - zeros) * scales, group by group along K. (uint8 codes: a model's worth of them is held until the
    converter writes it.)"""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        group = self.codes.shape[1] // self.scales.shape[1]
        scales = self.scales.repeat_interleave(group, dim=1)
        zeros = self.zeros.repeat_interleave(group, dim=1)
        return (self.codes.to(torch.int32) - zeros).to(torch.float32) * scales


def group_grid(columns: torch.Tensor, sym: bool, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid for one group of columns [N, g] (each row its own group): scales [N] fp32 and integer zeros [N]."""
    if sym:
        scales = search_scales(columns.contiguous(), scale_dtype)
        return scales, torch.full_like(scales, -CODE_MIN, dtype=torch.int32)
    return asym_grid(columns, scale_dtype)


def asym_grid(groups: torch.Tensor, scale_dtype: torch.dtype,
              ratios: tuple[float, ...] = ASYM_RATIOS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of groups [G, g]: the scale and integer zero (0..15) of the shrunk min-max range with the smallest
    squared reconstruction error."""
    low, high = groups.amin(dim=1), groups.amax(dim=1)
    middle, half = (high + low) / 2, (high - low) / 2

    def candidates() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for ratio in (1.0, *ratios):
            scales = round_scales((2 * half * ratio) / LEVELS, scale_dtype)
            zeros = torch.round(-(middle - half * ratio) / scales).clamp(0, LEVELS)
            codes = torch.clamp(torch.round(groups / scales[:, None]) + zeros[:, None], 0, LEVELS)
            yield ((codes - zeros[:, None]) * scales[:, None] - groups).square().sum(dim=1), scales, zeros

    _, scales, zeros = keep_best(candidates())
    return scales, zeros.to(torch.int32)


def _codes(column: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(column / scales) + zeros, 0, LEVELS)


def round_to_nearest(w: torch.Tensor, group: int, *, sym: bool, scale_dtype: torch.dtype) -> Quantized:
    """The same grids without GPTQ's updates: every weight to its nearest code (the baseline GPTQ is judged against)."""
    n, k = w.shape
    w = w.to(torch.float32)
    scales, zeros = group_grid(w.reshape(n * (k // group), group), sym, scale_dtype)
    scales, zeros = scales.reshape(n, k // group), zeros.reshape(n, k // group)
    codes = _codes(w, scales.repeat_interleave(group, 1), zeros.repeat_interleave(group, 1))
    return Quantized(codes.to(torch.uint8), scales, zeros)


def gptq(w: torch.Tensor, hessian: torch.Tensor, group: int, *, sym: bool, scale_dtype: torch.dtype,
         damp: float = DEFAULT_DAMP, block: int = DEFAULT_BLOCK, act_order: bool = False) -> Quantized:
    """GPTQ codes for w [N, K] (any float dtype) given H [K, K] of its inputs (module docstring).

    act_order: columns in order of decreasing H diagonal (the inputs with the most energy first), with every
    group's grid fixed beforehand from the unquantized weights ("static groups"), so the groups stay contiguous
    along K as the kernels read them."""
    n, k = w.shape
    if k % group or block % group:
        raise ValueError(f"K={k} and the block {block} must be multiples of the group {group}")
    if hessian.shape != (k, k):
        raise ValueError(f"the Hessian is {list(hessian.shape)}, the weight has K={k}")
    weights = w.detach().to(torch.float32).clone()
    h = hessian.to(torch.float32).clone()
    dead = torch.diagonal(h) == 0  # inputs that are always zero: any code will do
    h[dead, dead] = 1.0
    weights[:, dead] = 0.0
    torch.diagonal(h).add_(damp * float(torch.diagonal(h).mean()))

    scales = torch.zeros(n, k // group, dtype=torch.float32)
    zeros = torch.zeros(n, k // group, dtype=torch.int32)
    order = torch.arange(k)
    if act_order:
        static = round_to_nearest(weights, group, sym=sym, scale_dtype=scale_dtype)
        scales, zeros = static.scales, static.zeros
        order = torch.argsort(torch.diagonal(h), descending=True)
        weights, h = weights[:, order], h[order][:, order]
    upper = _inverse_cholesky_upper(h)  # U with H⁻¹ = Uᵀ U
    groups_of = order // group  # the group of each column in processing order

    codes = torch.zeros(n, k, dtype=torch.uint8)
    for start in range(0, k, block):
        end = min(start + block, k)
        part = weights[:, start:end].clone()  # the block's columns, updated as it goes
        errors = torch.zeros_like(part)
        factor = upper[start:end, start:end]
        for i in range(end - start):
            column = start + i
            g = int(groups_of[column])
            if not act_order and column % group == 0:
                # the group's columns as the updates left them (a block holds whole groups)
                scales[:, g], zeros[:, g] = group_grid(part[:, i : i + group], sym, scale_dtype)
            q = _codes(part[:, i], scales[:, g], zeros[:, g].to(torch.float32))
            codes[:, column] = q.to(torch.uint8)
            rounded = (q - zeros[:, g]) * scales[:, g]
            error = (part[:, i] - rounded) / factor[i, i]
            part[:, i:].sub_(error[:, None] * factor[i, i:][None, :])
            errors[:, i] = error
        weights[:, end:].sub_(errors @ upper[start:end, end:])
    if act_order:
        codes = codes[:, torch.argsort(order)]
    return Quantized(codes, scales, zeros)


def _inverse_cholesky_upper(h: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of H⁻¹, in fp64 for the inversion (a dampened H is positive definite; more damping
    is added if rounding says otherwise)."""
    h64 = h.to(torch.float64)
    extra = 0.0
    mean = float(torch.diagonal(h64).mean())
    for _ in range(8):
        try:
            lower = torch.linalg.cholesky(h64 + extra * mean * torch.eye(h64.shape[0], dtype=torch.float64))
            inverse = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(inverse, upper=True).to(torch.float32)
        except torch.linalg.LinAlgError:
            extra = max(extra * 10, 1e-3)
    raise ValueError("the calibration Hessian is not positive definite even with 1000x damping")


__all__ = ["Hessian", "Quantized", "asym_grid", "gptq", "group_grid", "round_to_nearest"]
