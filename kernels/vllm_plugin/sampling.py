"""Sampling on CPU without a full-vocabulary sort or an exponential variate per token, and with no compile at start.

vLLM 0.28's CPU sampler (`vllm/v1/sample/ops/topk_topp_sampler.py`, `TopKTopPSampler.forward_cpu`) costs a decode
step of the default model (SmolLM2-135M, 49152 tokens, ~8 ms on 2 Zen 5 cores) far more than its size suggests,
measured per row on one thread (`benchmarks/bench_sampler.py`):

- **top-p** (`apply_top_k_top_p_pytorch`) sorts the whole vocabulary every step: ~4 ms a row, top-k or not. llama.cpp's
  server samples with top-k 40 and top-p 0.95 by default, so a client moving from it sends exactly this.
- **the draw** (`compiled_random_sample`) is Gumbel-max: one exponential variate per vocabulary entry, and torch's
  CPU `exponential_` costs ~17 ns an element: ~0.9 ms a row. It is also a `torch.compile(dynamic=True)` function,
  so every engine start traces it in the warm-up's dummy sampler run (1.3 s of a 16 s warm start, from the log).

This module replaces both, in that module only, with the same distributions:

- `top_k_top_p`: top-p keeps, of the probabilities renormalized after top-k, the most likely tokens until their mass
  reaches p: the token of rank r is kept iff the mass of the r - 1 tokens above it is below p, which is vLLM's rule
  (drop a token iff the ascending cumulative sum up to it is at most 1 - p) read from the other end. Where every
  row's top-k is at most 256, one `topk` of max(k) + 1 gives both the top-k (every token tied with the k-th kept, as
  vLLM keeps them; a tie reaching the last candidate falls back) and its nucleus. Otherwise top-k is vLLM's own
  `apply_top_k_only` (no sort) and the nucleus comes from `topk` candidates (64, 512, 4096, 16384, 65536, up to
  half the vocabulary; a count reaching the vocabulary holds any nucleus): when the mass of all but the last
  candidate already reaches p, no token outside them can be kept in any order of ties, so the result is exact;
  otherwise vLLM's full sort runs. A failed count gives a lower bound on the nucleus (no token below it is more
  likely than its last), and counts below the bound are skipped. The masses are summed in float64: vLLM's float32
  sum over the whole vocabulary drifts by ~1e-6, enough to keep or drop one more token where the mass lands that
  close to p. A row whose p is 1 or more is left as top-k made it.
- `inverse_cdf_sample`: one uniform variate per row; the first index whose cumulative probability (float64)
  reaches u * total, u in (0, 1]. A token of probability zero (masked) is never chosen: its cumulative sum equals
  its predecessor's, so an earlier index reaches u first, and index 0 would need u <= 0.
- `apply_repetition_penalties`: vLLM's torch fallback for the repetition penalty, computed on the tokens the prompt
  and output hold instead of over the whole vocabulary; the same float32 operations, so the same bits.

Seeded requests (`generators`) keep vLLM's exponential-noise path: their streams stay vLLM's. EDGE_SELECT_SAMPLER=vllm
leaves vLLM's sampler as shipped (the benchmark measures both).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from vllm.logger import init_logger

logger = init_logger("vllm.edge_select.sampling")

_MARK = "_edge_select_sampler"
# Candidate counts for top-p before falling back to the full sort. Over 49152 entries on one Zen 5 core: topk(64)
# ~66 us, topk(512) ~90-220 us, topk(4096) ~450-720 us, topk(16384) ~1.4 ms, topk(32768) 2.4 ms; the full sort
# ~3.4-3.8 ms. Over 151936: topk(16384) 2.7 ms, topk(32768) 3.7 ms, the sort 11.5 ms (topk(65536) not timed).
TOP_P_CANDIDATES = (64, 512, 4096, 16384, 65536)
# No count above this share of the vocabulary: past it the vocabulary itself (exact) or vLLM's sort runs. A chosen
# cutoff, not a measured crossover (topk(32768) of 49152 still beat the sort).
TOP_P_MAX_FRACTION = 0.5
# Top-k at most this (llama.cpp's default is 40) takes one topk of k + 1 for both top-k and top-p.
TOP_K_CANDIDATES = 256
# vLLM's own functions this module replaced in this process, by name (benchmarks and tests compare against them)
ORIGINALS: dict[str, Callable] = {}


def inverse_cdf_sample(logits: torch.Tensor) -> torch.Tensor:
    """One token id per row, drawn from softmax(logits) with the global CPU generator (what Gumbel-max draws)."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    # torch.rand is in [0, 1), so 1 - rand is in (0, 1] and u in (0, total]: some index always reaches it.
    u = (1.0 - torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device)) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).clamp_(max=cdf.shape[1] - 1).view(-1)


def _candidate_counts(vocab: int) -> list[int]:
    """The topk counts tried for top-p over `vocab` tokens: TOP_P_CANDIDATES up to TOP_P_MAX_FRACTION of the
    vocabulary; a count reaching the vocabulary is the vocabulary itself, which is exact whatever the nucleus."""
    counts = []
    for count in TOP_P_CANDIDATES:
        if count >= vocab:
            return [*counts, vocab]
        if count > vocab * TOP_P_MAX_FRACTION:
            break
        counts.append(count)
    return counts


def _nucleus_lower_bound(p: torch.Tensor, mass: torch.Tensor, last: torch.Tensor, count: int,
                         rows: torch.Tensor) -> float:  # fmt: skip
    """The fewest tokens some row of `rows` may need for its nucleus, from its top `count` (their mass `mass`, the
    count-th probability `last`): every token below them has probability at most `last`, so reaching p takes at
    least count + (p - mass) / last tokens. A candidate count below it cannot succeed and is skipped."""
    need = count + (p - mass).clamp(min=0) / last.to(torch.float64).clamp(min=torch.finfo(torch.float64).tiny)
    return float(need[rows].max())


def _top_p_from_candidates(logits: torch.Tensor, p: torch.Tensor, limited: torch.Tensor) -> bool:
    """Mask, in place, the rows `limited` of `logits` to their top-p nucleus from topk candidates; False (and
    `logits` untouched) when some limited row's nucleus may reach past the largest candidate count."""
    vocab = logits.shape[1]
    if vocab < 2:
        return True
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    need = 0.0  # a lower bound on the largest nucleus among the rows not yet held
    for count in _candidate_counts(vocab):
        if count < vocab and need > count - 1:
            continue  # cannot hold it: all but the last candidate would have to reach p
        top_probs, top_idx = probs.topk(count, dim=-1)
        mass = top_probs.cumsum(dim=-1, dtype=torch.float64)
        mass_before = mass - top_probs
        # Exact only if all but the last candidate already reach p (ties with the last cannot enter then).
        reached = mass[:, -2] >= p
        if count < vocab and not bool((reached | ~limited).all()):
            need = _nucleus_lower_bound(p, mass[:, -1], top_probs[:, -1], count, ~reached & limited)
            continue
        keep = mass_before < p.unsqueeze(1)
        keep[:, 0] = True
        drop = torch.ones_like(logits, dtype=torch.bool)
        drop.scatter_(1, top_idx, ~keep)
        drop &= limited.unsqueeze(1)
        logits.masked_fill_(drop, -float("inf"))
        return True
    return False


def _top_k_top_p_from_candidates(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor | None) -> bool:
    """Top-k, then top-p, from one `topk` of max(k) + 1 candidates, when every row's k is at most
    `TOP_K_CANDIDATES`: `logits` masked in place and True; False (`logits` untouched) when a row's k-th value ties
    the last candidate, so that vLLM's top-k (which keeps every token tied with the k-th) might keep more."""
    vocab = logits.shape[1]
    largest = int(k.max())
    if largest > TOP_K_CANDIDATES or largest + 1 > vocab or int(k.min()) < 1:
        return False
    values, index = logits.topk(largest + 1, dim=-1)
    kth = values.gather(1, (k.to(torch.long) - 1).unsqueeze(1))
    if bool((values[:, -1:] >= kth).any()):
        return False
    kept = values >= kth  # top-k exactly as vLLM's apply_top_k_only keeps it, ties included
    if p is not None:
        limited = (p < 1).unsqueeze(1)
        probs = values.masked_fill(~kept, -float("inf")).softmax(dim=-1, dtype=torch.float32)
        mass_before = probs.cumsum(dim=-1, dtype=torch.float64) - probs
        nucleus = mass_before < p.to(torch.float64).unsqueeze(1)
        nucleus[:, 0] = True
        kept &= nucleus | ~limited
    logits.fill_(-float("inf"))
    logits.scatter_(1, index, values.masked_fill(~kept, -float("inf")))
    return True


def top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's `apply_top_k_top_p` on CPU without sorting the vocabulary (see the module's docstring). May update
    `logits` in place, as vLLM's does."""
    from vllm.v1.sample.ops import topk_topp_sampler as vllm_sampler

    if k is not None and _top_k_top_p_from_candidates(logits, k, p):
        return logits
    if k is not None:
        logits = vllm_sampler.apply_top_k_only(logits, k)
    if p is None:
        return logits
    limited = p < 1
    if not bool(limited.any()):
        return logits
    if _top_p_from_candidates(logits, p.to(torch.float64), limited):
        return logits
    return vllm_sampler.apply_top_k_top_p_pytorch(logits, None, p, allow_cpu_sync=True)


def apply_repetition_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_mask: torch.Tensor,
                               repetition_penalties: torch.Tensor) -> None:
    """vLLM's `apply_repetition_penalties_torch` (its CPU path) on the tokens seen only, bit for bit: a seen token's
    logit times 1 / penalty where positive, times the penalty otherwise; every other logit untouched (vLLM multiplies
    it by 1.0). vLLM's builds, per step, a penalty and a scale for every vocabulary entry of every row."""
    rows, cols = (prompt_mask | output_mask).nonzero(as_tuple=True)
    if rows.numel() == 0:
        return
    values = logits[rows, cols]
    penalties = repetition_penalties.to(logits.dtype)[rows]
    logits[rows, cols] = values * torch.where(values > 0, 1.0 / penalties, penalties)


def _cpu_top_k_top_p(original: Callable) -> Callable:
    def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
        if logits.device.type != "cpu":
            return original(logits, k, p)
        return top_k_top_p(logits, k, p)

    setattr(apply_top_k_top_p, _MARK, original)
    return apply_top_k_top_p


def install() -> bool:
    """Route vLLM's CPU sampler through this module, once per process; True if it is (now) in place.

    Only on the CPU platform without Triton (where vLLM would use its Triton top-k/top-p instead), and not with
    EDGE_SELECT_SAMPLER=vllm. Not hashed into vLLM's compile-cache key: the sampler is outside the compiled graph.
    """
    if os.environ.get("EDGE_SELECT_SAMPLER", "edge") == "vllm":
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.sample.ops import topk_topp_sampler as vllm_sampler

    if getattr(vllm_sampler, "HAS_TRITON", False):
        return False
    if not getattr(vllm_sampler.apply_top_k_top_p, _MARK, None):
        from vllm import _custom_ops

        vllm_sampler.apply_top_k_top_p = _cpu_top_k_top_p(vllm_sampler.apply_top_k_top_p)
        vllm_sampler.compiled_random_sample = inverse_cdf_sample
        # vLLM's CPU path for the repetition penalty (apply_repetition_penalties calls it for non-CUDA tensors)
        ORIGINALS["apply_repetition_penalties_torch"] = _custom_ops.apply_repetition_penalties_torch
        _custom_ops.apply_repetition_penalties_torch = apply_repetition_penalties
        logger.info("cpu_int4 plugin: CPU sampling by topk candidates and inverse CDF (no vocabulary sort)")
    return True
