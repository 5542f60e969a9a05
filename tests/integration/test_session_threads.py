"""One call at a time per Session (and its forks), across threads: a call from a second thread
while one runs is refused at once with SessionBusyError, changes nothing, and the session goes on
as if it had never been made; the running thread may re-enter (generate calls step)."""
import threading
import time

import pytest

from qwen_npu.inspect.digest import state_digest as digest_of

from qwen_npu import Session
from qwen_npu.engine.request import SamplingParams
from qwen_npu import SessionBusyError


def _slow_generate(sess, started, release):
    """generate() whose forward waits for ``release`` (an intervention that blocks once)."""
    def hold(x):
        if not started.is_set():
            started.set()
            assert release.wait(30), "the test never released the step"
        return x
    with sess.intervene("layers.0.attn.out", hold):
        return sess.generate(["a b c d"], SamplingParams(max_new_tokens=3))


@pytest.mark.parametrize("call", ["step", "add_request", "reset", "abort", "fork", "sample", "generate"])
def test_a_second_thread_is_refused_at_once_and_changes_nothing(tiny_ckpt, call):
    sess = Session.from_pretrained(tiny_ckpt, kernels="reference", max_batch=4, block_size=4, num_blocks=64)
    other = sess.add_request("x y", SamplingParams(max_new_tokens=2))
    started, release, out = threading.Event(), threading.Event(), {}
    worker = threading.Thread(target=lambda: out.setdefault("done", _slow_generate(sess, started, release)),
                              name="cell")
    worker.start()
    try:
        assert started.wait(30)
        digest = digest_of(sess)                                 # read without the gate the cell holds
        with pytest.raises(SessionBusyError, match=r"cannot run state_digest\(\)"):
            sess.state_digest()                                  # a read waits for nothing either
        args = {"add_request": ("z",), "abort": (other,)}.get(call, ())
        t0 = time.perf_counter()
        with pytest.raises(SessionBusyError, match=rf"cannot run {call}\(\).*generate\(\).*'cell'"):
            getattr(sess, call)(*args)
        assert time.perf_counter() - t0 < 5                      # refused, not queued
        assert digest_of(sess) == digest
    finally:
        release.set()
        worker.join(60)
    assert not worker.is_alive() and len(out["done"]) == 1
    sess.add_request("z")                                       # usable again from any thread
    assert sess.check().ok


def test_a_fork_shares_the_gate_and_the_same_thread_may_reenter(tiny_ckpt):
    sess = Session.from_pretrained(tiny_ckpt, kernels="reference", max_batch=4, block_size=4, num_blocks=64)
    sess.add_request("a b c", SamplingParams(max_new_tokens=4))
    sess.step()
    branch = sess.fork()
    started, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=_slow_generate, args=(sess, started, release), name="cell")
    worker.start()
    try:
        assert started.wait(30)
        with pytest.raises(SessionBusyError):
            branch.step()
    finally:
        release.set()
        worker.join(60)
    done = branch.generate(["e f"], SamplingParams(max_new_tokens=2))     # generate -> step re-enters
    assert len(done) == 1
