"""Forks own their requests: a dropped or closed branch frees exactly its own blocks; a branch
that waits for blocks a sibling holds is refused with the sibling's requests named; closing the
session that owns the cache closes every branch."""
from __future__ import annotations

import gc

import pytest

from qwen_npu import InvalidRequestError, SamplingParams, Session

BS = 4


def open_tiny(ckpt, **kw):
    args = dict(device="cpu", max_batch=4, block_size=BS, max_model_len=32, num_blocks=24, chunk_size=8)
    args.update(kw)
    return Session.from_pretrained(ckpt, **args)


def greedy(n):
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def decoding(sess, prompt, n=8):
    req = sess.add_request(prompt, greedy(n))
    while req.status != "decoding":
        sess.step()
    return req


def test_a_dropped_branch_aborts_its_requests_and_frees_their_blocks(tiny_ckpt_small_vocab):
    sess = open_tiny(tiny_ckpt_small_vocab)
    parent = decoding(sess, list(range(1, 11)))
    child = sess.fork()
    (mine,) = child.requests
    child.step()                                          # the child's request grows blocks of its own
    assert mine.status == "decoding"
    del child, mine
    gc.collect()
    report = sess.check()
    assert report.ok, report
    sess.abort(parent)
    assert sess.state.manager.num_used_blocks == 0        # nothing held for a request nobody knows
    assert sess.check().ok



def test_a_branch_dropped_inside_a_step_is_aborted_after_it(tiny_ckpt_small_vocab):
    """A fork garbage-collected while a step runs, with a read (``check``) made from the step's
    callback: the step commits, and its dropped requests are aborted by the next call, not by the
    read inside the step (whose abort the step's commit would undo, leaking the blocks)."""
    sess = open_tiny(tiny_ckpt_small_vocab)
    parent = decoding(sess, list(range(1, 11)), n=12)
    holder = [sess.fork()]
    holder[0].step()
    name, reads = sess.capture_names()[0], []

    def drop_and_read(x):
        if not reads:
            holder.clear()
            gc.collect()                                  # the fork's finalizer queues its requests
            reads.append(sess.check())
        return None
    with sess.intervene(name, drop_and_read):
        step = sess.step()
    assert reads and reads[0].ok and step.request_ids == [parent.id]
    report = sess.check()                                 # the next call aborts the dropped requests
    assert report.ok, report
    sess.abort(parent)
    assert sess.state.manager.num_used_blocks == 0 and sess.check().ok

def test_closing_a_branch_frees_only_its_own_blocks(tiny_ckpt_small_vocab):
    alone = open_tiny(tiny_ckpt_small_vocab)
    want = decoding(alone, list(range(1, 11)))
    while not want.is_done:
        alone.step()

    sess = open_tiny(tiny_ckpt_small_vocab)
    parent = decoding(sess, list(range(1, 11)))
    child = sess.fork()
    child.step()
    child.close()
    assert child.closed
    with pytest.raises(InvalidRequestError, match="closed"):
        child.step()
    assert sess.check().ok
    while not parent.is_done:
        sess.step()                                       # the parent's cache is intact
    assert parent.output_token_ids == want.output_token_ids
    assert sess.state.manager.num_used_blocks == 0


def test_closing_the_owner_closes_every_branch(tiny_ckpt_small_vocab):
    sess = open_tiny(tiny_ckpt_small_vocab)
    decoding(sess, list(range(1, 11)))
    child = sess.fork()
    sess.close()
    assert sess.closed and child.closed
    with pytest.raises(InvalidRequestError, match="closed"):
        child.step()


def test_a_branch_waiting_for_a_siblings_blocks_is_refused_naming_them(tiny_ckpt_small_vocab):
    sess = open_tiny(tiny_ckpt_small_vocab, num_blocks=6)
    held = decoding(sess, list(range(1, 18)), n=6)       # 17 + 6 tokens: the parent's request takes 6 blocks
    assert sess.state.manager.num_free_blocks <= 1
    child = sess.fork()
    for r in child.requests:
        child.abort(r)                                    # the child keeps only a new prompt of its own
    with pytest.raises(InvalidRequestError, match=f"other branches of this fork hold: request {held.id}"):
        child.generate([list(range(30, 40))], greedy(4))
    assert sess.check().ok
    while not held.is_done:
        sess.step()
    (done,) = child.generate([list(range(30, 40))], greedy(4))   # once the sibling finished, it runs
    assert len(done.token_ids) == 4
