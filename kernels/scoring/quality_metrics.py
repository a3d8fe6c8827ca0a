"""What edge-eval measures: per-token statistics of a candidate model against its source, and their summary.

Per scored position t (the source's distribution P, the candidate's Q, both log-softmaxed in float32 from the
models' bf16 logits):
    kld              KL(P || Q) = sum_v P(v) (log P(v) - log Q(v)), in nats
    nll_source       -log P(next token), likewise nll_candidate
    top1_agree       argmax P == argmax Q
    source_top1_prob max_v P(v)

The summary follows llama.cpp's `llama-perplexity --kl-divergence` (tools/perplexity), whose anchors FACTS.md
quotes: mean KLD, the 99th percentile, top-1 agreement, and the perplexity ratio exp(mean(nll_c - nll_s)), which
is the ratio of the two perplexities on the same tokens. A confident flip is a position where the source puts
more than half its mass on its top-1 token and the candidate's top-1 differs: the errors greedy decoding turns
into a different continuation.

Standard errors treat the scored tokens as independent samples, as llama.cpp does. Tokens of one chunk share a
context, so these understate the true spread somewhat; they are for telling noise from a difference, not for
confidence intervals to the last digit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

CONFIDENT = 0.5  # source top-1 probability above which a changed top-1 counts as a confident flip
PERCENTILE = 0.99


@dataclass
class TokenStats:
    """Per scored token, all [T]: float64 except top1_agree (bool)."""

    kld: torch.Tensor
    nll_source: torch.Tensor
    nll_candidate: torch.Tensor
    top1_agree: torch.Tensor
    source_top1_prob: torch.Tensor

    def __len__(self) -> int:
        return self.kld.shape[0]

    @staticmethod
    def cat(parts: list[TokenStats]) -> TokenStats:
        return TokenStats(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(TokenStats)})


def token_stats(source_logits: torch.Tensor, candidate_logits: torch.Tensor, targets: torch.Tensor) -> TokenStats:
    """source_logits, candidate_logits [T, V] (any float dtype), targets int64 [T] -> TokenStats of T tokens."""
    assert source_logits.shape == candidate_logits.shape, (source_logits.shape, candidate_logits.shape)
    assert targets.shape == source_logits.shape[:1], (targets.shape, source_logits.shape)
    log_p = torch.log_softmax(source_logits.float(), dim=-1)  # [T, V] fp32
    log_q = torch.log_softmax(candidate_logits.float(), dim=-1)  # [T, V] fp32
    kld = (log_p.exp() * (log_p - log_q)).sum(dim=-1)  # [T]; exactly 0 where log_p == log_q
    index = targets.view(-1, 1)
    top_p, top_source = log_p.max(dim=-1)  # [T]
    return TokenStats(
        kld=kld.double(),
        nll_source=-log_p.gather(1, index).squeeze(1).double(),
        nll_candidate=-log_q.gather(1, index).squeeze(1).double(),
        top1_agree=top_source == log_q.argmax(dim=-1),
        source_top1_prob=top_p.exp().double(),
    )


def mean_se(values: torch.Tensor) -> tuple[float, float]:
    """Mean and its standard error std/sqrt(n) (sample std, n - 1)."""
    n = values.numel()
    mean = float(values.double().mean())
    se = float(values.double().std(correction=1)) / math.sqrt(n) if n > 1 else math.nan
    return mean, se


def proportion_se(hits: int, n: int) -> tuple[float, float]:
    """A fraction and its binomial standard error sqrt(p (1 - p) / n)."""
    p = hits / n
    return p, math.sqrt(p * (1 - p) / n)


def quantile_se(values: torch.Tensor, q: float) -> tuple[float, float]:
    """The q-quantile (linear interpolation) and an order-statistic standard error.

    The rank of the sample q-quantile is binomial, with standard deviation d = sqrt(n q (1 - q)) ranks; the
    order statistics d ranks either side bound a distribution-free interval of about +-1 SE, so half their
    distance is the SE. No resampling, so the same tokens always give the same number.
    """
    ordered = values.double().sort().values  # [T]
    n = ordered.numel()
    value = float(torch.quantile(ordered, q))
    rank = q * (n - 1)
    spread = math.sqrt(n * q * (1 - q))
    low = ordered[max(0, math.floor(rank - spread))]
    high = ordered[min(n - 1, math.ceil(rank + spread))]
    return value, float(high - low) / 2


def ratio_se(differences: torch.Tensor) -> tuple[float, float]:
    """exp(mean d) and its delta-method SE exp(mean d) * SE(mean d), for paired per-token differences d."""
    mean, se = mean_se(differences)
    ratio = math.exp(mean)
    return ratio, ratio * se


def summarize(stats: TokenStats) -> dict[str, Any]:
    """The report's metrics, each {"value", "se"}, plus counts."""
    n = len(stats)
    assert n > 0, "no scored tokens"
    agree = int(stats.top1_agree.sum())
    confident = stats.source_top1_prob > CONFIDENT  # [T] bool
    flips = int((confident & ~stats.top1_agree).sum())
    confident_count = int(confident.sum())

    def entry(pair: tuple[float, float]) -> dict[str, float]:
        return {"value": pair[0], "se": pair[1]}

    source_ppl = ratio_se(stats.nll_source)
    candidate_ppl = ratio_se(stats.nll_candidate)
    return {
        "tokens": n,
        "mean_kld": entry(mean_se(stats.kld)),
        "p99_kld": {**entry(quantile_se(stats.kld, PERCENTILE)), "se_method": "order statistic"},
        "top1_agreement": entry(proportion_se(agree, n)),
        "ppl_ratio": {**entry(ratio_se(stats.nll_candidate - stats.nll_source)), "se_method": "delta, paired"},
        "source_ppl": entry(source_ppl),
        "candidate_ppl": entry(candidate_ppl),
        "confident_flip_rate": entry(proportion_se(flips, n)),
        "confident_positions": confident_count,
        "confident_flips": flips,
        "flip_rate_among_confident": flips / confident_count if confident_count else None,
    }
