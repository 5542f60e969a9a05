"""sess.attention: probabilities rebuilt from the paged cache against a dense HF eager forward."""
import pytest
import torch
from research_kit import greedy, hf_model, make_ckpt, open_session, run_forced, sequences

from qwen_npu import InvalidRequestError

PROB_TOL = 1e-5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("research_attention"))


def hf_attentions(path, tokens):
    with torch.no_grad():
        out = hf_model(path)(torch.tensor([tokens]), output_attentions=True)
    return [a[0] for a in out.attentions]                     # per layer [heads, n, n]


def state(sess):
    """Everything attention() must leave alone."""
    engine = sess._engine
    kv = [t.clone() for t in engine.kv_cache.keys + engine.kv_cache.values]
    reqs = [(r.id, r.status, r.num_computed_tokens, list(r.output_token_ids), r.block_table) for r in sess.requests]
    ledger = {s: engine.ledger.history(s) for s in engine.ledger.written_slots()}
    blocks = [engine.manager.pool.ref_count(b) for b in range(engine.manager.num_blocks)]
    return kv, reqs, ledger, blocks, sess._step_index, len(sess.history), engine.hook


def test_probabilities_from_the_paged_cache_match_dense_hf(ckpt):
    seqs = sequences([11 + 5, 6 + 5], seed=2)
    sess = open_session(ckpt, block_size=3)
    reqs, _, _ = run_forced(sess, seqs, [11, 6])             # chunked prefill + decode steps
    layers, heads = sess.model_config.num_hidden_layers, sess.model_config.num_attention_heads
    for req, seq in zip(reqs, seqs):
        n = req.num_computed_tokens
        assert n == len(seq) - 1 and req.status == "decoding"
        ref = hf_attentions(ckpt, seq[:n])
        for layer in range(layers):
            before = state(sess)
            pat = sess.attention(req, layer)
            after = state(sess)
            assert all(torch.equal(x, y) for x, y in zip(before[0], after[0])) and before[1:] == after[1:]
            assert pat.probs.shape == (heads, n, n)
            assert (pat.probs - ref[layer]).abs().max().item() <= PROB_TOL
            assert torch.allclose(pat.probs.sum(-1), torch.ones(heads, n), atol=1e-6)
            assert pat.cache_max_diff <= 1e-5
            assert pat.positions == tuple(range(n)) and pat.token_ids == tuple(seq[:n])


def test_heads_and_positions_select_rows_and_a_corrupted_key_shows(ckpt):
    sess = open_session(ckpt, block_size=4, chunk_size=64)
    seq = sequences([9], seed=5)[0]
    req = sess.add_request(seq, greedy(4))
    sess.step()
    sess.step()
    full = sess.attention(req, 2)
    part = sess.attention(req, 2, head=[3, 1], positions=[9, 4])
    assert part.probs.shape == (2, 2, 10) and part.heads == (3, 1) and part.positions == (9, 4)
    assert torch.allclose(part.probs[0, 0], full.probs[3, 9], atol=1e-6)
    assert torch.allclose(part.probs[1, 1], full.probs[1, 4], atol=1e-6)
    assert (part.probs[:, 1, 5:] == 0).all()                  # a query never sees later keys
    slot = req.block_table[0] * 4 + 2                         # position 2 of the request
    sess.kv.key(2).view(-1, *sess.kv.key(2).shape[2:])[slot] *= 50.0
    hurt = sess.attention(req, 2, positions=[9])
    assert hurt.cache_max_diff > 1.0
    assert (hurt.probs[:, 0] - full.probs[:, 9]).abs().max() > 1e-2


def test_token_strings_label_the_axes_and_the_plot_draws_every_head(tiny_ckpt):
    from matplotlib.figure import Figure
    sess = open_session(tiny_ckpt, block_size=16, num_blocks=8)
    req = sess.add_request("The cat sat on the mat", greedy(2))
    sess.step()
    pat = sess.attention(req, 0)
    assert "".join(pat.tokens) == "The cat sat on the mat"
    assert pat.query_tokens == pat.tokens
    fig = pat.plot()
    assert isinstance(fig, Figure)
    assert len([ax for ax in fig.axes if ax.images]) == sess.model_config.num_attention_heads
    assert "layer 0" in repr(pat) and "attends to" in repr(pat)


def test_bad_arguments_are_refused(ckpt):
    sess = open_session(ckpt)
    req = sess.add_request(sequences([5])[0], greedy(1))
    with pytest.raises(InvalidRequestError, match="holds no computed K/V"):
        sess.attention(req, 0)                                # waiting: nothing cached yet
    sess.step()
    with pytest.raises(InvalidRequestError, match="holds no computed K/V"):
        sess.attention(req, 0)                                # finished: its blocks were freed
    other = sess.add_request(sequences([5], seed=3)[0], greedy(3))
    sess.step()
    for kwargs, match in (({"layer": 3}, "layer=3"), ({"layer": 0, "head": 4}, "head=4"),
                          ({"layer": 0, "positions": [5]}, "positions 0..4")):
        with pytest.raises(InvalidRequestError, match=match):
            sess.attention(other, **kwargs)
    with pytest.raises(InvalidRequestError, match="no request with id 42"):
        sess.attention(42, 0)
