"""Speculative steps are transactions: a fault at any point of a proposal, a verification step or
its sample (KeyboardInterrupt or an ordinary exception, at every phase boundary and every hook
point of the forward) changes nothing, K/V bytes included, and the run then continues to exactly
the tokens of the uninterrupted run, which are the tokens of plain greedy decoding.
"""
from __future__ import annotations

import pytest
from fault_kit import Boom, raise_at, record_points

from qwen_npu import SamplingParams, Session

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9, top_k=20, seed=7)
P1 = [27, 18, 28, 18, 28]                      # repeats: the drafter finds matches, some rejected
P2 = [3, 14, 15, 3, 14, 15, 3]
KW = {"device": "cpu", "kernels": "reference", "max_batch": 3, "block_size": 4, "max_model_len": 32, "num_blocks": 24,
          "chunk_size": 8, "speculative": "ngram", "num_speculative_tokens": 3}


def tokens(sess):
    return {r.id: (r.status, list(r.output_token_ids)) for r in sess.requests}


def _if_running(fn):
    def call(s):
        if any(not r.is_done for r in s.requests):
            return fn(s)
        return None
    return call


def by_hand(sess):
    sess.add_request(P1, GREEDY)
    sess.add_request(P2, SEEDED)
    cycle = [_if_running(lambda s: s.propose()), _if_running(lambda s: s.decode_step()),
             _if_running(lambda s: s.sample() if not s.last_step.sampled else None)]
    return [lambda s: s.step(), lambda s: s.step()] + cycle * 4


def stepping(sess):
    sess.add_request(P1, GREEDY)
    sess.add_request(P2, SEEDED)
    return [_if_running(lambda s: s.step())] * 9


def preempting(sess):
    sess.add_request(P1, SamplingParams(max_new_tokens=12, ignore_eos=True))
    sess.add_request(P2, SamplingParams(max_new_tokens=12, ignore_eos=True))
    return [_if_running(lambda s: s.step())] * 20


SCENARIOS = {"by_hand": (by_hand, {}), "stepping": (stepping, {}), "mixed": (stepping, {"mixed_steps": True}),
             "preempting": (preempting, {"num_blocks": 7, "chunk_size": 16})}


def reference(ckpt, scenario, **override):
    build, kw = SCENARIOS[scenario]
    sess = Session.from_pretrained(ckpt, **{**KW, **kw, **override})
    program = build(sess)
    recorded = [record_points(sess, action)[1] for action in program]
    return sess, recorded


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_fault_anywhere_in_a_speculative_call_changes_nothing(tiny_ckpt_small_vocab, scenario):
    ref, recorded = reference(tiny_ckpt_small_vocab, scenario)
    assert ref.speculation_stats().num_drafts > 0
    assert 0 < ref.speculation_stats().num_accepted < ref.speculation_stats().num_drafts
    build, kw = SCENARIOS[scenario]
    sess = Session.from_pretrained(tiny_ckpt_small_vocab, **{**KW, **kw})
    program = build(sess)
    faults = 0
    for k, (action, reached) in enumerate(zip(program, recorded)):
        before = sess.state_digest(kv=True)
        for point in reached:
            for exc in (KeyboardInterrupt, Boom):
                assert raise_at(sess, action, point, exc), f"call {k}: {point} was not reached"
                after = sess.state_digest(kv=True)
                assert after == before, f"call {k}, {exc.__name__} at {point} changed {before.diff(after)}"
                report = sess.check()
                assert report.ok, f"call {k}, {exc.__name__} at {point}: {report}"
                faults += 1
        action(sess)
    assert faults > 0
    assert tokens(sess) == tokens(ref)
    assert sess.state_digest(kv=True) == ref.state_digest(kv=True)
    points = {p.split("#")[0] for r in recorded for p in r}
    assert {"planned", "dispatched", "booked", "sampled", "d2h", "staged", "commit"} <= points
    if scenario == "preempting":
        assert any(r.num_preemptions for r in sess.requests)
    plain = Session.from_pretrained(tiny_ckpt_small_vocab, **{**KW, **kw, "speculative": None,
                                                             "num_speculative_tokens": None})
    build(plain)
    while any(not r.is_done for r in plain.requests):
        plain.step()
    greedy = [r.id for r in plain.requests if r.sampling.greedy]
    assert {i: tokens(plain)[i] for i in greedy} == {i: tokens(sess)[i] for i in greedy}
