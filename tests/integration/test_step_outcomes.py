"""What a refused, interrupted or warned step leaves behind: nothing, or a whole commit.

Each test here pins one behaviour of the step transactions (the sweep over every fault point is
``test_step_transactions.py``): a refused decode step preempts nothing, a request named twice
runs once, scoring shifts no seeds and leaves no half-scored request, warnings turned into errors
come after a whole commit, the last logits survive a failed step, Ctrl-C waits for the commit.
"""
from __future__ import annotations

import pytest
import torch
from fault_kit import raise_at
from test_step_transactions import GREEDY, P1, P3, SEEDED, UNSEEDED, open_tiny

from qwen_npu import InvalidRequestError, SamplingParams


def test_a_refused_decode_step_does_not_preempt(tiny_ckpt_small_vocab):
    """Planning a decode step that can only preempt its own row refuses it: nothing to decode.
    The preemption it planned must not happen (it used to free the request's blocks anyway)."""
    sess = open_tiny(tiny_ckpt_small_vocab, num_blocks=4, chunk_size=12, max_model_len=16)
    a = sess.add_request(list(range(1, 16)), SamplingParams(max_new_tokens=1, ignore_eos=True))
    b = sess.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=4, ignore_eos=True))
    sess.sample(sess.prefill([b]))               # b decodes next at position 4: it needs a second block
    sess.prefill([a])                            # a (older) takes the other three blocks
    assert b.status == "decoding" and sess.state.manager.num_free_blocks == 0
    before, table = sess.state_digest(), b.block_table
    with pytest.raises(InvalidRequestError, match="nothing to decode"):
        sess.decode_step()
    assert sess.state_digest() == before
    assert b.status == "decoding" and b.block_table == table and b.num_preemptions == 0
    assert sess.check().ok


def test_prefill_names_a_request_once(tiny_ckpt_small_vocab):
    for check in ("raise", "off"):
        sess = open_tiny(tiny_ckpt_small_vocab, slot_check=check)
        r = sess.add_request(P1, GREEDY)
        step = sess.prefill([r, r, r.id])
        assert step.request_ids == [r.id] and step.num_active == 1
        assert r.num_computed_tokens == 6                 # one chunk, computed once


def test_score_does_not_shift_later_seeds(tiny_ckpt_small_vocab):
    def run(score_first):
        sess = open_tiny(tiny_ckpt_small_vocab)
        if score_first:
            sess.score(P1, [5, 6, 7])
        r = sess.add_request(P3, UNSEEDED)
        while not r.is_done:
            sess.step()
        return r.output_token_ids
    assert run(True) == run(False)


def test_an_interrupted_score_leaves_no_request_behind(tiny_ckpt_small_vocab):
    sess = open_tiny(tiny_ckpt_small_vocab)
    assert raise_at(sess, lambda s: s.score(P1, [5, 6, 7]), "dispatched#2", KeyboardInterrupt)
    assert all(r.is_done for r in sess.requests)
    assert sess.check().ok and sess.state.manager.num_used_blocks == 0


def test_warnings_as_errors_raise_after_a_whole_commit(tiny_ckpt_small_vocab):
    """A StreamHealthWarning or FaultEmulationWarning turned into an error is raised once the
    step is fully committed: the tokens are applied, check() passes and the session goes on."""
    import warnings

    from qwen_npu import StreamHealthWarning
    from qwen_npu.engine.faults import FaultEmulationWarning

    sess = open_tiny(tiny_ckpt_small_vocab)
    r = sess.add_request(P3, GREEDY)
    sess.step()                                          # prefill: r decodes next
    bs = sess.config.block_size
    sess.state.kv_cache.keys[0][r.block_table[0], 1 % bs] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(StreamHealthWarning):
            sess.step()
    assert len(r.output_token_ids) == 2 and r.status == "decoding"
    report = sess.check()
    assert sess.last_step.sampled and {p.section for p in report.items} == {"values"}   # only the poison
    sess.step()                                          # goes on
    assert len(r.output_token_ids) == 3

    rep = open_tiny(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="off")
    reqs = [rep.add_request(P3, GREEDY), rep.add_request(P1, GREEDY)]
    while any(x.status != "decoding" for x in reqs):
        rep.step()
    rep.abort(reqs[1])                                   # one live row: padding rows collide with it
    with rep.emulate_faults("zero_on_collision"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(FaultEmulationWarning):
                rep.step()
    assert rep.last_step.sampled and len(reqs[0].output_token_ids) == 2
    assert rep.state.faults is None and len(rep.history) >= 2
    rep.step()
    assert len(reqs[0].output_token_ids) == 3


def test_the_last_steps_logits_stay_valid_after_a_failed_step(tiny_ckpt_small_vocab):
    sess = open_tiny(tiny_ckpt_small_vocab)
    sess.add_request(P1, GREEDY)
    sess.add_request(P3, GREEDY)
    while any(r.status != "decoding" for r in sess.requests):
        sess.step()
    last = sess.decode_step()
    values = last.logits.tensor.clone()
    sess.sample(last)
    for point in ("fwd:logits#1", "dispatched#1", "sampled#1", "commit#1"):
        assert raise_at(sess, lambda s: s.step(), point, KeyboardInterrupt)
        assert not last.logits.is_stale
        assert torch.equal(last.logits.tensor, values)     # the failed step wrote the other buffer
    nxt = sess.step()
    assert last.logits.is_stale and nxt.index == last.index + 1


def test_the_state_view_reads_but_does_not_write(tiny_ckpt_small_vocab):
    sess = open_tiny(tiny_ckpt_small_vocab)
    r = sess.add_request(P3, SEEDED)
    sess.step()
    st = sess.state
    assert st.requests[r.id] is r and st.step_index == 1 and r.id in st.generators
    assert st.manager.block_table(r.id) == r.block_table
    with pytest.raises(TypeError):
        st.requests[99] = r
    with pytest.raises(TypeError):
        st.generators[r.id] = None
    with pytest.raises(AttributeError):
        st.step_index = 5


def test_a_step_whose_rows_were_all_aborted_needs_no_sample(tiny_ckpt_small_vocab):
    sess = open_tiny(tiny_ckpt_small_vocab)
    a = sess.add_request(P3, GREEDY)
    b = sess.add_request(P1, GREEDY)
    step = sess.prefill([a])
    assert step.logits_request_ids == [a.id]
    sess.abort(a)
    nxt = sess.step()                                    # refused before: "call sess.sample() first"
    assert b.id in nxt.request_ids and sess.check().ok


def test_ctrl_c_during_a_commit_lands_after_it(tiny_ckpt_small_vocab, default_sigint):
    """SIGINT arriving while a commit applies is held back and raised once the state is whole."""
    import os
    import signal

    from qwen_npu.engine.transaction import StepDraft

    sess = open_tiny(tiny_ckpt_small_vocab)
    r = sess.add_request(P3, GREEDY)
    real = StepDraft.apply

    def apply(self, generators):
        os.kill(os.getpid(), signal.SIGINT)            # Ctrl-C in the middle of the assignments
        real(self, generators)

    StepDraft.apply = apply
    try:
        with pytest.raises(KeyboardInterrupt):
            sess.step()
    finally:
        StepDraft.apply = real
    assert len(r.output_token_ids) == 1 and len(sess.history) == 1 and sess.check().ok
    sess.step()
    assert len(r.output_token_ids) == 2


def test_ctrl_c_ignored_by_the_process_stays_ignored_through_a_commit(tiny_ckpt_small_vocab):
    """A process that ignores SIGINT (started in the background) keeps ignoring it: the commit's
    deferral neither raises nor leaves its own handler installed."""
    import os
    import signal

    from qwen_npu.engine.transaction import StepDraft

    sess = open_tiny(tiny_ckpt_small_vocab)
    r = sess.add_request(P3, GREEDY)
    real = StepDraft.apply

    def apply(self, generators):
        os.kill(os.getpid(), signal.SIGINT)
        real(self, generators)

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    StepDraft.apply = apply
    try:
        sess.step()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        StepDraft.apply = real
        signal.signal(signal.SIGINT, previous)
    assert len(r.output_token_ids) == 1 and sess.check().ok
