"""Every step is a transaction: a fault anywhere before its commit changes nothing.

The sweep runs small programs (chunked prefill, decode, prefix-cache hits, preemption, forks,
a hand-driven prefill/sample/decode split, captures), first uninterrupted — recording which
injection points each call reaches — and then again, raising ``KeyboardInterrupt`` and an
ordinary exception at every reached point of every call before running the call for real.
After each injected fault the state digest equals the one before the call and ``check()``
passes; at the end every request has exactly the tokens of the uninterrupted run.
"""
from __future__ import annotations

import pytest
import torch
from fault_kit import Boom, raise_at, record_points

from qwen_npu import InvalidRequestError, SamplingParams, Session

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0.9, top_k=20, seed=7)
UNSEEDED = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.0)
P1 = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]
P2 = [3, 14, 15, 92, 65, 35, 89, 79, 2, 7]          # shares two blocks of 4 with P1
P3 = [27, 18, 28, 18, 28]


def open_tiny(ckpt, **kw):
    args = dict(device="cpu", max_batch=3, block_size=4, max_model_len=32, num_blocks=24, chunk_size=6)
    args.update(kw)
    return Session.from_pretrained(ckpt, **args)


def _step(sess):
    if any(not r.is_done for r in sess.requests):
        return sess.step()
    return None


def _until_done(n):
    return [_step] * n


def mixed(sess):
    """Chunked prefill of three prompts (greedy, seeded, unseeded), then decode."""
    sess.add_request(P1, GREEDY)
    sess.add_request(P3, SEEDED)
    sess.add_request(P2, UNSEEDED)
    return _until_done(7)


def prefix_hits(sess):
    """A second prompt arrives after the first published its blocks: it hits the prefix cache."""
    sess.add_request(P1, GREEDY)

    def add_second(s):
        if not any(r.prompt_token_ids == P2 for r in s.requests):
            s.add_request(P2, SEEDED)               # adding commits at once: raise only after it
    return [_step, _step, add_second] + _until_done(4)


def preemption(sess):
    """Too few blocks for both: the newer request is preempted and recomputed."""
    sess.add_request(P1, SamplingParams(max_new_tokens=6, ignore_eos=True))
    sess.add_request(P2, SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, seed=3))
    return _until_done(12)


def by_hand(sess):
    """prefill / sample / decode_step / sample, each a transaction of its own."""
    sess.add_request(P3, GREEDY)
    sess.add_request(P1, SEEDED)
    def sample(s):
        if s.last_step.logits is not None and not s.last_step.sampled:
            return s.sample()
        return None
    return [lambda s: s.prefill(), sample] * 3 + [lambda s: s.decode_step(), sample] * 2


def with_capture(sess):
    cap = sess.capture(["layers.0.attn.k", "logits"])
    cap.__enter__()
    sess._test_capture = cap
    sess.add_request(P1, GREEDY)
    return _until_done(3)


SCENARIOS = {
    "mixed": (mixed, {}),
    "prefix_hits": (prefix_hits, {}),
    "preemption": (preemption, dict(num_blocks=5, max_batch=2)),
    "by_hand": (by_hand, {}),
    "capture": (with_capture, {}),
}


def tokens(sess):
    return {r.id: (r.status, list(r.output_token_ids)) for r in sess.requests}


def sweep(sess, program, recorded, excs=(KeyboardInterrupt, Boom)):
    """Inject faults into every call, then run the call; returns the injections made.

    Phase boundaries: both exceptions, in every call. Forward hook points: each point (by name)
    once per program, the exceptions taking turns, in the first call that reaches it."""
    made, covered = 0, set()
    for k, (action, reached) in enumerate(zip(program, recorded)):
        before = sess.state_digest()
        for i, point in enumerate(reached):
            if point.startswith("fwd:"):
                if point in covered:
                    continue
                covered.add(point)
                chosen = (excs[len(covered) % 2],)
            else:
                chosen = excs
            for exc in chosen:
                assert raise_at(sess, action, point, exc), f"call {k}: {point} was not reached"
                after = sess.state_digest()
                assert after == before, f"call {k}, {exc.__name__} at {point} changed {before.diff(after)}"
                problems = sess.check()
                assert problems.ok, f"call {k}, {exc.__name__} at {point}: {problems}"
                made += 1
        action(sess)
    return made, covered


def _reference(ckpt, scenario):
    build, kw = SCENARIOS[scenario]
    sess = open_tiny(ckpt, **kw)
    program = build(sess)
    recorded = []
    for action in program:
        _, reached = record_points(sess, action)
        recorded.append(reached)
    return tokens(sess), recorded, sess.state_digest()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_fault_at_any_point_changes_nothing_and_the_run_continues_identically(tiny_ckpt_small_vocab, scenario):
    want, recorded, want_digest = _reference(tiny_ckpt_small_vocab, scenario)
    build, kw = SCENARIOS[scenario]
    sess = open_tiny(tiny_ckpt_small_vocab, **kw)
    program = build(sess)
    made, covered = sweep(sess, program, recorded)
    phases = sum(not p.startswith("fwd:") for r in recorded for p in r)
    forward = {p for r in recorded for p in r if p.startswith("fwd:")}
    assert covered == forward and made == 2 * phases + len(forward)
    print(f"{scenario}: {len(program)} calls, {made} injected faults")
    assert tokens(sess) == want
    assert sess.state_digest() == want_digest
    assert sess.check().ok
    points = {p.split("#")[0] for r in recorded for p in r}
    assert {"planned", "validated", "dispatched", "booked", "commit"} <= points
    assert any(p.startswith("fwd:layers.1.attn.z") for p in points)   # after the last layer's write_kv
    if scenario == "preemption":
        assert any(r.num_preemptions for r in sess.requests)
    if scenario == "prefix_hits":
        assert sess.prefix_cache_stats.hit_blocks >= 2


def test_faults_in_a_fork_change_neither_branch(tiny_ckpt_small_vocab):
    def build(sess):
        sess.add_request(P1, SEEDED)
        sess.add_request(P3, GREEDY)
        sess.step()
        sess.step()
        return sess

    ref = build(open_tiny(tiny_ckpt_small_vocab))
    ref_child = ref.fork()
    for _ in range(4):
        ref_child.step()
        ref.step()
    want = (tokens(ref), tokens(ref_child))

    sess = build(open_tiny(tiny_ckpt_small_vocab))
    before = sess.state_digest()
    for point in ("planned#1", "commit#1"):
        for exc in (KeyboardInterrupt, Boom):
            assert raise_at(sess, lambda s: s.fork(), point, exc)
            assert sess.state_digest() == before
            assert sess.check().ok
    child = sess.fork()
    for _ in range(4):
        for branch in (child, sess):
            for point in ("planned#1", "dispatched#1", "fwd:layers.0.attn.z#1", "sampled#1", "commit#1"):
                for exc in (KeyboardInterrupt, Boom):
                    b0, c0 = sess.state_digest(), child.state_digest()
                    assert raise_at(branch, _step, point, exc)
                    assert (sess.state_digest(), child.state_digest()) == (b0, c0)
                    assert branch.check().ok
            branch.step()
    assert (tokens(sess), tokens(child)) == want


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


def test_ctrl_c_during_a_commit_lands_after_it(tiny_ckpt_small_vocab):
    """SIGINT arriving while a commit applies is held back and raised once the state is whole."""
    import os
    import signal

    from qwen_npu.engine.draft import StepDraft

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
