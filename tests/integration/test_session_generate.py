"""generate (continuous batching), abort, reset, and the device choice."""
import pytest

from qwen_npu import Completion, DeviceError, SamplingParams, Session
from qwen_npu import device as devices
from session_kit import greedy, open_session, prompts, used_blocks

LENS = (3, 9, 5, 14, 2, 7)
NEW = (2, 6, 3, 1, 5, 4)


def lifetimes(history) -> dict[int, tuple[int, int]]:
    """Per request: (first step index, last step index) in which it had a row."""
    span = {}
    for step in history:
        for rid in step.request_ids:
            first, _ = span.get(rid, (step.index, step.index))
            span[rid] = (first, step.index)
    return span


def test_continuous_batching_keeps_input_order(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, max_batch=2, chunk_size=6)
    ps = prompts(LENS, seed=8)
    params = [greedy(n) for n in NEW]
    outs = sess.generate(ps, params, progress=False)

    assert all(isinstance(o, Completion) for o in outs)
    assert [list(o.prompt_token_ids) for o in outs] == ps
    assert [len(o.token_ids) for o in outs] == list(NEW)
    assert [o.request_id for o in outs] == [r.id for r in sess.requests]
    assert all(o.finish_reason == "length" for o in outs)
    # each completion equals the same prompt generated alone
    for p, n, o in zip(ps, NEW, outs):
        alone = open_session(tiny_ckpt_small_vocab).generate([p], greedy(n), progress=False)[0]
        assert o.token_ids == alone.token_ids

    history = list(sess.history)
    kinds = [s.kind for s in history]
    first_decode = kinds.index("decode")
    assert "prefill" in kinds[first_decode:], "no request joined after decoding began"
    assert all(s.batch_size <= 2 for s in history)
    assert all(int(s.query_lens.sum()) <= 6 for s in history if s.kind == "prefill")
    spans = lifetimes(history)
    assert len(spans) == len(LENS)
    for step in history:
        admitted = [rid for rid, (a, b) in spans.items() if a <= step.index <= b]
        assert len(admitted) <= 2, f"step {step.index}: {len(admitted)} requests admitted at once"
    assert used_blocks(sess) == 0


def test_generate_accepts_one_prompt_and_dict_sampling(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab)
    one = sess.generate(prompts((4,))[0], {"max_new_tokens": 2, "ignore_eos": True}, progress=False)
    assert len(one) == 1 and len(one[0].token_ids) == 2


def test_progress_false_prints_nothing(tiny_ckpt_small_vocab, capsys):
    sess = open_session(tiny_ckpt_small_vocab)
    capsys.readouterr()
    sess.generate(prompts((3, 4)), greedy(3), progress=False)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_progress_bar_by_default(tiny_ckpt_small_vocab, capsys):
    sess = open_session(tiny_ckpt_small_vocab)
    capsys.readouterr()
    sess.generate(prompts((3, 4)), greedy(3))
    assert "generate" in capsys.readouterr().err


def test_abort_frees_blocks_and_others_continue(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab)
    a, b, c = [sess.add_request(p, greedy(5)) for p in prompts((6, 5, 9))]
    sess.sample(sess.prefill())
    held = used_blocks(sess)
    a_blocks = len(a.block_table)
    sess.abort(a)
    assert (a.status, a.finish_reason, a.block_table) == ("aborted", "abort", [])
    assert used_blocks(sess) == held - a_blocks
    sess.abort(c.id)                                                     # by id
    assert c.status == "aborted"
    step = sess.decode_step()
    assert step.request_ids == [b.id]
    sess.sample(step)
    w = sess.add_request(prompts((4,))[0], greedy(2))
    sess.abort(w)                                                        # a waiting request
    assert w.status == "aborted" and w.block_table == []
    while not b.is_done:
        sess.step()
    assert b.finish_reason == "length" and len(b.output_token_ids) == 5
    assert len(a.output_token_ids) == 1 and used_blocks(sess) == 0


def test_abort_between_forward_and_sample(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab)
    a, b = [sess.add_request(p, greedy(4)) for p in prompts((3, 4))]
    step = sess.prefill()
    sess.abort(a)
    sess.sample(step)
    assert a.status == "aborted" and a.output_token_ids == []
    assert b.status == "decoding" and len(b.output_token_ids) == 1


def test_reset_returns_to_a_fresh_session(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab)
    first = sess.generate(prompts((5, 8)), greedy(4), progress=False)
    sess.add_request(prompts((3,))[0])
    sess.prefill()                                                       # leave a step unsampled
    sess.reset()
    assert sess.requests == [] and len(sess.history) == 0 and sess.last_step is None
    assert used_blocks(sess) == 0
    again = sess.generate(prompts((5, 8)), greedy(4), progress=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert [o.request_id for o in again] == [0, 1]


def test_seeded_sampling_survives_reset(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab)
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=42, ignore_eos=True)
    first = sess.generate(prompts((5,)), sp, progress=False)[0]
    sess.reset()
    assert sess.generate(prompts((5,)), sp, progress=False)[0].token_ids == first.token_ids


def test_device_auto_resolves_here(tiny_ckpt_small_vocab):
    if devices.npu_status()[0]:
        pytest.skip("an NPU is visible: 'auto' resolves to it")
    import torch
    want = "cuda" if torch.cuda.is_available() else "cpu"
    sess = Session.from_pretrained(tiny_ckpt_small_vocab, device="auto", max_model_len=64)
    assert sess.config.device.startswith(want)
    assert sess.model.device.type == want
    assert sess.buffers["logits"].device.type == want


def test_npu_without_an_npu_says_why(tiny_ckpt_small_vocab):
    available, reason = devices.npu_status()
    if available:
        pytest.skip("an NPU is visible")
    with pytest.raises(DeviceError) as err:
        Session.from_pretrained(tiny_ckpt_small_vocab, device="npu")
    assert reason in str(err.value) and "'npu'" in str(err.value)
