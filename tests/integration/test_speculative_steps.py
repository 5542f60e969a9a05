"""One speculative step by hand: ``propose()`` stages drafts, ``decode_step()`` verifies them in one
forward (k + 1 positions per row, through the prefill path), ``sample()`` keeps the accepted
prefix and gives the rest back. Between and after, the block tables, the ledger, the prefix
hashes and ``check()`` agree; bad calls are refused before anything changes.
"""
from __future__ import annotations

import pytest

from qwen_npu import InvalidRequestError, SamplingParams, Session
from qwen_npu.cache.block_table import blocks_needed
from qwen_npu.testing import tiny_trained_qwen3

PROMPT = "What does cat mean?\nassistant\na small animal.user\nWhat does dog mean?\nassistant\n"
KW = {"device": "cpu", "kernels": "reference", "max_batch": 4, "block_size": 4, "max_model_len": 160, "num_blocks": 64,
          "chunk_size": 32}
NEW = SamplingParams(max_new_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def path():
    return tiny_trained_qwen3()


def spec_session(path, **kw):
    return Session.from_pretrained(path, **{**KW, "speculative": "ngram", "num_speculative_tokens": 3, **kw})


def until_drafts(sess, req):
    """Plain decode steps until the drafter proposes something for ``req`` (staged by propose())."""
    for _ in range(20):
        if sess.propose()[req.id]:
            return req.draft_token_ids
        sess.decode_step()
        sess.sample()
    raise AssertionError("the drafter never matched")


def published_blocks_match_tokens(sess, req):
    """Every block of ``req``'s table that carries a prefix hash holds exactly its kept tokens."""
    pool, bs = sess.state.manager.pool, sess.config.block_size
    for i, b in enumerate(req.block_table):
        info = pool.block(b)
        if info.is_cached:
            assert info.token_ids == tuple(req.all_token_ids[i * bs:(i + 1) * bs]), (i, b)
            assert (i + 1) * bs <= req.num_computed_tokens, f"block {b} is published past the computed tokens"


def test_one_speculative_step_by_hand_verifies_accepts_and_rolls_back(path):
    sess = spec_session(path)
    req = sess.add_request(PROMPT, NEW)
    sess.step()                                          # prefill and the first token
    seen = {"accepted": 0, "rejected": 0, "freed": 0}
    for _ in range(12):
        drafts = sess.propose()[req.id]
        assert req.draft_token_ids == drafts
        before = (req.num_tokens, req.num_computed_tokens, req.block_table)
        step = sess.decode_step()
        if not drafts:
            assert step.kind == "decode"
            sess.sample()
            continue
        k, t = len(drafts), before[0]
        assert step.kind == "verify" and step.drafts == {req.id: drafts}
        assert step.query_lens.tolist() == [k + 1] and step.input_ids.tolist()[1:] == list(drafts)
        assert step.positions.tolist() == list(range(t - 1, t + k))
        assert len(step.logits_request_ids) == k + 1
        # drafts are not computed tokens: booked as a plain decode row, the table holds their slots
        assert req.num_computed_tokens == t and len(req.block_table) == blocks_needed(t + k, 4)
        assert sess.check().ok and not sess.state.manager.check()
        published_blocks_match_tokens(sess, req)
        sess.sample()
        kept = step.accepted[req.id]
        assert req.num_tokens == t + kept + 1 and req.num_computed_tokens == t + kept
        assert req.draft_token_ids == ()
        assert list(req.output_token_ids[-kept - 1:-1]) == list(drafts[:kept])      # the kept drafts
        if kept < k:
            assert req.output_token_ids[-1] != drafts[kept]                           # the correction
        assert len(req.block_table) == blocks_needed(t + kept, 4)                     # rolled back
        assert req.block_table == before[2] + req.block_table[len(before[2]):]        # append-only prefix
        slots = step.rolled_back[req.id]
        assert slots == step.slot_mapping.tolist()[1 + kept:]
        ledger = sess.state.ledger
        for pos, slot in zip(range(t + kept, t + k), slots):                         # the cache's record
            assert ledger.last(slot).request_id == req.id and ledger.last(slot).position == pos
        assert sess.check().ok and not sess.state.manager.check()
        published_blocks_match_tokens(sess, req)
        seen["accepted"] += kept
        seen["rejected"] += k - kept
        seen["freed"] += blocks_needed(t + k, 4) - blocks_needed(t + kept, 4)
    assert seen["accepted"] and seen["rejected"] and seen["freed"], seen
    assert req.spec_stats.num_accepted == seen["accepted"]
    assert req.spec_stats.num_drafts == seen["accepted"] + seen["rejected"]


def test_by_hand_and_step_give_the_same_tokens_as_plain_decoding(path):
    plain = Session.from_pretrained(path, **KW)
    a = plain.add_request(PROMPT, NEW)
    while not a.is_done:
        plain.step()
    sess = spec_session(path)
    b = sess.add_request(PROMPT, NEW)
    sess.step()
    while not b.is_done:
        sess.propose()
        sess.decode_step()
        sess.sample()
    assert b.output_token_ids == a.output_token_ids
    assert b.spec_stats.num_accepted > 0


def test_rejected_drafts_never_reach_the_prefix_cache(path):
    sess = spec_session(path)
    req = sess.add_request(PROMPT, NEW)
    while not req.is_done:
        sess.step()
        published_blocks_match_tokens(sess, req)
    # a new request with the finished one's tokens as its prompt finds exactly the kept blocks cached
    again = sess.add_request(req.all_token_ids[:-1], SamplingParams(max_new_tokens=1))
    sess.step()
    assert again.num_cached_tokens == (len(req.all_token_ids) - 2) // 4 * 4
    assert sess.check().ok


def test_speculation_calls_are_refused_before_anything_changes(path):
    plain = Session.from_pretrained(path, **KW)
    plain.add_request(PROMPT, NEW)
    plain.step()
    with pytest.raises(InvalidRequestError, match="does not speculate.*speculative='ngram'"):
        plain.propose()
    sess = spec_session(path)
    with pytest.raises(InvalidRequestError, match="nothing to propose"):
        sess.propose()
    req = sess.add_request(PROMPT, NEW)
    sess.step()
    until_drafts(sess, req)
    step = sess.decode_step()
    assert step.kind == "verify"
    before = sess.state_digest(kv=True)
    with pytest.raises(InvalidRequestError, match="unsampled rows"):
        sess.propose()
    with pytest.raises(InvalidRequestError, match=f"cannot force step {step.index}: it verifies drafts"):
        sess.sample(force={req.id: 5})
    assert sess.state_digest(kv=True) == before
    sess.sample()
    assert sess.check().ok


def test_a_request_that_records_logprobs_or_waits_for_min_new_tokens_decodes_plainly(path):
    sess = spec_session(path)
    lp = sess.add_request(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2))
    early = sess.add_request(PROMPT, SamplingParams(max_new_tokens=24, min_new_tokens=5, ignore_eos=True))
    last = sess.add_request(PROMPT, SamplingParams(max_new_tokens=2, ignore_eos=True))
    while any(r.status != "decoding" for r in sess.requests):
        sess.prefill()
        if sess.last_step.logits is not None:
            sess.sample()
    assert [len(r.output_token_ids) for r in sess.requests] == [1, 1, 1]
    drafts = sess.propose()
    assert drafts[lp.id] == () and drafts[early.id] == ()
    assert drafts[last.id] == ()                          # one token left: no room for a draft
    while not all(r.is_done for r in sess.requests):
        sess.step()
    assert len(lp.logprobs) == 6 and lp.spec_stats.num_drafts == 0
    assert early.spec_stats.num_drafts > 0                # once past min_new_tokens it speculates
