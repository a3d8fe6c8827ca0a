"""Per-group scale choice for the symmetric 4-bit grid of vLLM's `uint4b8` type.

A group of `g` weights is stored as codes q in 0..15 and read back as (q - 8) * scale, so the grid is the 16
integers -8..7 times one scale per group. Plain absmax (scale = absmax / 7) keeps every weight inside the grid
but spends grid steps on the rare largest weight; clipping the scale trades a larger error on those few for
finer steps on all the others. `search_scales` tries clipping ratios for every group at once and keeps, per
group, the one with the smallest squared reconstruction error; a least-squares refit of the winner's scale
follows. Measured gain on the default model's real weights: docs/reports/*-gptq-snr.md.

All scales are rounded to the checkpoint's scale dtype before they are judged: the kernel reads the rounded
scale, so the error that counts is the one computed with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

CODE_MIN = -8  # uint4b8: code q in 0..15 means q - 8 (vLLM scalar_types.uint4b8, bias 8)
CODE_MAX = 7

# Ratios of the absmax scale that the search tries; 1.0 is plain absmax, so the search is never worse.
# 0.5..1.0 in steps of 0.05 plus the refit: measured here on 13 real matrices of the default model (layers
# 0/15/29 q/k/gate/down + the head; benchmarks/gptq_snr.py --grid), group 64: absmax 16.87 dB, this 18.18,
# steps of 0.02 or 0.01 18.19; without the refit 0.05 gives 18.14. Finer grids: 2.5-5x the candidates.
DEFAULT_RATIOS: tuple[float, ...] = tuple(round(0.5 + 0.05 * i, 2) for i in range(11))

# Weights judged per pass: 4 MiB temporaries however large the matrix. The head's search here (benchmarks/
# gptq_snr.py --timing, medians of 3 interleaved): 1 thread 2^18 1.45 s, 2^20 1.27 s, 2^22 2.64 s; 2 threads
# 13.1 / 4.8 / 5.1 s on the shared 2-core box (small chunks mean more OpenMP barriers).
_ELEMENTS_PER_CHUNK = 1 << 20


def round_scales(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scales as the checkpoint will hold them, back in fp32; never 0 (a zero group keeps codes 8)."""
    tiny = torch.finfo(dtype).tiny
    return scales.clamp(min=tiny).to(dtype).to(torch.float32)


def quantize_groups(groups: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Signed codes -8..7 for fp32 groups [G, g] at fp32 scales [G]."""
    return torch.clamp(torch.round(groups / scales[:, None]), CODE_MIN, CODE_MAX)


def group_errors(groups: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Squared reconstruction error per group [G] for groups [G, g] at scales [G]."""
    residual = torch.div(groups, scales[:, None])  # the codes of quantize_groups, computed in place:
    residual.round_().clamp_(CODE_MIN, CODE_MAX).mul_(scales[:, None]).sub_(groups)
    return residual.square_().sum(dim=1)


def absmax_scales(groups: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Plain symmetric absmax: scale = max|w| / 7, no weight clipped. [G, g] fp32 -> [G] fp32."""
    return round_scales(groups.abs().amax(dim=1) / CODE_MAX, dtype)


def keep_best(candidates: Iterable[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    """Of candidate grids, each (errors [G], *values [G]), per group the values whose error is smallest (the first
    on a tie): the search shape every per-group grid here shares."""
    best: list[torch.Tensor] | None = None
    for candidate in candidates:
        if best is None:
            best = list(candidate)
            continue
        better = candidate[0] < best[0]
        best = [torch.where(better, new, old) for new, old in zip(candidate, best, strict=True)]
    assert best is not None, "no candidate grid"
    return best


def _search_chunk(groups: torch.Tensor, dtype: torch.dtype, ratios: tuple[float, ...], refit: bool) -> torch.Tensor:
    base = groups.abs().amax(dim=1) / CODE_MAX  # [G] fp32

    def candidates() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for ratio in (1.0, *ratios):
            scales = round_scales(base * ratio, dtype)
            yield group_errors(groups, scales), scales

    best_errors, best_scales = keep_best(candidates())
    if not refit:
        return best_scales
    # Least-squares refit: for the winner's codes q, the scale minimising |w - s q|^2 is <w,q>/<q,q>.
    codes = quantize_groups(groups, best_scales)
    norms = codes.square().sum(dim=1)
    fitted = (groups * codes).sum(dim=1) / norms.clamp(min=1.0)
    fitted = round_scales(torch.where(norms > 0, fitted, best_scales), dtype)
    fitted_errors = group_errors(groups, fitted)
    return torch.where(fitted_errors < best_errors, fitted, best_scales)


def search_scales(
    groups: torch.Tensor,
    dtype: torch.dtype,
    ratios: tuple[float, ...] = DEFAULT_RATIOS,
    *,
    refit: bool = True,
) -> torch.Tensor:
    """Per-group scale [G] fp32 (representable in `dtype`) minimising squared error over `ratios` x absmax/7."""
    assert groups.dim() == 2 and groups.dtype == torch.float32
    rows = max(1, _ELEMENTS_PER_CHUNK // groups.shape[1])
    return torch.cat([_search_chunk(chunk, dtype, ratios, refit) for chunk in groups.split(rows)])


def snr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-noise ratio in dB: 10 log10(|w|^2 / |w - w_hat|^2), in fp64."""
    reference = reference.double()
    noise = (reference - approximation.double()).square().sum()
    signal = reference.square().sum()
    return float(10.0 * torch.log10(signal / noise))
