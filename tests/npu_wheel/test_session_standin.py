"""A whole Session through the npu kernel set's code path, on the CPU: torch_npu is replaced by
the stand-in whose ops compute what their documentation says (numeric_kit.py), and the npu set
is pointed at the cpu device (``kernels.npu.DEVICE_TYPE``). The checkpoint is bfloat16 with
head_dim 128, so every kernel takes its fused op; a fallback to the reference set fails the test.
Every op call is bound and checked against the wheel as it happens.

The logits of every step are compared with a ``kernels="reference"`` Session on the same
checkpoint at atol = rtol = 5e-2 (bfloat16 over two layers, as the card's parity test), with the
same tokens forced into both so the two runs see the same inputs. The runs are standin_session_kit.py's,
which the card's conformance suite repeats on an npu.
"""
from __future__ import annotations

import warnings

import pytest
from numeric_kit import BehavingStandIn
from qwen_npu.kernels import npu as npu_k
from standin_session_kit import (
    assert_same_forced_runs,
    assert_same_mixed_runs,
    forced_run,
    make_checkpoint,
    mixed_run,
    open_session,
)

FIA = "npu_fused_infer_attention_score"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny-npu") / "ckpt")


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


def test_a_session_runs_the_npu_path_end_to_end_and_matches_the_reference(checkpoint, stand_in):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = open_session(checkpoint, "npu")
        assert sess.config.kernels == "npu"
        got = forced_run(sess)
    fell_back = [str(w.message) for w in caught if "running the reference kernel" in str(w.message)]
    assert not fell_back, fell_back
    assert_same_forced_runs(got, forced_run(open_session(checkpoint, "reference")))

    ops = {c.op for c in stand_in.calls}
    assert ops == {"npu_scatter_pa_kv_cache", FIA, "npu_rms_norm", "npu_add_rms_norm", "npu_apply_rotary_pos_emb"}
    fia = [c.kwargs for c in stand_in.calls if c.op == FIA]
    paged = [k for k in fia if k.get("block_table") is not None]
    assert all(int(k["block_table"].min()) >= 0 for k in paged)
    decode = [k for k in paged if k["actual_seq_lengths"] == list(range(1, len(k["actual_seq_lengths"]) + 1))]
    assert decode, "pure decode steps go through FIA"
    assert any(k.get("block_table") is None for k in fia), "the first, all-fresh prefill runs unpaged"
    first_chunks = [k for k in paged if any(q - p < kv for p, q, kv in
                                            zip([0, *k["actual_seq_lengths"]], k["actual_seq_lengths"],
                                                k["actual_seq_lengths_kv"]) if q - p > 1)]
    assert first_chunks, "a prefill chunk over a cached context runs paged"


def test_deterministic_on_the_npu_set_runs_the_pure_torch_batch_invariant_form(checkpoint, stand_in):
    """The fused ops promise no batch invariance, so a deterministic npu Session calls none of
    them: it runs the reference set's invariant form on its device, the reference Session's bits."""
    sess = open_session(checkpoint, "npu", deterministic=True)
    assert sess.config.kernels == "npu" and repr(sess._engine.model.kernels) == "BatchInvariant('npu')"
    got = forced_run(sess)
    assert stand_in.calls == []
    want = forced_run(open_session(checkpoint, "reference", deterministic=True))
    assert_same_forced_runs(got, want)


def test_mixed_steps_match_the_reference(checkpoint, stand_in):
    got = mixed_run(open_session(checkpoint, "npu", mixed_steps=True))
    assert_same_mixed_runs(got, mixed_run(open_session(checkpoint, "reference", mixed_steps=True)))
    assert any(c.op == FIA for c in stand_in.calls)
