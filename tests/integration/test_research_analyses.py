"""Logit lens, direct logit attribution and activation patching against a dense Hugging Face
forward of the same tiny checkpoint (float32; tolerance TOL = 1e-4 absolute on logits)."""
import pytest
import torch
from research_kit import TOL, greedy, hf_activations, hf_model, make_ckpt, open_session, sequences

from qwen_npu import InvalidRequestError
from qwen_npu.research import DLA_NAMES, activation_patching, direct_logit_attribution, logit_lens

N = 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("research_analyses"))


@pytest.fixture(scope="module")
def prompt():
    return sequences([N], seed=31)[0]


@pytest.fixture(scope="module")
def captured(ckpt, prompt):
    """The prompt prefilled in chunks (prefix cache on, published by an earlier run) and captured."""
    sess = open_session(ckpt)
    sess.generate([prompt], greedy(1))
    with sess.capture(list(DLA_NAMES) + ["layers.*.resid_mid"]) as cap:
        req = sess.add_request(prompt, greedy(1))
        step = sess.step()
        while req.num_computed_tokens < N:
            step = sess.step()
    return sess, req, cap, step.logits.tensor[0].clone() if step.logits is not None else None


def hf_unembed(ckpt, resid):
    model = hf_model(ckpt)
    with torch.no_grad():
        return model.lm_head(model.model.norm(resid))


def test_logit_lens_matches_dense_hf_at_every_prompt_position(ckpt, prompt, captured):
    sess, req, cap, _ = captured
    lens = logit_lens(sess, cap, req, names=["embed", "layers.*.resid_mid", "layers.*.residual"], k=3)
    assert lens.positions == tuple(range(N)) and len(lens.names) == 1 + 2 * 3
    ref = hf_activations(ckpt, prompt)
    worst = 0.0
    for name in lens.names:
        want = hf_unembed(ckpt, ref[name])
        worst = max(worst, (lens.logits(name) - want).abs().max().item())
        assert torch.equal(lens.top_ids[lens.names.index(name)], want.topk(3, dim=-1).indices)
    assert worst <= TOL
    # the lens of the last layer's stream is the model's own logits
    assert (lens.logits("layers.2.residual")[-1] - ref["logits"][-1]).abs().max() <= TOL
    last = int(ref["logits"][-1].argmax())
    assert lens.rank(last)[-1, -1] == 0 and 0 < float(lens.prob(last)[-1, -1]) <= 1
    assert "Logit lens of request" in lens._repr_html_() and "layers.0.resid_mid" in repr(lens)
    with pytest.raises(InvalidRequestError, match="residual-stream points"):
        logit_lens(sess, cap, req, names="layers.*.attn.z")
    with pytest.raises(InvalidRequestError, match=r"positions \[99\]"):
        logit_lens(sess, cap, req, positions=[99])


def test_direct_logit_attribution_matches_dense_hf_per_head(ckpt, prompt, captured):
    sess, req, cap, _ = captured
    ref = hf_activations(ckpt, prompt)
    target, baseline = [int(t) for t in ref["logits"][-1].topk(2).indices]
    dla = direct_logit_attribution(sess, cap, req, target, baseline)
    model, c = hf_model(ckpt), sess.model_config
    r = ref["layers.2.residual"][-1]
    d = (model.lm_head.weight[target] - model.lm_head.weight[baseline]) * model.model.norm.weight
    d = d / torch.sqrt(r.pow(2).mean() + c.rms_norm_eps)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            z = ref[f"layers.{i}.attn.z"][-1]                                       # [heads, hd]
            o = layer.self_attn.o_proj.weight.reshape(c.hidden_size, c.num_attention_heads, c.head_dim)
            want = torch.stack([(o[:, h] @ z[h]) @ d for h in range(c.num_attention_heads)])
            assert (dla.heads[i] - want).abs().max() <= TOL
            assert abs(float(dla.mlp[i]) - float(ref[f"layers.{i}.mlp.out"][-1] @ d)) <= TOL
        assert abs(dla.embed - float(ref["embed"][-1] @ d)) <= TOL
    hf_diff = float(ref["logits"][-1][target] - ref["logits"][-1][baseline])
    assert abs(dla.total - hf_diff) <= TOL and abs(dla.actual - hf_diff) <= TOL
    assert len(dla.table()) == 1 + 2 * 3 and "parts sum to" in repr(dla)
    with pytest.raises(InvalidRequestError, match="needs a capture of"):
        with sess.capture("embed") as small:
            sess.generate([[1, 2, 3]], greedy(1))
        direct_logit_attribution(sess, small, sess.requests[-1].id, target)


def hf_patched_metric(ckpt, corrupted, name, position, value, target, baseline, head=None):
    """Dense HF forward of ``corrupted`` with ``name`` at ``position`` replaced by ``value``."""
    model = hf_model(ckpt)
    i = int(name.split(".")[1])
    layer = model.model.layers[i]
    if name.endswith(".residual"):
        def hook(mod, args, out):
            t = out[0] if isinstance(out, tuple) else out
            t[0, position] = value
        handle = layer.register_forward_hook(hook)
    else:                                   # attn.z: the input of o_proj, one head
        hd = model.config.head_dim

        def hook(mod, args):
            x = args[0].clone()
            x[0, position, head * hd:(head + 1) * hd] = value[head]
            return (x,)
        handle = layer.self_attn.o_proj.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([corrupted])).logits[0, -1]
    finally:
        handle.remove()
    return float(logits[target] - logits[baseline])


def test_activation_patching_matches_dense_hf(ckpt, prompt):
    clean = prompt
    corrupted = list(prompt)
    corrupted[3] = (corrupted[3] + 7) % 500
    ref_clean, ref_bad = hf_activations(ckpt, clean), hf_activations(ckpt, corrupted)
    target = int(ref_clean["logits"][-1].argmax())
    baseline = int(ref_bad["logits"][-1].argmax())
    if baseline == target:
        baseline = int(ref_bad["logits"][-1].topk(2).indices[1])
    sess = open_session(ckpt)
    res = activation_patching(sess, clean, corrupted, target, baseline, names="layers.*.residual",
                              positions=[2, 3, 4, N - 1])
    assert res.effects.shape == (3, 4)
    diff = lambda a: float(a["logits"][-1][target] - a["logits"][-1][baseline])   # noqa: E731
    assert abs(res.clean_metric - diff(ref_clean)) <= TOL and abs(res.corrupted_metric - diff(ref_bad)) <= TOL
    for i, name in enumerate(res.names):
        for j, p in enumerate(res.positions):
            want = hf_patched_metric(ckpt, corrupted, name, p, ref_clean[name][p], target, baseline)
            assert abs(float(res.effects[i, j]) - want) <= TOL, (name, p)
    # patching the last layer's stream at the last position restores the clean logits exactly;
    # before the corrupted token nothing changes
    assert abs(float(res.restored[2, 3]) - 1.0) <= 1e-3 and res.restored[:, 0].abs().max() <= 1e-3
    heads = activation_patching(sess, clean, corrupted, target, baseline, names="layers.1.attn.z",
                                positions=[N - 1], heads=True)
    assert heads.effects.shape == (1, 4, 1)
    for h in range(4):
        want = hf_patched_metric(ckpt, corrupted, "layers.1.attn.z", N - 1, ref_clean["layers.1.attn.z"][N - 1],
                                 target, baseline, head=h)
        assert abs(float(heads.effects[0, h, 0]) - want) <= TOL
    assert len(res.table()) == 12 and "Activation patching" in res._repr_html_()
    assert sess.check().ok and not any(not r.is_done for r in sess.requests)
    with pytest.raises(InvalidRequestError, match="equal lengths"):
        activation_patching(sess, clean, corrupted[:-1], target)
    with pytest.raises(InvalidRequestError, match="heads=True needs per-head points"):
        activation_patching(sess, clean, corrupted, target, names="layers.0.residual", heads=True)


def test_metrics_name_tokens_by_their_text_and_plots_draw_tokens_unescaped():
    """On a checkpoint with a tokenizer, a metric reads ``logit[id 'text']``; the lens plot draws a
    token the font lacks as a box, never as an escaped code point."""
    from qwen_npu import Session
    from qwen_npu.inspect.plots import MISSING_GLYPH
    from qwen_npu.testing import tiny_trained_qwen3
    sess = Session.from_pretrained(tiny_trained_qwen3(), kernels="reference", block_size=4, num_blocks=32)
    ids = sess.tokenizer.encode("a small tree of the genus")
    (t,), (b,) = sess.tokenizer.encode(" P"), sess.tokenizer.encode(" of")
    corrupted = ids[:-1] + sess.tokenizer.encode(" family")
    res = activation_patching(sess, ids, corrupted, t, b, names="layers.3.residual", positions=[len(ids) - 1])
    assert res.metric == f"logit[{t} ' P'] - logit[{b} ' of']"
    assert res.plot().texts[0].get_text() == f"activation patching: {res.metric}"
    req = sess.add_request(ids, greedy(2))
    with sess.capture(list(DLA_NAMES)) as cap:
        while req.num_computed_tokens < len(ids):
            sess.step()
    dla = direct_logit_attribution(sess, cap, req, t, b)
    assert dla.metric == res.metric and res.metric in repr(dla)
    lens = logit_lens(sess, cap, req, names=["embed"], k=1)
    shown = [x.get_text() for x in lens.plot().axes[0].texts]
    tops = [sess.tokenizer.decode([int(i)]) for i in lens.top_ids[0, :, 0]]
    assert "\ufffd" in tops                            # the embed lens favours a partial byte here
    assert all("\\u" not in s and "\\x" not in s for s in shown)
    assert MISSING_GLYPH in shown or "\ufffd" in shown
    sess.abort(req)
