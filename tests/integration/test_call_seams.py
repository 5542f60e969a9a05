"""The seams between a call's parts hold under Ctrl-C at every line and under misuse.

Ctrl-C is simulated as the OS delivers it: at the k-th executed line of the package inside one
call, the SIGINT handler in force is called (the default one raises KeyboardInterrupt; the one a
call installs holds it back), so the library's own handling is what is tested.
"""
from __future__ import annotations

import gc
import sys
import threading

import pytest
from sweep_kit import CtrlC

from qwen_npu import InvalidRequestError, SamplingParams, Session
from qwen_npu.errors import SessionBusyError

GREEDY = SamplingParams(max_new_tokens=3, ignore_eos=True)
UNSEEDED = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.0)


@pytest.fixture(autouse=True)
def sigint_raises(default_sigint):
    """Every test here needs Ctrl-C to raise (the process may have inherited it ignored)."""


def ctrl_c_at(k: int, call):
    """Run ``call()`` delivering one Ctrl-C at its k-th executed package line (``sweep_kit.CtrlC``).
    Returns (whether the line was reached, whether KeyboardInterrupt came out, where it landed)."""
    trace = CtrlC(k - 1)
    sys.settrace(trace)
    try:
        call()
        raised = False
    except KeyboardInterrupt:
        raised = True
    finally:
        sys.settrace(None)
    return trace.fired is not None, raised, trace.fired


def sweep(make, call, check, stride=1, limit=4000):
    """For k = 1, 1 + stride, ...: a fresh ``make()``, Ctrl-C at line k of ``call(obj)``, then
    ``check(obj, raised, where)``; until k passes the call's last line."""
    k = 1
    while k < limit:
        obj = make()
        reached, raised, where = ctrl_c_at(k, lambda: call(obj))
        if not reached:
            return k
        check(obj, raised, where)
        k += stride
    raise AssertionError("the call ran more lines than the sweep allows")


def open_tiny(ckpt, **kw):
    args = dict(device="cpu", kernels="reference", max_batch=3, block_size=4, max_model_len=32, num_blocks=24,
                chunk_size=8)
    args.update(kw)
    return Session.from_pretrained(ckpt, **args)


def gate_is_free(sess) -> bool:
    out = []
    t = threading.Thread(target=lambda: out.append(_try(sess.check)))
    t.start()
    t.join(timeout=60)
    return out == ["ok"]


def _try(fn):
    try:
        fn()
        return "ok"
    except SessionBusyError:
        return "busy"


def test_the_call_gate_is_free_after_a_ctrl_c_at_any_line_of_a_call(tiny_ckpt_small_vocab):
    def make():
        sess = open_tiny(tiny_ckpt_small_vocab)
        sess.add_request([5, 6, 7], GREEDY)
        return sess

    def check(sess, raised, where):
        assert gate_is_free(sess), f"Ctrl-C at {where} left the call gate held"
        assert sess.check().ok, where
    sweep(make, lambda s: s.step(), check, stride=7)


def test_a_ctrl_c_in_add_request_never_shifts_later_seeds(tiny_ckpt_small_vocab):
    """Unseeded requests draw their seeds from one stream: an interrupted add draws nothing."""
    def run(sess):
        r = sess.add_request([9, 10, 11], UNSEEDED)
        while not r.is_done:
            sess.step()
        return r.output_token_ids

    want = run(open_tiny(tiny_ckpt_small_vocab))

    def check(sess, raised, where):
        if raised and not sess.requests:                 # refused as a whole: the stream is untouched
            assert run(sess) == want, f"Ctrl-C at {where} shifted the seed stream"
        else:
            assert len(sess.requests) == 1, where
    sweep(lambda: open_tiny(tiny_ckpt_small_vocab), lambda s: s.add_request([1, 2], UNSEEDED), check)


def test_close_is_all_or_nothing_under_ctrl_c(tiny_ckpt_small_vocab):
    def make():
        sess = open_tiny(tiny_ckpt_small_vocab)
        sess.add_request([5, 6, 7], GREEDY)
        sess.step()
        child = sess.fork()
        return sess, child

    def check(pair, raised, where):
        sess, child = pair
        for s in (sess, child):
            if s.closed:
                with pytest.raises(InvalidRequestError, match="session is closed"):
                    s.step()
            else:
                assert s.check().ok, where
                s.step()                                 # still usable
                assert s.requests[0].status in ("decoding", "finished"), where

    sweep(make, lambda p: p[0].close(), check, stride=3)
    sweep(make, lambda p: p[1].close(), check, stride=3)


def test_abort_from_inside_a_step_is_refused_and_changes_nothing(tiny_ckpt_small_vocab):
    sess = open_tiny(tiny_ckpt_small_vocab)
    a = sess.add_request([5, 6, 7], GREEDY)
    b = sess.add_request([8, 9], GREEDY)
    sess.step()
    before = sess.state_digest(kv=True)
    seen = []

    def edit(x):
        try:
            sess.abort(b)
        except InvalidRequestError as e:
            seen.append(str(e))
            raise
    with sess.intervene("layers.0.attn.out", edit, requests=[a]):
        with pytest.raises(InvalidRequestError, match=r"cannot run abort\(\) inside step 1"):
            sess.step()
    assert seen and sess.state_digest(kv=True) == before
    sess.abort(b)                                        # after the step it works, and stays done
    sess.step()
    assert b.status == "aborted" and b.finish_reason == "abort" and sess.check().ok


def test_a_check_from_another_thread_during_a_step_is_refused_and_leaks_nothing(tiny_ckpt_small_vocab):
    sess = open_tiny(tiny_ckpt_small_vocab)
    sess.add_request([5, 6, 7, 8, 9], GREEDY)
    sess.step()
    child = sess.fork()
    del child
    gc.collect()                                         # the dropped fork's requests are queued
    answers = []

    def probe(x):
        t = threading.Thread(target=lambda: answers.append(_try(sess.check)))
        t.start()
        t.join(timeout=60)
        return None
    with sess.intervene("layers.0.attn.out", probe):
        sess.step()
    assert answers == ["busy"]
    report = sess.check()
    assert report.ok and sess.state.manager.num_used_blocks == len(sess.requests[0].block_table)


def test_a_ctrl_c_anywhere_in_a_step_that_evicts_cached_prefix_blocks_keeps_their_kv(tiny_ckpt_small_vocab):
    """A step that takes cached prefix blocks for another request and is interrupted leaves
    the cached K/V byte for byte as it was, so a later request reusing that prefix is right."""
    prompt_a = list(range(10, 23))                          # 13 tokens: three full blocks of 4
    prompt_b = list(range(100, 113))

    def make():
        sess = open_tiny(tiny_ckpt_small_vocab, num_blocks=5, chunk_size=16, max_batch=1)
        a = sess.add_request(prompt_a, SamplingParams(max_new_tokens=1, ignore_eos=True))
        while not a.is_done:
            sess.step()
        sess.add_request(prompt_b, GREEDY)                  # needs the cached blocks: evicts them
        return sess, sess.state_digest(kv=True)

    fresh = open_tiny(tiny_ckpt_small_vocab)
    want = fresh.generate([prompt_a], GREEDY, progress=False)[0].token_ids

    def check(pair, raised, where):
        sess, before = pair
        if sess.state_digest(kv=True) != before:               # then the step committed whole
            assert len(sess.history) == 2 and sess.check().ok, f"Ctrl-C at {where}: a half step"
            return
        assert sess.check().ok, where
        for r in sess.requests:
            if not r.is_done:
                sess.abort(r)
        again = sess.add_request(prompt_a, GREEDY)
        while len(again.output_token_ids) < 2:
            sess.step()
        assert sess.audit(again).ok, f"Ctrl-C at {where} left corrupted K/V in the prefix cache"
        while not again.is_done:
            sess.step()
        assert tuple(again.output_token_ids) == want, where

    sweep(make, lambda p: p[0].step(), check, stride=11)
