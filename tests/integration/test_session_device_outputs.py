"""Device-resident outputs: what crosses to the host, buffer reuse, stale handles, clones.

``QWEN_NPU_DEVICE_OUTPUTS`` is read when the Session is created: unset or "1" keeps the logits on
the device (the host receives only token ids), "0" copies the full logits to the host every step.
"""
import pytest
import torch

from qwen_npu import StaleOutputError
from session_kit import greedy, open_session, prompts

ENV = "QWEN_NPU_DEVICE_OUTPUTS"
ROWS = 3


def open_with_env(path, monkeypatch, value, **kw):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    return open_session(path, **kw)


def decoding(sess, rows=ROWS, new_tokens=8):
    reqs = [sess.add_request(p, greedy(new_tokens)) for p in prompts([4 + 2 * i for i in range(rows)], seed=2)]
    sess.sample(sess.prefill())
    return reqs


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False)], ids=["unset", "1", "0"])
def test_env_decides_what_reaches_the_host(tiny_ckpt_small_vocab, monkeypatch, value, on):
    sess = open_with_env(tiny_ckpt_small_vocab, monkeypatch, value)
    assert sess.config.device_outputs is on
    vocab = sess.model_config.vocab_size
    decoding(sess)
    step = sess.decode_step()
    logits = step.logits.tensor.clone()                                  # [rows, vocab]
    full = ROWS * vocab * 4
    if on:
        assert step.host_logits.device.type == "cpu" and step.host_logits.numel() == 0
        assert step.transfers["d2h"] == 0
    else:
        assert step.host_logits.device.type == "cpu"
        assert tuple(step.host_logits.shape) == (ROWS, vocab)
        assert step.host_logits.data_ptr() != step.logits.tensor.data_ptr()  # a copy, not the buffer
        assert torch.equal(step.host_logits, logits)
        assert step.transfers["d2h"] == full
    sess.sample(step)
    # greedy decode: exactly one int64 token id per row crosses, plus the logits when off
    assert step.token_ids.numel() == ROWS
    assert step.transfers["d2h"] == ROWS * 8 + (0 if on else full)
    assert step.token_ids.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("value", [None, "1", "0"], ids=["unset", "1", "0"])
def test_argument_overrides_env(tiny_ckpt_small_vocab, monkeypatch, value):
    off = open_with_env(tiny_ckpt_small_vocab, monkeypatch, value, device_outputs=False)
    on = open_with_env(tiny_ckpt_small_vocab, monkeypatch, value, device_outputs=True)
    assert off.config.device_outputs is False and on.config.device_outputs is True
    for sess, expect_full in ((off, True), (on, False)):
        decoding(sess, rows=1)
        step = sess.decode_step()
        assert (step.host_logits.numel() > 0) is expect_full
        sess.sample(step)


def test_env_read_at_creation_only(tiny_ckpt_small_vocab, monkeypatch):
    sess = open_with_env(tiny_ckpt_small_vocab, monkeypatch, "0")
    monkeypatch.setenv(ENV, "1")
    decoding(sess, rows=1)
    step = sess.decode_step()
    assert step.host_logits.numel() == sess.model_config.vocab_size
    sess.sample(step)


def test_output_buffer_reused_and_old_handles_go_stale(tiny_ckpt_small_vocab, monkeypatch):
    sess = open_with_env(tiny_ckpt_small_vocab, monkeypatch, None)
    decoding(sess)
    first = sess.decode_step()
    first_ptr = first.logits.tensor.data_ptr()
    kept = first.logits.clone()
    values = first.logits.tensor.clone()
    sess.sample(first)
    assert "live" in repr(first.logits)

    second = sess.decode_step()
    assert second.batch_size == first.batch_size
    # two buffers per kind, taken in turn: a step never writes the one the last step's logits live in
    pair = {sess.buffers["logits"].data_ptr(), sess.buffers["logits.1"].data_ptr()}
    assert second.logits.tensor.data_ptr() != first_ptr and pair == {first_ptr, second.logits.tensor.data_ptr()}
    with pytest.raises(StaleOutputError, match=f"step {first.index}"):
        first.logits.tensor
    assert "stale" in repr(first.logits)
    assert torch.equal(kept.tensor, values)
    assert kept.tensor.data_ptr() != first_ptr
    assert not torch.equal(second.logits.tensor, values)                # the buffer really moved on
    sess.sample(second)
    assert torch.equal(kept.tensor, values)
    third = sess.decode_step()
    assert third.logits.tensor.data_ptr() == first_ptr                   # reused, not reallocated
    with pytest.raises(StaleOutputError):
        second.logits.tensor


def test_prefill_and_decode_buffers_are_separate_keys(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, chunk_size=4)
    a = sess.add_request(prompts((3,))[0], greedy(4))
    sess.sample(sess.prefill())
    sess.add_request(prompts((6,), seed=1)[0], greedy(4))
    dec = sess.decode_step()
    sess.sample(dec)
    pre = sess.prefill()                                                 # no logits: the prompt needs 2 chunks
    assert pre.logits is None and pre.logits_request_ids == []
    assert dec.logits.tensor.shape[0] == 1                               # a prefill does not stale decode logits
    pre = sess.prefill()
    prefill_bufs = {sess.buffers[n].data_ptr() for n in ("prefill.logits", "prefill.logits.1")}
    decode_bufs = {sess.buffers[n].data_ptr() for n in ("logits", "logits.1")}
    assert pre.logits.tensor.data_ptr() in prefill_bufs and dec.logits.tensor.data_ptr() in decode_bufs
    assert not prefill_bufs & decode_bufs
    sess.sample(pre)
    assert a.status == "decoding"


def test_topk_and_to_host_count_their_bytes(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab)
    decoding(sess)
    step = sess.decode_step()
    vals, ids = step.logits.topk(3)
    assert vals.device.type == "cpu" and tuple(ids.shape) == (ROWS, 3)
    ref = step.logits.tensor.topk(3, dim=-1)
    assert torch.equal(vals, ref.values) and torch.equal(ids, ref.indices)
    assert step.transfers["d2h"] == vals.nbytes + ids.nbytes
    host = step.logits.to_host()
    assert torch.equal(host, step.logits.tensor) and host.data_ptr() != step.logits.tensor.data_ptr()
    assert step.transfers["d2h"] == vals.nbytes + ids.nbytes + host.nbytes
    assert step.transfers["h2d"] > 0                                     # the step's dispatch arguments
    sess.sample(step)


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_d2h_bytes_at_batch_16_with_the_real_vocabulary(tiny_ckpt, on):
    sess = open_session(tiny_ckpt, max_batch=16, device_outputs=on)
    vocab = sess.model_config.vocab_size
    assert vocab == 151936
    for p in prompts([3 + i for i in range(16)], vocab=150000, seed=6):
        sess.add_request(p, greedy(3))
    sess.sample(sess.prefill())
    step = sess.decode_step()
    sess.sample(step)
    assert step.batch_size == 16
    assert step.transfers["d2h"] == 16 * 8 + (0 if on else 16 * vocab * 4)   # 128 B vs 9,724,032 B
