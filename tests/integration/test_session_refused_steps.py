"""A step refused before its forward returns leaves the session as it was: admissions and newly
allocated blocks are taken back, and the same step then runs normally."""
import pytest

from qwen_npu import SlotCollisionError
from qwen_npu.model.qwen3 import Qwen3Model
from session_kit import greedy, open_session, prompts, state, used_blocks


class Interrupted(Exception):
    pass


@pytest.fixture
def failing_forward(monkeypatch):
    """Make the model's forward raise (as a KeyboardInterrupt in a notebook would) until undone."""
    def fail(*args, **kwargs):
        raise Interrupted("forward interrupted")

    def arm():
        monkeypatch.setattr(Qwen3Model, "__call__", fail)
    return arm, monkeypatch.undo


def test_replicate_refusal_takes_back_the_new_block(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="raise")
    a = sess.add_request(prompts((4,))[0], greedy(6))                   # its next token opens block 2
    b = sess.add_request(prompts((3,), seed=1)[0], greedy(6))
    sess.sample(sess.prefill())
    before = state(sess)
    with pytest.raises(SlotCollisionError, match="padding"):
        sess.decode_step()
    assert state(sess) == before and len(a.block_table) == 1
    with pytest.raises(SlotCollisionError):
        sess.step()
    assert state(sess) == before
    assert b.status == "decoding"


@pytest.mark.parametrize("call", ["prefill", "step"])
def test_interrupted_prefill_admits_nobody(tiny_ckpt_small_vocab, failing_forward, call):
    sess = open_session(tiny_ckpt_small_vocab, chunk_size=6)
    running = sess.add_request(prompts((5,))[0], greedy(4))
    sess.sample(sess.prefill())
    sess.add_request(prompts((9,), seed=1)[0], greedy(3))
    sess.add_request(prompts((2,), seed=2)[0], greedy(3))
    sess.sample(sess.decode_step())
    before, blocks = state(sess), used_blocks(sess)
    arm, disarm = failing_forward
    arm()
    with pytest.raises(Interrupted):
        getattr(sess, call)()
    assert state(sess) == before and used_blocks(sess) == blocks
    assert [r.status for r in sess.requests] == ["decoding", "waiting", "waiting"]
    disarm()
    step = getattr(sess, call)()
    assert step.kind == "prefill" and step.index == before[3] + 1
    assert step.query_lens.tolist() == [6]                               # the same chunk, from the start
    if call == "prefill":
        assert step.logits is None
    while not all(r.is_done for r in sess.requests):
        sess.step()
    assert running.finish_reason == "length" and used_blocks(sess) == 0


def test_interrupted_decode_keeps_tokens_and_blocks(tiny_ckpt_small_vocab, failing_forward):
    sess = open_session(tiny_ckpt_small_vocab)
    reqs = [sess.add_request(p, greedy(5)) for p in prompts((4, 8))]    # both open a block next
    sess.sample(sess.prefill())
    before = state(sess)
    arm, disarm = failing_forward
    arm()
    with pytest.raises(Interrupted):
        sess.decode_step()
    assert state(sess) == before
    disarm()
    alone = open_session(tiny_ckpt_small_vocab).generate(prompts((4, 8)), greedy(5), progress=False)
    while not all(r.is_done for r in reqs):
        sess.step()
    assert [r.output_token_ids for r in reqs] == [list(o.token_ids) for o in alone]
