"""Speculative sampling keeps a Session's output distribution: over many seeds, the token decided
by the first verification has the same distribution with and without speculation. Every request
repeats the start of the model's own greedy sentence; its first token is forced to continue the
repetition, so the n-gram drafter proposes the sentence's next tokens for the second, which is
sampled (temperature 1) from the verification's logits, where the first draft has about 0.6. A two-sample chi-square test at p = 0.001; a rule that always
accepted the drafts fails it far above."""
from __future__ import annotations

import collections

from qwen_npu import SamplingParams, Session
from qwen_npu.testing import tiny_trained_qwen3

START = "The word ocean means"
SEEDS = 600
OPTIONS = dict(device="cpu", kernels="reference", max_batch=SEEDS, block_size=4, num_blocks=4096, max_model_len=64,
               chunk_size=4096)


def sentence() -> list[int]:
    """START and the model's greedy continuation of it, as token ids."""
    sess = Session.from_pretrained(tiny_trained_qwen3(), device="cpu", kernels="reference")
    out = sess.generate([START], SamplingParams(max_new_tokens=10), progress=False)[0]
    return sess.tokenizer.encode(START) + list(out.token_ids)


def second_tokens(**spec) -> tuple[collections.Counter, object]:
    sess = Session.from_pretrained(tiny_trained_qwen3(), **OPTIONS, **spec)
    s = sentence()
    prompt, first = s + s[:4], s[4]                    # first: the repetition's next token
    reqs = [sess.add_request(prompt, SamplingParams(max_new_tokens=5, temperature=1.0, seed=i, ignore_eos=True))
            for i in range(SEEDS)]
    while any(not r.output_token_ids for r in reqs):
        step = sess.prefill()
        sess.sample(step, force={rid: first for rid in step.logits_request_ids})
    while not all(r.is_done for r in reqs):
        sess.step()
    return collections.Counter(r.output_token_ids[1] for r in reqs), sess


def two_sample_chi_square(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the tokens seen at least 10 times in all; the rest pooled."""
    na, nb = sum(a.values()), sum(b.values())
    common = [t for t in a.keys() | b.keys() if a[t] + b[t] >= 10]
    cells = [(a[t], b[t]) for t in common]
    rest = (na - sum(x for x, _ in cells), nb - sum(y for _, y in cells))
    if sum(rest):
        cells.append(rest)
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(cells) - 1


# chi-square critical values at p = 0.001 by degrees of freedom
CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
            11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


def test_the_first_verified_token_keeps_its_distribution():
    plain, _ = second_tokens()
    spec, sess = second_tokens(speculative="ngram", num_speculative_tokens=3)
    stats = sess.speculation_stats()
    assert stats.num_drafts > SEEDS // 2 and 0 < stats.num_accepted < stats.num_drafts, stats   # drafts were tested
    assert len(plain) > 2, "the second token hardly varies: the test would prove nothing"
    stat, dof = two_sample_chi_square(plain, spec)
    assert 1 <= dof <= max(CRITICAL)
    assert stat < CRITICAL[dof], (stat, dof, plain.most_common(8), spec.most_common(8))


def test_the_test_tells_a_wrong_rule(monkeypatch):
    """Accepting every draft (no rejection) moves the distribution far past the critical value."""
    from qwen_npu.engine import verify
    real = verify.sample_with_drafts

    def always_accept(logits, params, gens, drafts, pinned):
        ids, h2d = real(logits, params, gens, drafts, pinned)
        for i, d in enumerate(drafts):
            if d >= 0:
                ids[i] = d
        return ids, h2d
    plain, _ = second_tokens()
    monkeypatch.setattr(verify, "sample_with_drafts", always_accept)
    wrong, _ = second_tokens(speculative="ngram", num_speculative_tokens=3)
    stat, dof = two_sample_chi_square(plain, wrong)
    assert stat > CRITICAL[dof], (stat, dof)
