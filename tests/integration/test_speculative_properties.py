"""Random programs mixing speculative and plain requests give every request the greedy tokens of
a session without speculation: arrivals at any step, prompts from a small alphabet (repeats for
the drafter, shared prefixes for the prefix cache), requests that cannot speculate (log-probs,
``min_new_tokens``), small caches that preempt, separate and mixed steps, any number of drafts.
``check()`` passes after every step, and a finished request holds no block.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen_npu import SamplingParams, Session

RUNS = {"programs": 0, "drafts": 0, "accepted": 0, "preemptions": 0, "prefix_hits": 0}
BASE = {"device": "cpu", "kernels": "reference", "max_batch": 3, "block_size": 4, "max_model_len": 40}

request = st.tuples(
    st.integers(0, 4),                                              # arrives before this step
    st.lists(st.sampled_from([5, 6, 7]), min_size=1, max_size=6),   # a prompt tail (alphabet of 3)
    st.integers(1, 12),                                             # max_new_tokens
    st.sampled_from(["speculate", "speculate", "logprobs", "min_new_tokens"]))
program = st.tuples(
    st.lists(request, min_size=1, max_size=5),
    st.sampled_from([9, 14, 60]),                                   # num_blocks: 9 and 14 preempt
    st.sampled_from([4, 8, 16]),                                    # chunk_size
    st.booleans(),                                                  # mixed_steps
    st.booleans(),                                                  # prefix_cache
    st.integers(1, 4))                                              # num_speculative_tokens


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt_small_vocab):
    yield tiny_ckpt_small_vocab
    print(f"\nspeculative properties: {RUNS}")


def sampling(max_new: int, kind: str) -> SamplingParams:
    if kind == "logprobs":
        return SamplingParams(max_new_tokens=max_new, ignore_eos=True, logprobs=1)
    if kind == "min_new_tokens":
        return SamplingParams(max_new_tokens=max_new, ignore_eos=True, min_new_tokens=max_new // 2)
    return SamplingParams(max_new_tokens=max_new, ignore_eos=True)


def run(ckpt, reqs, kw) -> tuple[list, Session]:
    sess = Session.from_pretrained(ckpt, **kw)
    shared = [11, 12, 13, 14, 15, 16, 17, 18]                       # two full blocks every prompt starts with
    added = []
    for step in range(500):
        for arrive, tail, max_new, kind in reqs:
            if arrive == step:
                added.append(sess.add_request(shared + tail, sampling(max_new, kind)))
        if len(added) == len(reqs) and all(r.is_done for r in added):
            break
        if any(not r.is_done for r in added):
            sess.step()
            report = sess.check()
            assert report.ok, report
            assert not sess.state.manager.check()
            assert all(not r.block_table for r in added if r.is_done)
    assert all(r.is_done for r in added)
    return [(r.prompt_token_ids, tuple(r.output_token_ids)) for r in added], sess


@settings(max_examples=40, deadline=None, derandomize=True,     # the same programs on every run
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(program)
def test_speculation_never_changes_a_greedy_stream(ckpt, prog):
    reqs, num_blocks, chunk_size, mixed, prefix_cache, k = prog
    kw = dict(BASE, num_blocks=num_blocks, chunk_size=chunk_size, mixed_steps=mixed, prefix_cache=prefix_cache)
    plain, _ = run(ckpt, reqs, kw)
    spec, sess = run(ckpt, reqs, dict(kw, speculative="ngram", num_speculative_tokens=k))
    assert sorted(spec) == sorted(plain)
    for r in sess.requests:
        if r.sampling.logprobs is not None:
            assert r.spec_stats.num_drafts == 0 and len(r.logprobs) == len(r.output_token_ids)
    stats = sess.speculation_stats()
    RUNS["programs"] += 1
    RUNS["drafts"] += stats.num_drafts
    RUNS["accepted"] += stats.num_accepted
    RUNS["preemptions"] += sum(r.num_preemptions for r in sess.requests)
    RUNS["prefix_hits"] += sess.prefix_cache_stats.hit_blocks


def test_the_programs_speculate_preempt_and_hit_the_prefix_cache():
    """Runs after the property test in this module: its programs must have exercised every part."""
    assert RUNS["programs"] > 0
    assert 0 < RUNS["accepted"] < RUNS["drafts"]
    assert RUNS["preemptions"] > 0 and RUNS["prefix_hits"] > 0
