"""n-gram drafting only while few enough sequences decode for a verify pass to stay on the decode kernel.

vLLM 0.28's n-gram proposer drafts for every sequence of a batch. A verify pass then has k + 1 rows per sequence:
one sequence with k = 3 is 4 rows, which the AVX2 decode kernels take reading each weight once, but 4 sequences are
16 rows, which go to tinygemm. On the default model (AMD EPYC Zen 5, 1 thread) 4 streams served 265.1 tok/s with
drafting against 351.3 without (docs/reports/2026-12-07-speculative.md), while one stream gained 1.84x on a summary.
So the plan names how many sequences may draft at once (EDGE_DRAFT_MAX_SEQS, edge.plan.speculative); a step with more
sequences than that proposes nothing, and vLLM verifies no draft in it (a sequence without drafts is an ordinary
decode row). Installed only where the plan drafts: importing the proposer imports numba.
"""

from __future__ import annotations

import logging
import os

from edge.plan.speculative import DRAFT_MAX_SEQS_ENV as ENV

log = logging.getLogger(__name__)

_MARK = "_edge_select_draft_limit"


def install() -> bool:
    """Wrap NgramProposer.propose with the plan's limit; False where the plan sets none."""
    value = os.environ.get(ENV)
    if not value:
        return False
    limit = int(value)
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    original = NgramProposer.propose
    if getattr(original, _MARK, False):
        return True

    def propose(self, num_speculative_tokens, sampled_token_ids, *args, **kwargs):
        if sum(1 for ids in sampled_token_ids if ids) > limit:
            return [[] for _ in sampled_token_ids]
        return original(self, num_speculative_tokens, sampled_token_ids, *args, **kwargs)

    setattr(propose, _MARK, True)
    NgramProposer.propose = propose
    log.info("n-gram drafting while at most %d sequences decode (%s)", limit, ENV)
    return True
