"""Log-probabilities (per generated token, top-k alternatives) and score() against a dense HF forward."""
import pytest
import torch

from qwen_npu import InvalidRequestError, SamplingParams, Session
from qwen_npu.engine import logprobs
from qwen_npu.testing import make_tiny_qwen3

TOL = 1e-4          # float32: our paged forward agrees with the dense one to ~1e-5 on logits
VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("lp"), vocab_size=VOCAB, tie_word_embeddings=False, seed=6)


@pytest.fixture(scope="module")
def dense(ckpt):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()

    def log_probs(ids):                   # [len(ids), vocab]: log p(next | ids[:i+1])
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return log_probs


@pytest.fixture
def sess(ckpt):
    return Session.from_pretrained(ckpt, device="cpu", max_batch=4, block_size=4, num_blocks=128,
                                   max_model_len=96, chunk_size=8)


def prompts(seed=0, lens=(5, 11, 19)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lens]


def test_generated_logprobs_and_top_k_match_dense_log_softmax(sess, dense):
    k = 5
    sps = [SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=k),
           SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=3, logprobs=2),
           SamplingParams(max_new_tokens=6, ignore_eos=True)]
    outs = sess.generate(prompts(), sps, progress=False)
    assert outs[2].logprobs is None
    for out, sp in zip(outs[:2], sps[:2]):
        ids = list(out.prompt_token_ids) + list(out.token_ids)
        ref = dense(ids)
        assert len(out.logprobs) == len(out.token_ids)
        for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(out.prompt_token_ids) - 1 + i]
            assert lp.token_id == tok
            assert abs(lp.logprob - row[tok].item()) <= TOL
            assert len(lp.top) == sp.logprobs
            want = row.topk(sp.logprobs).values
            assert torch.allclose(torch.tensor([v for _, v in lp.top]), want, atol=TOL)
            for t, v in lp.top:                    # each alternative is the token it claims to be
                assert abs(row[t].item() - v) <= TOL
        if sp.greedy:
            assert all(lp.top[0][0] == lp.token_id for lp in out.logprobs)


def test_only_k_values_per_row_cross_to_the_host(sess):
    reqs = [sess.add_request(p, SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=k))
            for p, k in zip(prompts(), (4, None, 1))]
    sess.step()                                    # prefill: the 5-token prompt fits in one chunk of 8
    while any(r.status == "prefilling" or r.status == "waiting" for r in reqs):
        sess.step()
    step = sess.decode_step()
    d2h_before = step.transfers["d2h"]
    sess.sample(step)
    rows = len(step.logits_request_ids)
    assert rows == 3
    assert step.transfers["d2h"] - d2h_before == rows * (2 + 4) * 8        # one int64 row of 2 + max k
    assert step.transfers["d2h"] - d2h_before < VOCAB * 4                   # far below one logits row
    assert reqs[1].logprobs is None and len(reqs[2].logprobs[-1].top) == 1


def test_without_logprobs_the_copy_stays_one_int64_per_row(sess):
    sess.add_request(prompts()[0], SamplingParams(max_new_tokens=2, ignore_eos=True))
    sess.step()
    step = sess.step()
    assert step.kind == "decode" and step.transfers["d2h"] == 8


def test_attach_makes_no_host_sync():
    logits = torch.randn(3, 50)
    ids = logits.argmax(-1)
    with _NoSync():
        packed = logprobs.attach(ids, logits, ids, 4)
    assert packed.shape == (3, 6)
    out = logprobs.unpack(packed, [4, None, 0])
    assert out[1] is None and out[2].top == () and out[0].token_id == ids[0].item()
    assert abs(out[0].logprob - torch.log_softmax(logits, -1)[0, ids[0]].item()) < 1e-6


class _NoSync(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("item", "tolist", "cpu", "__bool__"):
            raise AssertionError(f"host sync: {func.__name__}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("include_prompt", [False, True])
def test_score_matches_dense_log_softmax(sess, dense, include_prompt):
    prompt, cont = prompts(seed=1, lens=(9, 7))
    res = sess.score(prompt, cont, include_prompt=include_prompt)
    ref = dense(prompt + cont)
    first = 1 if include_prompt else len(prompt)
    want_tokens = (prompt + cont)[first:]
    assert list(res.token_ids) == want_tokens
    assert list(res.positions) == list(range(first, len(prompt) + len(cont)))
    want = torch.tensor([ref[p - 1, t].item() for p, t in zip(res.positions, res.token_ids)])
    assert torch.allclose(torch.tensor(res.logprobs), want, atol=TOL)
    assert res.perplexity == pytest.approx(torch.exp(-want.mean()).item(), rel=1e-3)
    assert sess.request(res.request_id).status == "finished"


def test_score_leaves_other_requests_untouched(sess, ckpt):
    p = prompts()
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = Session.from_pretrained(ckpt, device="cpu", max_batch=4, block_size=4, num_blocks=128,
                                    max_model_len=96, chunk_size=8).generate(p[:2], sp, progress=False)
    reqs = [sess.add_request(x, sp) for x in p[:2]]
    for _ in range(4):
        sess.step()
    def state():
        return [(r.status, list(r.output_token_ids), r.num_computed_tokens, r.block_table) for r in reqs]
    before = state()
    sess.score(p[2], [1, 2, 3])
    assert state() == before
    while not all(r.is_done for r in reqs):
        sess.step()
    assert [tuple(r.output_token_ids) for r in reqs] == [c.token_ids for c in alone]


def test_score_refuses_bad_input_before_any_state_changes(sess):
    with pytest.raises(InvalidRequestError, match="continuation is empty"):
        sess.score([1, 2], [])
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        sess.score([1, 2], "text")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        sess.score([1, 2], [VOCAB])
    assert sess.requests == []
    sess.add_request([1, 2, 3])
    sess.prefill()
    with pytest.raises(InvalidRequestError, match="unsampled"):
        sess.score([1, 2], [3])
