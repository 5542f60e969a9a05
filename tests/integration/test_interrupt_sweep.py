"""A Ctrl-C landing at any executed line of a Session call leaves a whole transaction or none.

Each program (stepping, ``generate``, stepping by hand, forking, closing a session and a fork,
``reset``, ``abort``, preemption) runs once uninterrupted, then once per trial: on a fresh
identical session, a simulated Ctrl-C lands at the k-th executed line of the package inside one
call (k = 0, stride, 2*stride, ... until the call runs out of lines), exactly as SIGINT would be
handled there (``sweep_kit.CtrlC``). After each trial: the state digest is the one before the
call or the one after it (for ``generate``, after one of its steps), ``check()`` passes,
another thread can make a call (the call gate is free), SIGINT is handled as before, and
completing the program (re-running the call where it did not take effect) finishes with the
tokens and the digest of the uninterrupted run. A failure lists every distinct problem found:
the program, the call, k, and the file:line where the Ctrl-C landed.

The default run takes every ``STRIDE``-th line; the full sweep, every line::

    QWEN_NPU_SWEEP_STRIDE=1 python -m pytest tests/integration/test_interrupt_sweep.py
"""
from __future__ import annotations

import pytest
from sweep_kit import Call, add, ctrl_c_raises, generate_call, stride, summary, sweep  # noqa: F401 (an autouse fixture)

from qwen_npu import SamplingParams

STRIDE = 61                       # the default run: every 61st executed line of each call
GREEDY = SamplingParams(max_new_tokens=3, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0.9, top_k=20, seed=7)
UNSEEDED = SamplingParams(max_new_tokens=2, ignore_eos=True, temperature=1.0)
LONG = SamplingParams(max_new_tokens=4, ignore_eos=True)
LONG_SEEDED = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0.8, seed=3)
P1 = [3, 14, 15, 92, 65, 35, 89, 79, 32]
P2 = [27, 18, 28, 18, 28]
P3 = [7, 1, 8, 2, 8, 1, 8]
KW = dict(device="cpu", kernels="reference", max_batch=3, block_size=4, max_model_len=32, num_blocks=24,
          chunk_size=8)


def on(who, what, label=None):
    """``who.what()`` (who: "sess" or "child"), skipped once every request of ``who`` is done."""
    def fn(w):
        s = getattr(w, who)
        if what in ("step", "decode_step") and all(r.is_done for r in s.requests):
            return None
        return getattr(s, what)()
    return Call(label or f"{who}.{what}()", fn)


def steps(n, who="sess"):
    return [on(who, "step") for _ in range(n)]


def fork(w):
    w.child = w.sess.fork()


def generate_calls():
    return [add(P3, SEEDED), on("sess", "step"), generate_call([P1, P2], [GREEDY, UNSEEDED], 8)]


def by_hand_calls():
    def sample(w):
        last = w.sess.last_step
        if last is not None and last.logits is not None and not last.sampled:
            w.sess.sample()
    hand = [on("sess", "prefill"), Call("sample()", sample)] * 2
    decode = [on("sess", "decode_step"), Call("sample()", sample)] * 2
    return [add(P2, GREEDY), add(P1, SEEDED)] + hand + decode


def abort_calls():
    return [add(P1, GREEDY), add(P2, SEEDED), on("sess", "step"),
            Call("abort()", lambda w: w.sess.abort(w.sess.requests[1]))] + steps(4)


def reset_calls():
    return [add(P2, SEEDED), on("sess", "step"), on("sess", "reset"), add(P3, UNSEEDED)] + steps(3)


PROGRAMS = {
    "step": (KW, lambda: [add(P1, GREEDY), add(P2, UNSEEDED), add(P3, SEEDED)] + steps(5)),
    "generate": (KW, generate_calls),
    "by_hand": (KW, by_hand_calls),
    "fork": (KW, lambda: [add(P1, SEEDED), add(P2, GREEDY), on("sess", "step"), Call("fork()", fork)]
             + steps(2, "child") + steps(2)),
    "close_fork": (KW, lambda: [add(P1, SEEDED), add(P2, GREEDY), on("sess", "step"), Call("fork()", fork),
                               on("child", "step"), on("child", "close")] + steps(3)),
    "close": (KW, lambda: [add(P2, GREEDY), on("sess", "step"), Call("fork()", fork), on("child", "step"),
                          on("sess", "close")]),
    "reset": (KW, reset_calls),
    "abort": (KW, abort_calls),
    "preempt": (dict(KW, num_blocks=5, max_batch=2, chunk_size=16),
                lambda: [add(P1, LONG), add(P3, LONG_SEEDED)] + steps(9)),
    # batch-invariant kernels, their per-step index memo and mixed steps
    "deterministic": (dict(KW, kernels="auto", deterministic=True, mixed_steps=True, chunk_size=6),
                      lambda: [add(P1, GREEDY), on("sess", "step"), add(P2, SEEDED)] + steps(4)),
}


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_ctrl_c_at_any_line_leaves_a_whole_call_or_none(tiny_ckpt_small_vocab, program):
    kw, build = PROGRAMS[program]
    calls = build()
    trials, problems = sweep(tiny_ckpt_small_vocab, kw, calls, stride(STRIDE))
    print(f"{program}: {len(calls)} calls, {trials} trials")
    assert trials >= len(calls)
    assert not problems, summary(program, problems)


def test_the_preempt_program_preempts(tiny_ckpt_small_vocab):
    from sweep_kit import World
    kw, build = PROGRAMS["preempt"]
    w = World(tiny_ckpt_small_vocab, kw)
    for c in build():
        c.fn(w)
    assert all(r.is_done for r in w.sess.requests) and any(r.num_preemptions for r in w.sess.requests)
