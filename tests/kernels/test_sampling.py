"""The plugin's CPU sampler (kernels/vllm_plugin/sampling.py) against vLLM's own: same nucleus, same distribution."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.sample.ops import topk_topp_sampler as vllm_sampler  # noqa: E402

from kernels.vllm_plugin import sampling  # noqa: E402

VOCAB = 49152  # the default model's


def _vllm_top_k_top_p(logits: torch.Tensor, k, p) -> torch.Tensor:
    """vLLM's CPU path as shipped (the plugin may already have replaced the module's dispatcher)."""
    return vllm_sampler.apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=True)


def _rows(seed: int, rows: int, scale: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=generator) * scale


def _exact_nucleus(logits: torch.Tensor, k, p) -> torch.Tensor:
    """The rule in float64 over a full sort: top-k (vLLM's, no sort), then keep a token iff the mass of the more
    likely tokens is below p (the most likely always kept); rows with p >= 1 keep what top-k kept."""
    logits = logits.clone() if k is None else vllm_sampler.apply_top_k_only(logits.clone(), k)
    kept = torch.isfinite(logits)
    if p is None:
        return kept
    probs = logits.softmax(dim=-1, dtype=torch.float32).to(torch.float64)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_before < p.to(torch.float64).unsqueeze(1)
    keep_sorted[:, 0] = True
    nucleus = torch.zeros_like(kept).scatter_(1, order, keep_sorted)
    return torch.where((p < 1).unsqueeze(1), nucleus & kept, kept)


@pytest.mark.parametrize("scale", [0.5, 2.0, 4.0, 8.0])
@pytest.mark.parametrize("k_values,p_values", [
    (None, [0.9, 0.95, 0.5, 0.99]),
    ([40, 40, 40, 40], [0.95, 0.95, 0.95, 0.95]),  # llama.cpp server's defaults
    ([1, 5, 100, VOCAB], [0.8, 1.0, 0.3, 0.7]),  # mixed, one row without top-p, one without top-k
    ([1, 5, 100, 256], [0.8, 1.0, 0.3, 0.7]),  # the same within one topk of k + 1
    ([20, 3000, 7, 64], None),
    ([3, 40, 64, 200], None),
])
def test_same_nucleus_as_vllm(scale, k_values, p_values):
    """Without ties (float32 normal logits), the kept set is the rule's exactly, in every path: peaked rows (the
    64-candidate step), flatter ones (512, 4096), and flat ones (vLLM's full sort). vLLM's own result differs
    only in tokens whose preceding mass lies within 1e-5 of p (its float32 sum over the whole vocabulary)."""
    logits = _rows(int(scale * 10), 4, scale)
    k = None if k_values is None else torch.tensor(k_values)
    p = None if p_values is None else torch.tensor(p_values)
    ours = sampling.top_k_top_p(logits.clone(), k, p)
    kept = torch.isfinite(ours)
    assert torch.equal(kept, _exact_nucleus(logits, k, p))
    assert torch.equal(ours[kept], logits[kept])  # kept logits untouched
    differ = kept ^ torch.isfinite(_vllm_top_k_top_p(logits, k, p))
    if differ.any():
        masked = logits.clone() if k is None else vllm_sampler.apply_top_k_only(logits.clone(), k)
        probs = masked.softmax(dim=-1).to(torch.float64)
        for row, token in differ.nonzero().tolist():
            before = probs[row][probs[row] > probs[row, token]].sum()
            assert abs(float(before) - float(p[row])) < 1e-5, (row, token, float(before))


def test_each_candidate_step_is_exercised():
    """The rows above reach every path: the nucleus within 64, within 512, within 4096, and past it (the full
    sort)."""
    sizes = []
    for scale in (0.5, 2.0, 4.0, 8.0):
        logits = _rows(int(scale * 10), 4, scale)
        nucleus = sampling.top_k_top_p(logits.clone(), None, torch.full((4,), 0.95))
        sizes += torch.isfinite(nucleus).sum(dim=1).tolist()
    assert min(sizes) < 64 and any(64 <= s < 512 for s in sizes), sizes
    assert any(512 <= s < 4096 for s in sizes) and max(sizes) > 4096, sizes


def test_the_lower_bound_holds_and_only_skips_counts_that_cannot_hold_the_nucleus(monkeypatch):
    """`_nucleus_lower_bound` never exceeds the true largest nucleus, and skipping by it changes no result: over rows
    from peaked to flat and several p, the masked logits with the skips equal those without; a flat row goes from
    the 64-candidate step past the counts its bound rules out."""
    calls: list[tuple[int, float]] = []
    original = sampling._nucleus_lower_bound

    def recording(p, mass, last, count, rows):
        need = original(p, mass, last, count, rows)
        calls.append((count, need))
        return need

    def never_skip(*args):
        return 0.0

    for scale in (0.5, 1.0, 2.0, 3.0, 4.0, 8.0):
        for p_value in (0.3, 0.8, 0.95, 0.99):
            logits = _rows(int(scale * 100 + p_value * 10), 4, scale)
            p = torch.full((4,), p_value, dtype=torch.float64)
            limited = torch.ones(4, dtype=torch.bool)
            monkeypatch.setattr(sampling, "_nucleus_lower_bound", never_skip)
            without = logits.clone()
            fits = sampling._top_p_from_candidates(without, p, limited)
            monkeypatch.setattr(sampling, "_nucleus_lower_bound", recording)
            calls.clear()
            with_skips = logits.clone()
            assert sampling._top_p_from_candidates(with_skips, p, limited) is fits
            assert torch.equal(with_skips, without if fits else logits)
            largest = int(_exact_nucleus(logits, None, p.float()).sum(dim=1).max())
            assert all(need <= largest for _, need in calls), (calls, largest)
            if scale == 0.5 and p_value >= 0.8:  # flat: a nucleus of tens of thousands; 512 and 4096 skipped
                assert largest > 16384 and [count for count, _ in calls] == [64, 16384], (calls, largest)


def test_ties_keep_a_valid_nucleus():
    """bf16-rounded logits tie often; whichever tied tokens are kept, the set is a nucleus: its mass reaches p,
    it is the most likely tokens, and without its least likely member it would not reach p."""
    logits = _rows(7, 8, 3.0).to(torch.bfloat16).to(torch.float32)
    p = torch.tensor([0.5, 0.8, 0.9, 0.95, 0.99, 0.3, 0.7, 0.6])
    ours = sampling.top_k_top_p(logits.clone(), None, p)
    probs = logits.softmax(dim=-1)
    for row in range(logits.shape[0]):
        kept = torch.isfinite(ours[row])
        kept_probs = probs[row][kept]
        assert kept_probs.sum() >= p[row] - 1e-5
        assert kept_probs.sum() - kept_probs.min() < p[row] + 1e-5
        if (~kept).any():
            assert probs[row][~kept].max() <= kept_probs.min()
        reference = torch.isfinite(_vllm_top_k_top_p(logits[row:row + 1], None, p[row:row + 1]))[0]
        assert abs(int(kept.sum()) - int(reference.sum())) <= int((probs[row] == kept_probs.min()).sum())


def test_inverse_cdf_draws_the_softmax_distribution():
    """200000 draws over 6 tokens (two masked, at both ends): never a masked token, and frequencies within
    4.5 standard errors of softmax's probabilities (the seed is fixed: the test is deterministic)."""
    torch.manual_seed(1234)
    logits = torch.tensor([-math.inf, 2.0, 0.5, -1.0, 1.0, -math.inf])
    draws = 200_000
    tokens = sampling.inverse_cdf_sample(logits.expand(draws, -1).contiguous())
    assert tokens.shape == (draws,)
    counts = torch.bincount(tokens, minlength=6).to(torch.float64)
    assert counts[0] == 0 and counts[5] == 0
    probs = logits.softmax(dim=-1).to(torch.float64)
    se = (probs * (1 - probs) / draws).sqrt()
    z = ((counts / draws - probs).abs() / se.clamp(min=1e-12))[1:5]
    assert float(z.max()) < 4.5, z


def test_inverse_cdf_single_finite_token_and_bf16_input():
    logits = torch.full((3, VOCAB), -math.inf, dtype=torch.bfloat16)
    logits[0, 0] = 1.0
    logits[1, VOCAB - 1] = -3.0
    logits[2, 12345] = 0.0
    assert sampling.inverse_cdf_sample(logits).tolist() == [0, VOCAB - 1, 12345]


def test_installed_sampler_routes_vllm_cpu_path():
    """After install(), vLLM's TopKTopPSampler on CPU samples through this module, and only inside the nucleus."""
    assert sampling.install()
    assert vllm_sampler.compiled_random_sample is sampling.inverse_cdf_sample
    from vllm import _custom_ops

    assert _custom_ops.apply_repetition_penalties_torch is sampling.apply_repetition_penalties
    assert sampling.install()  # idempotent
    sampler = vllm_sampler.TopKTopPSampler()
    assert sampler.forward == sampler.forward_cpu
    torch.manual_seed(0)
    logits = _rows(3, 4, 4.0)
    k, p = torch.tensor([40, 40, 40, 40]), torch.tensor([0.95, 0.95, 0.95, 0.95])
    nucleus = torch.isfinite(_vllm_top_k_top_p(logits, k, p))
    for _ in range(50):
        tokens, _ = sampler.forward_cpu(logits.clone(), {}, k, p)
        assert nucleus.gather(1, tokens.view(-1, 1)).all()


def test_top_k_ties_keep_what_vllm_keeps():
    """vLLM's top-k keeps every token tied with the k-th; bf16-rounded logits tie often, and a tie running past the
    k + 1 candidates falls back to vLLM's own top-k: the kept set is vLLM's in every case."""
    logits = _rows(11, 8, 3.0).to(torch.bfloat16).to(torch.float32)
    logits[0, 100:140] = logits[0].max() + 1  # 40 tied maxima: k 20 keeps all 40 (the fallback)
    k = torch.tensor([20, 40, 40, 1, 2, 64, 256, 7])
    ours = torch.isfinite(sampling.top_k_top_p(logits.clone(), k, None))
    assert torch.equal(ours, torch.isfinite(vllm_sampler.apply_top_k_only(logits.clone(), k)))
    assert int(ours[0].sum()) == 40
    p = torch.full((8,), 0.9)
    nucleus = torch.isfinite(sampling.top_k_top_p(logits.clone(), k, p))
    assert (nucleus <= ours).all() and (nucleus.sum(dim=1) >= 1).all()


def test_repetition_penalty_is_vllms_bit_for_bit():
    """Positive and negative logits, seen in the prompt, the output, both or neither, a row without penalty (1.0):
    the plugin's sparse penalty leaves exactly the bits vLLM's dense one does."""
    from vllm import _custom_ops

    vllm_dense = sampling.ORIGINALS.get("apply_repetition_penalties_torch",
                                        _custom_ops.apply_repetition_penalties_torch)
    assert vllm_dense is not sampling.apply_repetition_penalties
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, VOCAB, generator=generator) * 5
    logits[0, :10] = -float("inf")
    prompt_mask = torch.rand(4, VOCAB, generator=generator) < 0.002
    output_mask = torch.rand(4, VOCAB, generator=generator) < 0.002
    prompt_mask[0, :5] = True
    penalties = torch.tensor([1.1, 1.0, 1.3, 0.9])
    theirs, ours = logits.clone(), logits.clone()
    vllm_dense(theirs, prompt_mask, output_mask, penalties)
    sampling.apply_repetition_penalties(ours, prompt_mask, output_mask, penalties)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, logits)
    nothing = torch.zeros_like(prompt_mask)
    untouched = logits.clone()
    sampling.apply_repetition_penalties(untouched, nothing, nothing, penalties)
    assert torch.equal(untouched, logits)
