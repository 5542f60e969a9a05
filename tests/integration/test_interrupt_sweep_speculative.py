"""A Ctrl-C at any executed line of a speculative call — ``propose()``, a verification step, its
``sample()``, a speculative ``step()`` and ``generate()``, with preemption — leaves the whole call or
none (``sweep_kit``: digest with K/V bytes before or after, ``check()`` passes, the call gate is
free, and finishing the program gives the uninterrupted run's tokens)::

    QWEN_NPU_SWEEP_STRIDE=1 python -m pytest tests/integration/test_interrupt_sweep_speculative.py
"""
from __future__ import annotations

import pytest
from sweep_kit import Call, World, add, ctrl_c_raises, generate_call, stride, summary, sweep  # noqa: F401 (an autouse fixture)

from qwen_npu import SamplingParams

STRIDE = 61
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9, top_k=20, seed=7)
P1 = [27, 18, 28, 18, 28]
P2 = [3, 14, 15, 3, 14, 15, 3]
KW = {"device": "cpu", "kernels": "reference", "max_batch": 3, "block_size": 4, "max_model_len": 32, "num_blocks": 24,
          "chunk_size": 8, "speculative": "ngram", "num_speculative_tokens": 3}


def when_running(label, fn):
    def call(w):
        if any(not r.is_done for r in w.sess.requests):
            return fn(w.sess)
        return None
    return Call(label, call)


def by_hand_calls():
    def sample(s):
        if not s.last_step.sampled:
            s.sample()
    cycle = [when_running("propose()", lambda s: s.propose()),
             when_running("decode_step()", lambda s: s.decode_step()), when_running("sample()", sample)]
    return [add(P1, GREEDY), add(P2, SEEDED)] + [when_running("step()", lambda s: s.step())] * 2 + cycle * 3


def generate_calls():
    return [generate_call([P1, P2], [GREEDY, SEEDED], 10)]


PROGRAMS = {
    "step": (KW, lambda: [add(P1, GREEDY), add(P2, SEEDED)] + [when_running("step()", lambda s: s.step())] * 7),
    "by_hand": (KW, by_hand_calls),
    "generate": (KW, generate_calls),
    "preempt": (dict(KW, num_blocks=7, chunk_size=16),
                lambda: [add(P1, SamplingParams(max_new_tokens=12, ignore_eos=True)),
                         add(P2, SamplingParams(max_new_tokens=12, ignore_eos=True))]
                + [when_running("step()", lambda s: s.step())] * 16),
}


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_ctrl_c_at_any_line_of_a_speculative_call_leaves_it_whole_or_undone(tiny_ckpt_small_vocab, program):
    kw, build = PROGRAMS[program]
    calls = build()
    trials, problems = sweep(tiny_ckpt_small_vocab, kw, calls, stride(STRIDE))
    print(f"{program}: {len(calls)} calls, {trials} trials")
    assert trials >= len(calls)
    assert not problems, summary(program, problems)


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_the_programs_verify_accept_and_reject_drafts(tiny_ckpt_small_vocab, program):
    kw, build = PROGRAMS[program]
    w = World(tiny_ckpt_small_vocab, kw)
    for c in build():
        c.fn(w)
    stats = w.sess.speculation_stats()
    assert 0 < stats.num_accepted < stats.num_drafts, stats
    if program == "preempt":
        assert any(r.num_preemptions for r in w.sess.requests)
