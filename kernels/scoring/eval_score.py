"""Run the source and the candidate over the same chunks, side by side, and keep per-token statistics.

Both models see each window at once (one forward of chunk_len rows, no KV cache), as a prompt is processed.
Only the scored half's logits are computed (`logits_to_keep`): the head GEMM, a third of the work on
SmolLM2-135M, runs on chunk_len/2 rows. Full distributions are never kept: 16384 positions x 49152 fp32
log-probs would be 3.2 GB per model, so each chunk's KLD etc. is reduced to per-token numbers before the next.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from kernels.scoring.quality_metrics import TokenStats, token_stats


def scored_logits(model: nn.Module, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """ids int64 [1, L] -> logits [keep, V] of the last `keep` positions (model dtype)."""
    return model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[0]


def score(source: nn.Module, candidate: nn.Module, windows: torch.Tensor, *, progress: bool = True) -> TokenStats:
    """windows int64 [C, L+1] (kernels.scoring.eval_text.make_windows) -> TokenStats of C x L/2 tokens, in text
    order."""
    from tqdm import tqdm

    length = windows.shape[1] - 1
    first = length // 2
    keep = length - first  # positions first .. L-1 predict tokens first+1 .. L
    parts = []
    with torch.inference_mode(), tqdm(total=windows.shape[0], desc="edge-eval", unit="chunk", file=sys.stderr,
                                      disable=not progress) as bar:  # fmt: skip
        for window in windows:
            ids = window[:-1].unsqueeze(0)  # [1, L]
            targets = window[first + 1 :]  # [keep]
            source_logits = scored_logits(source, ids, keep)  # [keep, V]
            candidate_logits = scored_logits(candidate, ids, keep)  # [keep, V]
            parts.append(token_stats(source_logits, candidate_logits, targets))
            bar.update(1)
    return TokenStats.cat(parts)
