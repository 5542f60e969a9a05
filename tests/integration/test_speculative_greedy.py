"""Speculative decoding keeps greedy streams exactly: with ``speculative="ngram"`` every request
gets the tokens it gets without speculation, in every kernel set (this module runs once per set),
with chunked prefill, with the prefix cache on and off, with mixed steps and under preemption;
bit for bit with ``deterministic=True``. The runs must verify drafts, accept some and reject some
(else they would prove nothing), and ``check()`` passes after every step.
"""
from __future__ import annotations

import pytest
import torch

from qwen_npu import SamplingParams, Session
from qwen_npu.testing import tiny_trained_qwen3

# copy-heavy prompts: the trained model's induction head continues what it has seen
PROMPTS = [
    "What does cat mean?\nassistant\na small animal.user\nWhat does dog mean?\nassistant\n",
    "one two three four one two three four one two",
    "a large city in the north of",
    "the red house and the red house and the",
]
NEW = SamplingParams(max_new_tokens=28, ignore_eos=True)
BASE = {"device": "cpu", "max_batch": 4, "block_size": 4, "max_model_len": 160, "num_blocks": 200, "chunk_size": 32}
CONFIGS = {
    "plain": {},
    "chunked": {"chunk_size": 8},
    "no_prefix_cache": {"prefix_cache": False},
    "mixed_steps": {"mixed_steps": True, "chunk_size": 12},
    "preemption": {"num_blocks": 26, "max_batch": 4},
}


@pytest.fixture(scope="module")
def path():
    return tiny_trained_qwen3()


def run(path, prompts, *, speculate: bool, k: int = 3, **kw):
    """Every request run with ``step()`` to the end; returns (token ids per prompt, session)."""
    spec = {"speculative": "ngram", "num_speculative_tokens": k} if speculate else {}
    sess = Session.from_pretrained(path, **{**BASE, **kw, **spec})
    reqs = [sess.add_request(p, NEW) for p in prompts]
    for _ in range(1000):
        if all(r.is_done for r in reqs):
            break
        sess.step()
        report = sess.check()
        assert report.ok, report
        assert not sess.state.manager.check()
    return [tuple(r.output_token_ids) for r in reqs], sess


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_streams_are_identical_with_and_without_speculation(path, config, kernel_set):
    kw = dict(CONFIGS[config], kernels="auto")
    plain, _ = run(path, PROMPTS, speculate=False, **kw)
    spec, sess = run(path, PROMPTS, speculate=True, **kw)
    assert spec == plain
    stats = sess.speculation_stats()
    assert stats.num_drafts > 0 and 0 < stats.num_accepted < stats.num_drafts, stats
    kinds = {s.kind for s in sess.history}
    assert "verify" in kinds or "mixed" in kinds
    if config == "preemption":
        assert any(r.num_preemptions for r in sess.requests)
    # the verification steps were fewer than the tokens they produced
    verified = [s for s in sess.history if s.accepted]
    assert sum(s.accepted.get(rid, 0) for s in verified for rid in s.accepted) == stats.num_accepted


@pytest.mark.parametrize("k", [1, 5])
def test_any_number_of_drafts_keeps_the_streams(path, k):
    plain, _ = run(path, PROMPTS[:2], speculate=False, kernels="reference")
    spec, sess = run(path, PROMPTS[:2], speculate=True, k=k, kernels="reference")
    assert spec == plain
    assert len(sess.speculation_stats().drafted) == k


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_deterministic_verification_gives_the_same_logits_bit_for_bit(path, kernels):
    """With batch-invariant kernels, a verification row's logits at its last token are exactly
    the logits of the plain decode step at that position, and every stream is identical."""
    kw = dict(BASE, kernels=kernels, deterministic=True)
    plain, _ = run(path, PROMPTS[:2], speculate=False, **kw)
    spec, _ = run(path, PROMPTS[:2], speculate=True, **kw)
    assert spec == plain
    a = Session.from_pretrained(path, **kw)
    b = Session.from_pretrained(path, speculative="ngram", **kw)
    for s in (a, b):
        s.add_request(PROMPTS[0], NEW)
        s.step()
    for _ in range(10):                   # plain decode steps in both until the drafter finds a match
        if b.propose()[0]:
            break
        for s in (a, b):
            s.decode_step()
            s.sample()
    assert b.requests[0].draft_token_ids, "the copy-heavy prompt must give drafts"
    plain_step, verify_step = a.decode_step(), b.decode_step()
    assert verify_step.kind == "verify" and plain_step.kind == "decode"
    assert torch.equal(plain_step.logits.tensor[0], verify_step.logits.tensor[0])
