"""Edits and captures with the prefix cache on: edited K/V never reach an unedited request, and a
cached position is recomputed for an edit or a capture, or the step is refused; never skipped."""
import pytest
import torch
from research_kit import TOL, greedy, hf_activations, make_ckpt, max_diff, open_session, sequences

from qwen_npu import InvalidRequestError
from qwen_npu.research import zero

EDIT = ("layers.0.attn.out", zero())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("research_prefix"))


@pytest.fixture(scope="module")
def prompt():
    return sequences([40], seed=21)[0]


def tokens(sess, prompt, edit=None):
    if edit is None:
        return list(sess.generate([prompt], greedy(8))[0].token_ids)
    with sess.intervene(*edit):
        return list(sess.generate([prompt], greedy(8))[0].token_ids)


@pytest.fixture(scope="module")
def baselines(ckpt, prompt):
    """(clean, edited) tokens, each from a fresh session with the prefix cache off."""
    clean = tokens(open_session(ckpt, prefix_cache=False), prompt)
    edited = tokens(open_session(ckpt, prefix_cache=False), prompt, EDIT)
    assert clean != edited                                  # the edit is visible at all
    return clean, edited


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_clean_after_edited_and_edited_after_clean(ckpt, prompt, baselines, prefix_cache):
    clean, edited = baselines
    sess = open_session(ckpt, prefix_cache=prefix_cache)
    assert tokens(sess, prompt, EDIT) == edited
    assert sess.prefix_cache_stats.hit_blocks == 0
    assert tokens(sess, prompt) == clean                    # the edited K/V were never published
    assert tokens(sess, prompt, EDIT) == edited              # the edit reaches the cached prefix
    assert tokens(sess, prompt) == clean
    if prefix_cache:                                          # clean runs still share clean blocks
        assert sess.prefix_cache_stats.hit_blocks > 0
    assert sess.check().ok, sess.check().problems


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_forks_keep_edited_and_clean_k_v_apart(ckpt, prompt, baselines, prefix_cache):
    clean, edited = baselines
    parent = open_session(ckpt, prefix_cache=prefix_cache)
    assert tokens(parent, prompt) == clean
    child = parent.fork()
    assert tokens(child, prompt, EDIT) == edited             # parent's clean blocks are recomputed under the edit
    assert tokens(parent, prompt) == clean                   # and the child's edited ones never reach the parent
    other = child.fork()
    assert tokens(other, prompt) == clean

    # a request edited while its prompt runs, then forked: the child continues the edited request
    # exactly as the parent does, and neither branch publishes its blocks
    def edit_prompt_only(sess):
        req = sess.add_request(prompt, greedy(8))
        with sess.intervene(*EDIT):
            while req.num_computed_tokens < len(prompt):
                sess.step()
        return req

    want = edit_prompt_only(ref := open_session(ckpt, prefix_cache=False))
    while not want.is_done:
        ref.step()
    assert list(want.output_token_ids) not in (clean, edited)
    sess = open_session(ckpt, prefix_cache=prefix_cache)
    req = edit_prompt_only(sess)
    branch = sess.fork()
    twin = branch.requests[0]
    assert sess._engine.manager.private_reason(twin.id) is not None
    while not req.is_done:
        sess.step()
    while not twin.is_done:
        branch.step()
    assert list(req.output_token_ids) == list(twin.output_token_ids) == list(want.output_token_ids)
    assert tokens(branch, prompt) == clean and tokens(sess, prompt) == clean


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_capture_sees_every_prompt_position_even_when_cached(ckpt, prompt, prefix_cache):
    ref = open_session(ckpt, prefix_cache=False)
    with ref.capture("layers.1.attn.q") as want:
        ref.generate([prompt], greedy(2))
    sess = open_session(ckpt, prefix_cache=prefix_cache)
    sess.generate([prompt], greedy(2))                      # publishes the prompt's blocks
    with sess.capture("layers.1.attn.q") as cap:
        req = sess.add_request(prompt, greedy(2))
        while not req.is_done:
            sess.step()
    assert req.num_cached_tokens == 0                       # recomputed, not taken from the cache
    assert cap.positions(req) == list(range(len(prompt) + 1))
    assert (cap.stack("layers.1.attn.q", req) - want.stack("layers.1.attn.q", 0)).abs().max() <= TOL
    # a capture that only wants generated positions leaves the cache to do its job
    with sess.capture("logits", positions="generated") as gen:
        req = sess.add_request(prompt, greedy(3))
        while not req.is_done:
            sess.step()
    assert req.num_cached_tokens == (36 if prefix_cache else 0)
    assert gen.positions(req) == [40, 41]


def test_positions_computed_before_the_block_are_refused_with_the_remedy(ckpt, prompt):
    sess = open_session(ckpt)
    req = sess.add_request(prompt, greedy(8))
    while req.num_computed_tokens < len(prompt):
        sess.step()
    state = (req.num_computed_tokens, list(req.output_token_ids), len(sess.history))
    with sess.intervene(*EDIT, positions=[3, 5]) as iv:
        with pytest.raises(InvalidRequestError, match=r"positions \[3, 5\] of request 0.*add the prompt as a new "
                                                      r"request inside the block.*prefix_cache=False"):
            sess.step()
    assert (req.num_computed_tokens, list(req.output_token_ids), len(sess.history)) == state and iv.num_edits == 0
    with sess.capture("embed", positions=[2]):
        with pytest.raises(InvalidRequestError, match=r"capture names positions \[2\] of request 0"):
            sess.step()
    # a cached prefix is recomputed for a new request that the edit covers, from the edited block on
    with sess.intervene(*EDIT, positions=[33]) as iv:
        again = sess.add_request(prompt, greedy(1))
        sess.step()
    assert again.num_cached_tokens == 32 and iv.num_edits == 1
    sess.step()                                              # the session goes on
    assert sess.check().ok, sess.check().problems


def test_attention_refuses_an_edited_request_and_scores_show_the_edit(ckpt, prompt):
    sess = open_session(ckpt, chunk_size=64)
    clean = sess.add_request(prompt[:9], greedy(2))
    edited = sess.add_request(prompt[:9], greedy(2))
    with sess.intervene(*EDIT, requests=[edited]), sess.capture("layers.1.attn.scores") as cap:
        while edited.num_computed_tokens < 9:           # the same prompt: the second row waits a step
            sess.prefill()
            sess.sample()
    pattern = sess.attention(clean, 1, positions=list(range(9)))
    with pytest.raises(InvalidRequestError, match=r"cannot rebuild the queries of request 1: request 1 was edited "
                                                  r"at 'layers.0.attn.out'.*capture 'layers.1.attn.scores'"):
        sess.attention(edited, 1)

    def edit(out):
        return torch.zeros_like(out)
    ref = hf_activations(ckpt, prompt[:9], edits={"layers.0.attn.out": edit})["layers.1.attn.scores"]
    got = cap.stack("layers.1.attn.scores", edited)
    assert max_diff(got, ref) <= TOL
    probs = torch.softmax(cap.stack("layers.1.attn.scores", clean), -1).transpose(0, 1)   # [heads, q, k]
    assert (probs - pattern.probs[..., :9]).abs().max() <= TOL
    assert (torch.softmax(got, -1).transpose(0, 1) - pattern.probs).abs().max() > 100 * TOL
    with pytest.raises(InvalidRequestError, match="capture point only"):
        sess.intervene("layers.1.attn.scores", zero())
