"""Progress of generate: prompt chunks move the bar, progress=False is silent."""
from views_kit import small_session

from qwen_npu import SamplingParams
from qwen_npu.session.progress import StepProgress


def test_a_long_prefill_moves_the_bar_chunk_by_chunk(tiny_ckpt_small_vocab):
    sess = small_session(tiny_ckpt_small_vocab)                  # chunk_size 8
    req = sess.add_request(list(range(1, 21)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    bar = StepProgress(None, [req])
    assert bar.bar.total == 23
    seen = []
    while not req.is_done:
        bar.update(sess.step())
        seen.append(bar.bar.n)
    bar.close()
    assert seen == [8, 16, 21, 22, 23]         # 8 + 8 + 4 prompt tokens (+1 sampled), then 2 decodes
    assert "step 4 decode" in str(bar.bar.postfix)


def test_progress_false_is_silent_and_none_draws_a_bar(tiny_ckpt_small_vocab, capsys):
    sess = small_session(tiny_ckpt_small_vocab)
    sess.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), progress=False)
    assert capsys.readouterr().err == ""
    assert StepProgress(False, sess.requests).bar is None
    sess.generate([[4, 5, 6]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    err = capsys.readouterr().err
    assert "generate" in err and "/5" in err                     # 3 prompt + 2 new tokens
