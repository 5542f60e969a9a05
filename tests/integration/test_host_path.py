"""The host's part of a step (everything but the forward) makes no tensor operation once a decode
step's buffers are in use, but the seven views of the dispatch buffers the forward reads (a new
view per step: kernels/memo.py): on the CPU each operation costs tens of microseconds with the
caches the forward has just swept, and on an accelerator most would be a launch. The sampled
token ids cross as the one packed word per row the forward wrote (``pack_greedy``)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qwen_npu import SamplingParams, Session


class Operations(TorchDispatchMode):
    """The aten operations run while ``on``."""

    def __init__(self):
        super().__init__()
        self.on, self.seen = True, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
def test_a_decode_step_makes_no_tensor_operation_outside_the_forward(tiny_ckpt, kernels, monkeypatch):
    from qwen_npu.kernels import cpu
    if kernels == "cpu" and not cpu.available():
        pytest.skip(f"cpu kernels: {cpu.availability()[1]}")
    sess = Session.from_pretrained(tiny_ckpt, kernels=kernels, max_batch=4, num_blocks=32)
    reqs = [sess.add_request([5 + i, 6, 7, 8], SamplingParams(max_new_tokens=12)) for i in range(4)]
    for _ in range(5):                              # the prefill, then both pairs of decode outputs in use
        sess.step()
    ops = Operations()
    model = sess.model
    forward = type(model).__call__

    def counted(self, *args, **kwargs):
        ops.on = False
        try:
            return forward(self, *args, **kwargs)
        finally:
            ops.on = True
    monkeypatch.setattr(type(model), "__call__", counted)
    with ops:
        step = sess.step()
    assert step.kind == "decode" and step.batch_size == 4
    assert ops.seen == ["aten.slice.Tensor"] * 7        # input ids, logits rows, and 5 of metadata
    assert step.token_ids.tolist() == [r.output_token_ids[-1] for r in reqs]
    assert step.transfers["d2h"] == 4 * 8 and step.health == []


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
def test_the_word_that_crosses_carries_the_health_code(tiny_ckpt, kernels):
    """A broken row's code reaches the step through the forward's packed word, its token id through
    the low half, and the healthy row beside it is untouched."""
    import warnings

    from qwen_npu import StreamHealthWarning
    from qwen_npu.kernels import cpu
    if kernels == "cpu" and not cpu.available():
        pytest.skip(f"cpu kernels: {cpu.availability()[1]}")
    sess = Session.from_pretrained(tiny_ckpt, kernels=kernels, max_batch=2, num_blocks=32)
    broken, healthy = (sess.add_request(p, SamplingParams(max_new_tokens=4)) for p in ([5, 6, 7], [9, 10, 11]))
    sess.step()
    bs = sess.config.block_size
    sess.state.kv_cache.keys[0][broken.block_table[0], 1 % bs] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = sess.step()
    assert [type(w.message) for w in caught] == [StreamHealthWarning]
    assert step.health == [(broken.id, "non-finite logits")]
    assert step.token_ids.tolist() == [broken.output_token_ids[-1], healthy.output_token_ids[-1]]
    assert 0 <= broken.output_token_ids[-1] < sess.model_config.vocab_size
    assert step.transfers["d2h"] == 2 * 8


def test_a_step_hands_out_tensors_of_its_own(tiny_ckpt):
    """The views a step keeps for itself (the output buffers', made once per row count) are never the
    ones it hands out: changing a step's ``hidden`` or ``host_logits`` in place, shape included,
    changes no later step."""
    sess = Session.from_pretrained(tiny_ckpt, kernels="reference", max_batch=2, num_blocks=32)
    for p in ([5, 6, 7], [9, 10, 11]):
        sess.add_request(p, SamplingParams(max_new_tokens=8))
    sess.step()
    first, second = sess.step(), sess.step()
    hidden = second.hidden.clone()
    assert first.hidden is not second.hidden and first.host_logits is not second.host_logits
    first.hidden.t_()                                   # both pairs of outputs are past: the same row count
    second.hidden.unsqueeze_(0)
    first.host_logits.resize_(2, 3)
    assert torch.equal(second.hidden[0], hidden)        # still a view of the rows the forward wrote
    later = [sess.step() for _ in range(3)]
    assert [s.hidden.shape for s in later] == [hidden.shape] * 3
    assert [s.host_logits.shape for s in later] == [(0,)] * 3
    assert "logits: host copy" not in repr(later[-1])
    assert later[-1].token_ids.tolist() == [r.output_token_ids[-1] for r in sess.requests]


def test_the_greedy_words_cross_as_one_contiguous_row(tiny_ckpt):
    """The forward's greedy output is [2, rows]: the ids and the packed words each a contiguous row,
    so the copy to the host reads the words as they lie (no gather on the device first)."""
    sess = Session.from_pretrained(tiny_ckpt, kernels="reference", max_batch=4, num_blocks=32)
    for i in range(3):
        sess.add_request([5 + i, 6, 7], SamplingParams(max_new_tokens=4))
    sess.step()
    seen = []
    runner = sess._engine.runner
    dispatch = runner.dispatch

    def recording(*args, **kwargs):
        out = dispatch(*args, **kwargs)
        seen.append(out[2])
        return out
    runner.dispatch = recording
    step = sess.step()
    ids, words = seen[0]
    assert ids.is_contiguous() and words.is_contiguous() and ids.shape == words.shape == (3,)
    assert ids.tolist() == step.sampled_tokens == [w & 0xFFFFFFFF for w in words.tolist()]
