"""Stop conditions: eos from generation_config, stop_token_ids, ignore_eos, max_new_tokens.

The small-vocabulary checkpoint's eos is ``vocab_size - 1``; tokens are forced with
``sess.sample(step, force=...)`` so that each condition is met on purpose.
"""
import pytest

from qwen_npu import SamplingParams
from session_kit import open_session, prompts, used_blocks

EOS = 511


@pytest.fixture
def sess(tiny_ckpt_small_vocab):
    s = open_session(tiny_ckpt_small_vocab)
    assert s.model_config.eos_token_ids == (EOS,)
    return s


def test_eos_from_generation_config_stops_and_frees(sess):
    req = sess.add_request(prompts((9,))[0], SamplingParams(max_new_tokens=8))
    other = sess.add_request(prompts((5,), seed=1)[0], SamplingParams(max_new_tokens=8))
    sess.sample(sess.prefill(), force={req.id: 3})
    assert req.status == "decoding" and len(req.block_table) == 3
    held = used_blocks(sess)
    step = sess.decode_step()
    sess.sample(step, force={req.id: EOS})
    assert req.status == "finished" and req.finish_reason == "stop"
    assert req.output_token_ids == [3, EOS]
    assert req.block_table == []
    assert used_blocks(sess) == held - 3
    assert other.status == "decoding"
    nxt = sess.decode_step()                                             # the finished request is gone
    assert nxt.request_ids == [other.id]
    sess.sample(nxt)


def test_eos_on_the_first_token(sess):
    req = sess.add_request(prompts((4,))[0])
    sess.sample(sess.prefill(), force=[EOS])
    assert (req.status, req.finish_reason, req.output_token_ids) == ("finished", "stop", [EOS])
    assert used_blocks(sess) == 0


def test_ignore_eos_keeps_going(sess):
    req = sess.add_request(prompts((4,))[0], SamplingParams(max_new_tokens=3, ignore_eos=True))
    sess.sample(sess.prefill(), force=[EOS])
    assert req.status == "decoding"
    sess.sample(sess.decode_step(), force=[EOS])
    assert req.status == "decoding"
    sess.sample(sess.decode_step(), force=[EOS])
    assert (req.status, req.finish_reason, req.output_token_ids) == ("finished", "length", [EOS] * 3)


def test_stop_token_ids_replace_eos(sess):
    req = sess.add_request(prompts((4,))[0], SamplingParams(max_new_tokens=8, stop_token_ids=[7, 9]))
    sess.sample(sess.prefill(), force=[EOS])
    assert req.status == "decoding", "explicit stop_token_ids replace the checkpoint's eos"
    sess.sample(sess.decode_step(), force=[8])
    assert req.status == "decoding"
    sess.sample(sess.decode_step(), force=[9])
    assert (req.status, req.finish_reason, req.output_token_ids) == ("finished", "stop", [EOS, 8, 9])
    assert used_blocks(sess) == 0


def test_max_new_tokens_finishes_with_length(sess):
    reqs = [sess.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(prompts((3, 6)), (1, 3))]
    sess.sample(sess.prefill())
    assert reqs[0].status == "finished" and reqs[0].finish_reason == "length"
    assert len(reqs[0].output_token_ids) == 1 and reqs[0].block_table == []
    while not reqs[1].is_done:
        sess.sample(sess.decode_step())
    assert reqs[1].finish_reason == "length" and len(reqs[1].output_token_ids) == 3
    assert used_blocks(sess) == 0
    with pytest.raises(Exception, match="nothing to decode"):
        sess.decode_step()


def test_generate_reports_finish_reasons(sess):
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    outs = sess.generate(prompts((3, 5)), sp, progress=False)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert all(len(o.token_ids) == 4 for o in outs)
    # a stop on the greedy stream's own second token ends it there, with "stop"
    second = outs[0].token_ids[1]
    stopped = sess.generate(prompts((3,)), SamplingParams(max_new_tokens=4, stop_token_ids=[second]),
                            progress=False)[0]
    cut = list(outs[0].token_ids).index(second) + 1
    assert stopped.token_ids == outs[0].token_ids[:cut] and stopped.finish_reason == "stop"
