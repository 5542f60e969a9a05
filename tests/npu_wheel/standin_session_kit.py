"""The Session runs the npu set is compared on: one checkpoint, a forced run and a mixed run.

Used on the CPU against the computing stand-in (``test_session_standin.py``) and on a card
(``tests/device/test_npu_conformance.py``), so the card checks the same steps: an all-fresh
prefill, chunks over a cached context, a chunk that ends no prompt, pure decode over block-0
padded tables (block size 128), a prefix-cached request and mixed steps.
"""
from __future__ import annotations

import torch

from qwen_npu import SamplingParams, Session
from qwen_npu.testing import make_tiny_qwen3

TOL = {"atol": 5e-2, "rtol": 5e-2}
PROMPTS = [list(range(3, 303)), list(range(40, 77)), [5, 6, 7, 8, 9], [11] * 130]   # 300, 37, 5, 130 tokens
SHARED = PROMPTS[0][:256] + [500, 501, 502]          # its first two blocks are in the prefix cache


def make_checkpoint(path):
    """A bf16 checkpoint with head_dim 128, so every npu kernel takes its fused op."""
    return make_tiny_qwen3(path, vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=128, intermediate_size=256, dtype=torch.bfloat16)


def open_session(path, kernels, device="cpu", **options):
    return Session.from_pretrained(path, device=device, kernels=kernels, dtype="bfloat16", block_size=128,
                                   max_batch=5, chunk_size=256, max_model_len=1024, **options)


def forced_run(sess):
    """Prefill everything, decode 3 steps, add a request sharing a cached prefix, run it to
    decoding, decode 2 more; every token forced. Returns (logits of each step or None, kinds)."""
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    for p in PROMPTS:
        sess.add_request(p, params)
    logits, kinds = [], []

    def run(step_fn):
        step = step_fn()
        kinds.append(step.kind)
        logits.append(None if step.logits is None else step.logits.to_host().float().clone())
        if step.logits is not None:
            rows = len(step.logits_request_ids)
            sess.sample(step, force=[(37 * len(logits) + 11 * i) % 500 for i in range(rows)])

    def prefill_all():
        while any(r.status in ("waiting", "prefilling") for r in sess.requests):
            run(sess.prefill)
    prefill_all()
    for _ in range(3):
        run(sess.decode_step)
    sess.add_request(SHARED, params)
    prefill_all()
    for _ in range(2):
        run(sess.decode_step)
    return logits, kinds


def mixed_run(sess):
    """Three requests decoding when a 300-token prompt arrives: its chunks share steps with the
    decode rows. Greedy: (kind, tokens, logits) per step."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for p in PROMPTS[1:]:
        sess.add_request(p, params)
    out = []
    for i in range(7):
        if i == 2:
            sess.add_request(PROMPTS[0], params)
        step = sess.step()
        out.append((step.kind, [int(t) for t in step.token_ids], step.logits.to_host().float().clone()))
    return out


def assert_same_forced_runs(got, want):
    """Two ``forced_run`` results: the same step kinds, logits within TOL step by step."""
    (got, kinds), (want, want_kinds) = got, want
    assert kinds == want_kinds and "decode" in kinds and None in got     # a chunk that ends no prompt
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), i
        if g is not None:
            torch.testing.assert_close(g, w, **TOL, msg=lambda m, i=i: f"step {i} ({kinds[i]}): {m}")


def assert_same_mixed_runs(got, want):
    """Two ``mixed_run`` results: the same kinds (a mixed step among them), logits and tokens."""
    assert [g[0] for g in got] == [w[0] for w in want] and "mixed" in [g[0] for g in got]
    for i, ((kind, tokens, logits), (_, want_tokens, want_logits)) in enumerate(zip(got, want)):
        torch.testing.assert_close(logits, want_logits, **TOL, msg=lambda m, i=i, kind=kind: f"step {i} ({kind}): {m}")
        assert tokens == want_tokens, i
