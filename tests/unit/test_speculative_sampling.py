"""Speculative sampling keeps the sampling distribution: a row that tests a draft ``d`` accepts it
with probability ``p(d)`` and otherwise draws from ``p`` without ``d``, so its token has exactly
the distribution ``p`` (temperature, top-k and top-p applied). Checked with a chi-square test
over many independently seeded rows, against ``p`` and against the plain sampler; the n-gram
drafter and the acceptance counts are checked on their own.
"""
from __future__ import annotations

import torch

from qwen_npu import SamplingParams
from qwen_npu.engine import sampler
from qwen_npu.engine.speculative import SpecStats, propose_ngram
from qwen_npu.engine.verify import sample_with_drafts

ROWS = 20000
VOCAB = 6
LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.5, 1.0, -2.0])
# chi-square critical value for 5 degrees of freedom at p = 0.001 (a wrong rule fails far above it)
CRITICAL_5DOF = 20.52


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def draw(params: SamplingParams, draft: int, seed0: int = 0) -> torch.Tensor:
    logits = LOGITS.repeat(ROWS, 1)
    gens = [sampler.new_generator(torch.device("cpu"), seed0 + i) for i in range(ROWS)]
    ids, _ = sample_with_drafts(logits, [params] * ROWS, gens, [draft] * ROWS, None)
    return torch.bincount(ids, minlength=VOCAB).double()


def target(params: SamplingParams) -> torch.Tensor:
    x = LOGITS[None].float() / params.temperature
    ks = torch.tensor([params.top_k if params.top_k else VOCAB])
    ps = torch.tensor([params.top_p if params.top_p < 1 else float("inf")])
    return torch.softmax(sampler.mask_top_k_top_p(x, ks, ps), -1)[0].double()


def test_a_tested_row_draws_from_the_target_distribution_whatever_the_draft():
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                   SamplingParams(temperature=1.3, top_p=0.8)):
        p = target(params)
        for draft in (0, 2, 5):                      # likely, unlikely, outside top-k / top-p
            counts = draw(params, draft)
            assert chi_square(counts, p) < CRITICAL_5DOF, (params, draft, counts, p)


def test_the_accepted_share_of_a_draft_is_its_probability():
    params = SamplingParams(temperature=1.0)
    p = target(params)
    counts = draw(params, 1, seed0=10**6)
    share = counts[1] / ROWS
    assert abs(share - p[1]) < 4 * (p[1] * (1 - p[1]) / ROWS) ** 0.5


def test_a_wrong_rule_is_caught_by_the_same_test():
    """Always accepting the draft (no rejection) is far from the target: the test can fail."""
    p = target(SamplingParams(temperature=1.0))
    always = torch.zeros(VOCAB, dtype=torch.float64)
    always[2] = ROWS
    assert chi_square(always, p) > 100 * CRITICAL_5DOF


def test_greedy_rows_and_rows_without_a_draft_are_sampled_as_the_plain_sampler_samples_them():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams()] * 4 + [SamplingParams(temperature=0.8, seed=3)] * 4
    gens = [None] * 4 + [sampler.new_generator(torch.device("cpu"), i) for i in range(4)]
    twins = [None] * 4 + [sampler.new_generator(torch.device("cpu"), i) for i in range(4)]
    ids, _ = sample_with_drafts(logits, params, gens, [7, 7, -1, -1, -1, -1, -1, -1], None)
    plain, _ = sampler.sample(logits, params, twins)
    assert torch.equal(ids, plain)


def test_the_ngram_drafter_prefers_the_longest_match_followed_by_k_tokens():
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], 3) == (3, 1, 2)
    assert propose_ngram([9, 4, 5, 7, 4, 5, 8, 5], 2) == (8, 5)      # the latest full continuation of [5]
    assert propose_ngram([1, 2, 3, 4, 2], 3) == (3, 4, 2)
    assert propose_ngram([1, 2, 3, 4, 5], 3) == ()
    assert propose_ngram([1, 2, 1], 3) == (2, 1)                      # a shorter one when none is longer
    assert propose_ngram([], 3) == () and propose_ngram([4], 3) == ()


def test_acceptance_counts_add_up_by_position():
    s = SpecStats().add(3, 1).add(2, 2).add(3, 0)
    assert s.drafted == (3, 3, 2) and s.accepted == (2, 1, 0)
    assert s.num_drafts == 8 and s.num_accepted == 3 and s.rate_by_position == (2 / 3, 1 / 3, 0.0)
    assert (s + SpecStats((1,), (1,))).drafted == (4, 3, 2)
    assert SpecStats().acceptance_rate == 0.0
