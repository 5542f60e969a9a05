"""A whole Session through the npu kernel set's code path, on the CPU: torch_npu is replaced by
the stand-in whose ops compute what their documentation says (numeric_kit.py), and the npu set
is pointed at the cpu device (``kernels.npu.DEVICE_TYPE``). The checkpoint is bfloat16 with
head_dim 128, so every kernel takes its fused op; a fallback to the reference set fails the test.
Every op call is bound and checked against the wheel as it happens.

The logits of every step are compared with a ``kernels="reference"`` Session on the same
checkpoint at atol = rtol = 5e-2 (bfloat16 over two layers, as the card's parity test), with the
same tokens forced into both so the two runs see the same inputs.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from numeric_kit import BehavingStandIn
from qwen_npu.kernels import npu as npu_k

from qwen_npu import SamplingParams, Session
from qwen_npu.testing import make_tiny_qwen3

TOL = {"atol": 5e-2, "rtol": 5e-2}
PROMPTS = [list(range(3, 303)), list(range(40, 77)), [5, 6, 7, 8, 9], [11] * 130]   # 300, 37, 5, 130 tokens
SHARED = PROMPTS[0][:256] + [500, 501, 502]          # its first two blocks are in the prefix cache
FIA = "npu_fused_infer_attention_score"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-npu") / "ckpt", vocab_size=512, hidden_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=256,
                           dtype=torch.bfloat16)


@pytest.fixture
def stand_in(meta, signatures, monkeypatch):
    """torch_npu replaced by the behaving stand-in, the npu set's device type pointed at the cpu."""
    s = BehavingStandIn(meta, signatures)
    monkeypatch.setattr(npu_k, "load_torch_npu", lambda: s)
    monkeypatch.setattr(npu_k, "op_support", lambda: s.support)
    monkeypatch.setattr(npu_k, "DEVICE_TYPE", "cpu")
    npu_k.warn_fallback.cache_clear()
    yield s
    npu_k.warn_fallback.cache_clear()


def open_session(path, kernels, **options):
    return Session.from_pretrained(path, device="cpu", kernels=kernels, dtype="bfloat16", block_size=128,
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


@pytest.mark.parametrize("options", [{}, {"deterministic": True}], ids=["batched", "deterministic"])
def test_a_session_runs_the_npu_path_end_to_end_and_matches_the_reference(checkpoint, stand_in, options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = open_session(checkpoint, "npu", **options)
        assert sess.config.kernels == "npu"
        got, kinds = forced_run(sess)
    fell_back = [str(w.message) for w in caught if "running the reference kernel" in str(w.message)]
    assert not fell_back, fell_back
    want, want_kinds = forced_run(open_session(checkpoint, "reference", **options))
    assert kinds == want_kinds and "decode" in kinds and None in got     # a chunk that ends no prompt
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), i
        if g is not None:
            torch.testing.assert_close(g, w, **TOL, msg=lambda m, i=i: f"step {i} ({kinds[i]}): {m}")

    ops = {c.op for c in stand_in.calls}
    assert ops == {"npu_scatter_pa_kv_cache", FIA, "npu_rms_norm", "npu_add_rms_norm", "npu_apply_rotary_pos_emb"}
    fia = [c.kwargs for c in stand_in.calls if c.op == FIA]
    paged = [k for k in fia if k.get("block_table") is not None]
    assert all(int(k["block_table"].min()) >= 0 for k in paged)
    decode = [k for k in paged if k["actual_seq_lengths"] == list(range(1, len(k["actual_seq_lengths"]) + 1))]
    assert decode, "pure decode steps go through FIA"
    if not options:
        assert any(k.get("block_table") is None for k in fia), "the first, all-fresh prefill runs unpaged"
        first_chunks = [k for k in paged if any(q - p < kv for p, q, kv in
                                                zip([0, *k["actual_seq_lengths"]], k["actual_seq_lengths"],
                                                    k["actual_seq_lengths_kv"]) if q - p > 1)]
        assert first_chunks, "a prefill chunk over a cached context runs paged"


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


def test_mixed_steps_match_the_reference(checkpoint, stand_in):
    got = mixed_run(open_session(checkpoint, "npu", mixed_steps=True))
    want = mixed_run(open_session(checkpoint, "reference", mixed_steps=True))
    assert [g[0] for g in got] == [w[0] for w in want] and "mixed" in [g[0] for g in got]
    for i, ((kind, tokens, logits), (_, want_tokens, want_logits)) in enumerate(zip(got, want)):
        torch.testing.assert_close(logits, want_logits, **TOL, msg=lambda m, i=i, kind=kind: f"step {i} ({kind}): {m}")
        assert tokens == want_tokens, i
    assert any(c.op == FIA for c in stand_in.calls)
