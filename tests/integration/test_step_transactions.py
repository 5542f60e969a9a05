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
from fault_kit import Boom, raise_at, record_points

from qwen_npu import SamplingParams, Session

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


def mixed_steps(sess):
    """mixed_steps=True: a newcomer prefills in the same forwards as a running request decodes."""
    sess.add_request(P3, GREEDY)

    def add_later(s):
        if len(s.requests) == 1:
            s.add_request(P1, SEEDED)               # adding commits at once: raise only after it
            s.add_request(P2, UNSEEDED)
    return [_step, _step, add_later] + _until_done(12)


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
    "mixed_steps": (mixed_steps, {"mixed_steps": True}),
    "mixed_steps_preemption": (mixed_steps, {"mixed_steps": True, "num_blocks": 6, "prefix_cache": False}),
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


def _reference(ckpt, scenario, **override):
    build, kw = SCENARIOS[scenario]
    sess = open_tiny(ckpt, **{**kw, **override})
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
    if scenario in ("preemption", "mixed_steps_preemption"):
        assert any(r.num_preemptions for r in sess.requests)
    if scenario.startswith("mixed_steps"):
        assert any(s.kind == "mixed" for s in sess.history)
        assert tokens(sess) == _reference(tiny_ckpt_small_vocab, scenario, mixed_steps=False)[0]
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
