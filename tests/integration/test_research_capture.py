"""sess.capture: activations of prefill and decode steps against a dense Hugging Face forward."""
import pytest
import torch
from research_kit import TOL, greedy, hf_activations, make_ckpt, max_diff, open_session, run_forced, sequences

from qwen_npu import InvalidRequestError

PROMPT_LENS = [9, 5]
DECODE = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("research_capture"))


@pytest.fixture(scope="module")
def seqs():
    return sequences([n + DECODE for n in PROMPT_LENS], seed=1)


@pytest.fixture(scope="module")
def forced_run(ckpt, seqs):
    """Two requests, chunked prefill (chunk 6), then teacher-forced decode steps, all captured."""
    sess = open_session(ckpt)
    reqs, cap, _ = run_forced(sess, seqs, PROMPT_LENS, cap_names=["*", "layers.*.attn.scores"])
    return sess, reqs, cap


def test_every_hook_point_of_every_position_matches_dense_hf(ckpt, seqs, forced_run):
    sess, reqs, cap = forced_run
    kinds = {cap.records[i].kind for i in range(len(cap.records))}
    assert kinds == {"prefill", "decode"}
    for req, seq in zip(reqs, seqs):
        n = len(seq) - 1                                     # the last forced token is never computed
        ref = hf_activations(ckpt, seq[:n])
        for name in sess.capture_names():
            got = cap.stack(name, req)
            positions = cap.positions(req, name)
            if name in ("final_norm", "logits"):             # only rows that produce a next token
                assert positions == list(range(PROMPT_LENS[reqs.index(req)] - 1, n))
            else:
                assert positions == list(range(n))
            want = ref[name][positions]
            assert got.shape == want.shape, name
            assert max_diff(got, want) <= TOL, name


def test_a_decode_step_capture_splits_rows_by_request(forced_run):
    sess, reqs, cap = forced_run
    decode = [s for s in cap.steps if cap.records and any(r.step == s and r.kind == "decode" for r in cap.records)]
    step = decode[0]
    for req in reqs:
        q = cap.get("layers.1.attn.q", step, req)
        assert q.shape == (1, sess.model_config.num_attention_heads, sess.model_config.head_dim)
        k = cap.get("layers.1.attn.k", step, req)
        assert k.shape == (1, sess.model_config.num_key_value_heads, sess.model_config.head_dim)
    by_key = cap["layers.1.attn.q"]
    assert (step, reqs[0].id) in by_key and (step, reqs[1].id) in by_key


def test_captures_are_snapshots_and_nothing_stays_attached(ckpt):
    sess = open_session(ckpt)
    req = sess.add_request(sequences([5])[0], greedy(6))
    with sess.capture(["layers.*.residual", "logits"]) as cap:
        assert sess._engine.hook is not None
        step = sess.prefill()
        want = step.logits.tensor.clone()
        sess.sample(step)
        step = sess.decode_step()
        want_decode = step.logits.tensor.clone()
        sess.sample(step)
    assert sess._engine.hook is None and not cap.active
    for _ in range(3):
        sess.step()                        # later steps overwrite the device logits buffers
    assert torch.equal(cap.get("logits", 0, req), want)
    assert torch.equal(cap.get("logits", 1, req), want_decode)
    assert cap.steps == [0, 1] and cap.names == ("layers.0.residual", "layers.1.residual", "layers.2.residual",
                                                 "logits")
    assert len(req.output_token_ids) == 5


def test_capture_is_removed_when_the_block_raises(ckpt):
    sess = open_session(ckpt)
    with pytest.raises(RuntimeError, match="boom"), sess.capture("embed"):
        raise RuntimeError("boom")
    assert sess._engine.hook is None


def test_capture_only_the_named_requests(ckpt):
    sess = open_session(ckpt, chunk_size=64)
    a, b = (sess.add_request(s, greedy(2)) for s in sequences([6, 8], seed=4))
    with sess.capture("final_norm", requests=[b]) as cap:
        sess.step()
    assert cap.request_ids == [b.id]
    with pytest.raises(InvalidRequestError, match=f"request {a.id}"):
        cap.get("final_norm", cap.steps[0], a)


def test_the_tokens_and_logits_do_not_change_with_a_capture_on(ckpt):
    outs = []
    for names in (None, "*"):
        sess = open_session(ckpt)
        reqs = [sess.add_request(s, greedy(4)) for s in sequences([6, 3], seed=7)]
        if names is None:
            while not all(r.is_done for r in reqs):
                sess.step()
        else:
            with sess.capture(names):
                while not all(r.is_done for r in reqs):
                    sess.step()
        outs.append([r.output_token_ids for r in reqs])
    assert outs[0] == outs[1]


def test_unknown_names_are_refused_with_close_matches(ckpt):
    sess = open_session(ckpt)
    with pytest.raises(InvalidRequestError, match="did you mean 'layers.1.attn.q'"):
        sess.capture(["layers.1.attn.qq"])
    with pytest.raises(InvalidRequestError, match="no activation named 'layers.9.\\*'"):
        sess.capture("layers.9.*")
    with pytest.raises(InvalidRequestError, match="no request with id 99"):
        sess.capture("embed", requests=[99])
    assert sess._engine.hook is None


def test_capture_names_lists_every_point_in_forward_order(ckpt):
    sess = open_session(ckpt)
    names = sess.capture_names()
    assert names[0] == "embed" and names[-2:] == ["final_norm", "logits"]
    per_layer = [n.split(".", 2)[2] for n in names if n.startswith("layers.0.")]
    assert per_layer == ["resid_pre", "attn.in", "attn.q_pre_rope", "attn.k_pre_rope", "attn.q", "attn.k", "attn.v",
                         "attn.scores", "attn.z", "attn.out", "resid_mid", "mlp.in", "mlp.act", "mlp.out", "residual"]
    assert len(names) == 3 + 15 * 3
    # globs leave out the costly scores unless the pattern names them
    assert "layers.0.attn.scores" not in sess.capture("*").names
    assert sess.capture("layers.*.attn.scores").names == tuple(f"layers.{i}.attn.scores" for i in range(3))


def test_deterministic_mode_captures_every_token_under_its_row(ckpt, seqs, forced_run):
    """Token-by-token forwards file each token's activations under its own row and position."""
    sess, reqs, cap = forced_run
    det = open_session(ckpt, deterministic=True)
    det_reqs, det_cap, _ = run_forced(det, seqs, PROMPT_LENS, cap_names=["layers.1.attn.q", "logits"])
    for req, dreq in zip(reqs, det_reqs):
        for name in ("layers.1.attn.q", "logits"):
            assert det_cap.positions(dreq, name) == cap.positions(req, name)
            torch.testing.assert_close(det_cap.stack(name, dreq), cap.stack(name, req), atol=TOL, rtol=0)
