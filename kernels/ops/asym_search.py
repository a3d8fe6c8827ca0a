"""Data-free rounding for the asymmetric cpu_int4 grid: a scale-and-minimum search with a least-squares refit.

The grid is w = s * q + m with q in 0..15 (stored as scale = s, zero = m + 8 s: kernels/ops/int4.py). Plain
round-to-nearest takes s = (max - min) / 15, m = min: every weight inside, steps spent on the extremes. The idea
behind llama.cpp's Q4_K quantizer (ggml-quants.c make_qkx2_quants): try a range of inverse scales around
15 / (max - min); for each, round the codes, then refit s and m to those codes by weighted least squares
(a 2x2 system per group); keep the candidate with the smallest weighted error. Weights are llama.cpp's,
|x| + rms(group), which favour the larger weights a little. All groups at once, candidates in a loop.

Scale and zero are rounded to bf16 before the final codes are chosen, so the error that counts is the one the
kernel sees. Measured against round-to-nearest on the default model's real weights:
docs/reports/2026-11-30-asym-search.md.
"""

from __future__ import annotations

import torch

CODES = 15  # q in 0..15
ZERO_CODE = 8
# Inverse-scale candidates (15 + RMIN + RDELTA * i) / (max - min), i = 0..NSTEP: llama.cpp's Q4_K choice
# (rmin -1, rdelta 0.1, 20 steps) around the plain 15 / (max - min).
RMIN, RDELTA, NSTEP = -1.0, 0.1, 20
_ELEMENTS_PER_CHUNK = 1 << 20  # ~4 MiB fp32 temporaries per candidate, whatever the matrix


def search(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """groups fp32 [G, g] -> (s, m) fp32 [G]: the searched step and minimum (w = s * q + m)."""
    assert groups.dim() == 2 and groups.dtype == torch.float32
    rows = max(1, _ELEMENTS_PER_CHUNK // groups.shape[1])
    found = [_search_chunk(chunk) for chunk in groups.split(rows)]
    return torch.cat([s for s, _ in found]), torch.cat([m for _, m in found])


def _search_chunk(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    low, high = x.amin(dim=1), x.amax(dim=1)  # [G]
    span = (high - low).clamp(min=1e-12)
    weights = x.abs() + x.square().mean(dim=1, keepdim=True).sqrt()  # [G, g]
    best_s, best_m = span / CODES, low  # round-to-nearest is candidate zero: the search is never worse
    best_err = _error(x, weights, best_s, best_m)
    sum_w, sum_x = weights.sum(dim=1), (weights * x).sum(dim=1)
    for step in range(NSTEP + 1):
        inverse = (CODES + RMIN + RDELTA * step) / span  # [G]
        codes = ((x - low[:, None]) * inverse[:, None]).round_().clamp_(0, CODES)  # [G, g]
        wq = weights * codes
        sum_q, sum_q2, sum_xq = wq.sum(dim=1), (wq * codes).sum(dim=1), (wq * x).sum(dim=1)
        det = sum_w * sum_q2 - sum_q * sum_q
        ok = det > 0
        s = torch.where(ok, (sum_w * sum_xq - sum_x * sum_q) / det.clamp(min=1e-30), best_s)
        m = torch.where(ok, (sum_q2 * sum_x - sum_q * sum_xq) / det.clamp(min=1e-30), best_m)
        s = s.clamp(min=1e-12)
        err = _error(x, weights, s, m)
        better = err < best_err
        best_s, best_m, best_err = (torch.where(better, s, best_s), torch.where(better, m, best_m),
                                    torch.where(better, err, best_err))  # fmt: skip
    return best_s, best_m


def _error(x: torch.Tensor, weights: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Weighted squared error [G] of the grid (s, m) after rounding s and zero as stored (bf16)."""
    scale, zero = stored(s, m)
    codes = codes_for(x, scale, zero)
    residual = (codes - ZERO_CODE) * scale[:, None] + zero[:, None] - x
    return (weights * residual.square()).sum(dim=1)


def stored(s: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) as the checkpoint holds them (bf16), back in fp32: zero = m + 8 s."""
    scale = s.to(torch.bfloat16).to(torch.float32)
    zero = (m + ZERO_CODE * s).to(torch.bfloat16).to(torch.float32)
    return scale, zero


def codes_for(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Nearest codes 0..15 of x [G, g] on the stored grid (scale, zero) [G]."""
    return ((x - zero[:, None]) / scale[:, None]).round_().add_(ZERO_CODE).clamp_(0, CODES)
