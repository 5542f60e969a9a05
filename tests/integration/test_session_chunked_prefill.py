"""Chunked prefill: long prompts over several steps, several requests per step, logits only at the end."""
import pytest
import torch

from session_kit import greedy, open_session, prompts, run_to_end


def test_long_prompt_spans_several_prefill_steps(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, chunk_size=8)
    req = sess.add_request(prompts((20,))[0], greedy(2))
    assert req.status == "waiting"
    steps = [sess.prefill() for _ in range(3)]
    assert [s.query_lens.tolist() for s in steps] == [[8], [8], [4]]
    assert [s.positions.tolist() for s in steps] == [list(range(0, 8)), list(range(8, 16)), list(range(16, 20))]
    assert [s.seq_lens.tolist() for s in steps] == [[8], [16], [20]]
    assert [s.input_ids.tolist() for s in steps] == [req.prompt_token_ids[a:a + 8] for a in (0, 8, 16)]
    assert [s.logits is None for s in steps] == [True, True, False]
    assert [s.logits_request_ids for s in steps] == [[], [], [req.id]]
    assert steps[-1].logits.shape == (1, sess.model_config.vocab_size)
    assert req.num_computed_tokens == 20
    assert req.status == "prefilling", "a completed prompt stays prefilling until its row is sampled"
    sess.sample()
    assert req.status == "decoding" and len(req.output_token_ids) == 1


def test_chunk_limits_tokens_per_step(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, chunk_size=8)
    reqs = [sess.add_request(p, greedy(1)) for p in prompts((5, 10, 2))]
    a, b, c = reqs
    first = sess.prefill()
    # one step carries A's whole prompt and B's first chunk; only A completes
    assert first.request_ids == [a.id, b.id] and first.query_lens.tolist() == [5, 3]
    assert first.positions.tolist() == list(range(5)) + list(range(3))
    assert first.logits_request_ids == [a.id]
    assert (a.status, b.status, c.status) == ("prefilling", "prefilling", "waiting")
    sess.sample(first)
    assert a.status == "finished"                                        # max_new_tokens 1
    second = sess.prefill()
    assert second.request_ids == [b.id, c.id] and second.query_lens.tolist() == [7, 1]
    assert second.logits_request_ids == [b.id]
    sess.sample(second)
    third = sess.prefill()
    assert third.request_ids == [c.id] and third.query_lens.tolist() == [1]
    assert third.positions.tolist() == [1]


def test_prefill_of_named_requests(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, chunk_size=64)
    a, b = [sess.add_request(p, greedy(2)) for p in prompts((4, 6))]
    step = sess.prefill([b])
    assert step.request_ids == [b.id] and a.status == "waiting"
    sess.sample(step)
    step = sess.prefill()
    assert step.request_ids == [a.id]
    sess.sample(step)


@pytest.mark.parametrize("chunk_size", [1, 3, 8])
def test_chunked_logits_equal_unchunked(tiny_ckpt_small_vocab, chunk_size):
    ps = prompts((7, 12, 3), seed=4)

    def run(chunk):
        sess = open_session(tiny_ckpt_small_vocab, chunk_size=chunk)
        for p in ps:
            sess.add_request(p, greedy(3))
        got = {}
        run_to_end(sess, lambda s: got.update({(rid, i): s.logits.tensor[k].clone() for k, rid in
                                               enumerate(s.logits_request_ids)
                                               for i in [len(sess.request(rid).output_token_ids)]}))
        return got, [r.output_token_ids for r in sess.requests]

    ref, ref_tokens = run(512)
    got, tokens = run(chunk_size)
    assert sorted(got) == sorted(ref)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], atol=1e-4, rtol=0)
    assert tokens == ref_tokens


def test_step_prefers_prefill_and_interleaves(tiny_ckpt_small_vocab):
    """``step()`` runs a pending prefill chunk before decoding; the decode steps then resume."""
    sess = open_session(tiny_ckpt_small_vocab, chunk_size=4)
    a = sess.add_request(prompts((3,))[0], greedy(6))
    sess.step()
    assert a.status == "decoding"
    sess.step()
    assert sess.last_step.kind == "decode"
    b = sess.add_request(prompts((10,), seed=1)[0], greedy(2))
    kinds = []
    while b.status != "decoding":
        kinds.append(sess.step().kind)
    assert kinds == ["prefill"] * 3
    step = sess.step()
    assert step.kind == "decode" and step.request_ids == [a.id, b.id]
