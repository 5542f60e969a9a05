"""A poisoned K or V slot shows in the logits with every kernel set, as in the reference.

A NaN or Inf written into one cached K or V slot of a request must make that request's next
logits non-finite — in a prefill chunk (the blocked attention kernel) and in a decode step (the
one-token kernel) — so that ``sess.check()``, the health codes and a notebook all see it.
"""
from __future__ import annotations

import math

import pytest
import torch
from qwen_npu.kernels import cpu

from qwen_npu import SamplingParams, Session
from qwen_npu.testing import make_tiny_qwen3

SETS = ["reference", "cuda"] + (["cpu"] if cpu.available() else [])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("nonfinite"), vocab_size=512)


def poison(sess, req, position: int, which: str, value: float) -> None:
    bs = sess.config.block_size
    block = req.block_table[position // bs]
    cache = sess.state.kv_cache.keys if which == "key" else sess.state.kv_cache.values
    cache[0][block, position % bs] = value                  # layer 0, every kv head


@pytest.mark.parametrize("kernels", SETS)
@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_poisoned_slot_shows_in_prefill_and_decode_logits(ckpt, kernels, which, value):
    sess = Session.from_pretrained(ckpt, device="cpu", kernels=kernels, block_size=4, num_blocks=16,
                                   chunk_size=4, max_model_len=32, max_batch=2)
    req = sess.add_request([7, 8, 9, 10, 11, 12], SamplingParams(max_new_tokens=3, ignore_eos=True))
    first = sess.prefill()                                  # positions 0..3, no logits yet
    assert first.logits is None
    poison(sess, req, 1, which, value)
    chunk = sess.prefill()                                  # positions 4..5 attend to position 1
    assert not torch.isfinite(chunk.logits.tensor).all(), f"{kernels}: prefill hid a poisoned {which}"
    with pytest.warns(UserWarning):                         # StreamHealthWarning: non-finite logits
        sess.sample(chunk)

    clean = Session.from_pretrained(ckpt, device="cpu", kernels=kernels, block_size=4, num_blocks=16,
                                    chunk_size=8, max_model_len=32, max_batch=2)
    r = clean.add_request([7, 8, 9, 10, 11, 12], SamplingParams(max_new_tokens=3, ignore_eos=True))
    clean.sample(clean.prefill())
    assert r.status == "decoding"
    poison(clean, r, 2, which, value)
    step = clean.decode_step()                              # the one-token kernel
    assert not torch.isfinite(step.logits.tensor).all(), f"{kernels}: decode hid a poisoned {which}"
