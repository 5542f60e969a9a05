"""sess.intervene: an edit inside the block changes the logits exactly as in a dense reference."""
import pytest
import torch
from research_kit import TOL, greedy, hf_activations, make_ckpt, open_session, sequences

from qwen_npu import InvalidRequestError
from qwen_npu.research import add, zero, zero_heads


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("research_intervene"))


def prefill_then_decode(sess, prompts, forced, edit=None, **where):
    """Prefill every prompt (one step, edited when ``edit`` is given), force ``forced`` tokens,
    then one unedited decode step. Returns (prefill logits, decode logits) by request order."""
    reqs = [sess.add_request(p, greedy(4)) for p in prompts]
    if edit is not None:
        with sess.intervene(*edit, **where) as iv:
            step = sess.prefill()
        assert sess._engine.hook is None and not iv.active
    else:
        step = sess.prefill()
    first = step.logits.tensor.clone()
    sess.sample(step, force=forced)
    step = sess.decode_step()
    return reqs, first, step.logits.tensor.clone()


def test_zeroing_a_layers_attention_output_matches_hf_and_does_not_persist(ckpt):
    prompts = sequences([7, 4], seed=11)
    sess = open_session(ckpt, chunk_size=64)
    forced = [17, 23]
    _, first, second = prefill_then_decode(sess, prompts, forced, edit=("layers.1.attn.out", zero()))
    for row, (p, tok) in enumerate(zip(prompts, forced)):
        n = len(p)

        def edit(out, n=n):                  # zero layer 1's o_proj output at the prompt positions only
            out = out.clone()
            out[:, :n] = 0
            return out

        ref = hf_activations(ckpt, p + [tok], edits={"layers.1.attn.out": edit})["logits"]
        clean = hf_activations(ckpt, p + [tok])["logits"]
        assert (first[row] - ref[n - 1]).abs().max().item() <= TOL
        assert (first[row] - clean[n - 1]).abs().max().item() > 100 * TOL        # the edit was visible
        # the decode step ran after the block: unedited, over the K/V the edited prefill wrote
        assert (second[row] - ref[n]).abs().max().item() <= TOL


def test_only_the_chosen_requests_and_positions_are_edited(ckpt):
    prompts = sequences([6, 5], seed=12)
    clean = open_session(ckpt, chunk_size=64)
    _, want, _ = prefill_then_decode(clean, prompts, [1, 2])
    sess = open_session(ckpt, chunk_size=64)
    sess.add_request([3, 4, 5], greedy(1))                     # request 0: not edited either
    sess.step()
    _, got, _ = prefill_then_decode(sess, prompts, [1, 2], edit=("layers.0.residual", zero()),
                                       requests=[1], positions=[2])
    assert torch.equal(got[1], want[1])                        # request 2: untouched
    assert (got[0] - want[0]).abs().max() > 1e-3               # request 1, position 2: edited

    def edit(out):                            # the same edit in HF: the residual after layer 0, position 2
        out = out.clone()
        out[:, 2] = 0
        return out

    ref = hf_activations(ckpt, prompts[0], edits={"layers.0.residual": edit})["logits"]
    assert (got[0] - ref[-1]).abs().max().item() <= TOL


def test_zeroing_heads_and_adding_a_vector(ckpt):
    prompt = sequences([8], seed=13)[0]
    sess = open_session(ckpt, chunk_size=64)
    sess.add_request(prompt, greedy(2))
    with sess.capture(["layers.2.attn.z", "layers.2.attn.out"]) as cap:
        with sess.intervene("layers.2.attn.z", zero_heads(0, 3)):
            step = sess.prefill()
    z = cap.get("layers.2.attn.z", 0, 0)
    assert (z[:, [0, 3]] == 0).all() and (z[:, [1, 2]] != 0).any()        # capture sees the edit
    o = sess.model.layers[2].o
    assert torch.allclose(cap.get("layers.2.attn.out", 0, 0), z.flatten(1) @ o.T, atol=1e-6)
    sess.sample(step)

    vec = torch.randn(sess.model_config.hidden_size, generator=torch.Generator().manual_seed(0))
    base = open_session(ckpt, chunk_size=64)
    base.add_request(prompt, greedy(2))
    with base.capture("layers.1.mlp.out") as before:
        base.prefill()
    steer = open_session(ckpt, chunk_size=64)
    steer.add_request(prompt, greedy(2))
    with steer.capture("layers.1.mlp.out") as after, steer.intervene("layers.1.mlp.out", add(vec, 0.5)):
        steer.prefill()
    diff = after.get("layers.1.mlp.out", 0, 0) - before.get("layers.1.mlp.out", 0, 0)
    assert torch.allclose(diff, 0.5 * vec.expand_as(diff), atol=1e-6)


def test_a_bad_edit_is_refused_and_the_session_goes_on(ckpt):
    sess = open_session(ckpt, chunk_size=64)
    req = sess.add_request(sequences([5], seed=14)[0], greedy(3))
    with pytest.raises(InvalidRequestError, match="returned \\[2\\], expected a tensor of shape \\[5, 64\\]"):
        with sess.intervene("layers.0.attn.out", lambda x: torch.zeros(2)):
            sess.step()
    assert sess._engine.hook is None
    while not req.is_done:
        sess.step()
    assert len(req.output_token_ids) == 3 and sess.check().ok
    with pytest.raises(InvalidRequestError, match="fn must be callable"):
        sess.intervene("embed", 3)
    with pytest.raises(InvalidRequestError, match="did you mean 'layers.0.mlp.out'"):
        sess.intervene("layers.0.mlp.outt", zero())
