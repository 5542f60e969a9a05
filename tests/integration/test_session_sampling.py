"""On-device sampling: seeds make a request's samples independent of its batch; no host sync."""
import pytest
import torch
from torch.overrides import TorchFunctionMode

from qwen_npu import SamplingParams
from qwen_npu.engine import sampler
from session_kit import greedy, open_session, prompts

NEW_TOKENS = 10
PROMPT = prompts((6,), seed=5)[0]
SEEDED = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=1234, ignore_eos=True)
OTHERS = [
    SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.7, seed=1, ignore_eos=True),
    SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.3, top_k=50, seed=2, ignore_eos=True),
    SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, ignore_eos=True),
    SamplingParams(max_new_tokens=5, ignore_eos=True),
    SamplingParams(max_new_tokens=NEW_TOKENS, temperature=2.0, top_k=10, top_p=0.5, seed=3, ignore_eos=True),
    SamplingParams(max_new_tokens=3, temperature=1.0, seed=1234, ignore_eos=True),
    SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.5, ignore_eos=True),
]


def run_alone(path, sampling, prompt=PROMPT):
    sess = open_session(path)
    return list(sess.generate([prompt], sampling, progress=False)[0].token_ids)


def test_seed_reproduces_alone_and_in_a_batch_of_eight(tiny_ckpt_small_vocab):
    alone = run_alone(tiny_ckpt_small_vocab, SEEDED)
    assert len(alone) == NEW_TOKENS
    assert run_alone(tiny_ckpt_small_vocab, SEEDED) == alone

    sess = open_session(tiny_ckpt_small_vocab, max_batch=8)
    others = prompts([3 + i for i in range(len(OTHERS))], seed=9)
    batch_prompts = others[:3] + [PROMPT] + others[3:]
    batch_params = OTHERS[:3] + [SEEDED] + OTHERS[3:]
    outs = sess.generate(batch_prompts, batch_params, progress=False)
    assert len(outs) == 8
    decodes = [s for s in sess.history if s.kind == "decode"]
    assert max(s.batch_size for s in decodes) == 8, "the seeded request did not share its batch"
    assert list(outs[3].token_ids) == alone


def test_different_seeds_differ(tiny_ckpt_small_vocab):
    streams = {seed: run_alone(tiny_ckpt_small_vocab, SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=1.0, seed=seed, ignore_eos=True)) for seed in (1, 2, 3)}
    assert len({tuple(s) for s in streams.values()}) == 3, streams


def test_unseeded_requests_differ_from_each_other(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab)
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)
    a, b = sess.generate([PROMPT, PROMPT], sp, progress=False)
    assert a.token_ids != b.token_ids


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5)],
                         ids=["top_k=1", "tiny top_p", "both"])
def test_degenerate_filters_equal_greedy(tiny_ckpt_small_vocab, params):
    ref = run_alone(tiny_ckpt_small_vocab, greedy(NEW_TOKENS))
    got = run_alone(tiny_ckpt_small_vocab, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.5, seed=7,
                                                          ignore_eos=True, **params))
    assert got == ref


def test_sampled_tokens_respect_top_k():
    """Over many draws from flat logits, only the top-k tokens (by logit) are ever picked."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 64, generator=g) * 0.01                     # nearly flat
    allowed = set(logits[0].topk(5).indices.tolist())
    picked = set()
    gen = sampler.new_generator(torch.device("cpu"), 11)
    for _ in range(200):
        ids, _ = sampler.sample(logits, [SamplingParams(temperature=1.0, top_k=5)], [gen])
        picked.add(int(ids[0]))
    assert picked <= allowed and len(picked) > 1


class NoHostSync(TorchFunctionMode):
    """Fails on every tensor operation that makes the host wait for the device."""

    SYNCS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.SYNCS:
            raise AssertionError(f"host sync inside the sampler: Tensor.{name}")
        return func(*args, **(kwargs or {}))


def test_no_host_sync_guard_catches_syncs():
    x = torch.ones(2)
    for sync in (lambda: x[0].item(), lambda: x.tolist(), lambda: x.cpu(), lambda: bool(x[0]),
                 lambda: x.numpy()):
        with NoHostSync(), pytest.raises(AssertionError, match="host sync"):
            sync()


def test_sampler_makes_no_host_sync():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 512, generator=g)                            # [rows, vocab]
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_k=20),
              SamplingParams(temperature=1.2, top_p=0.7), SamplingParams(temperature=0.9, top_k=5, top_p=0.9)]
    gens = [None] + [sampler.new_generator(logits.device, s) for s in range(1, 5)]
    with NoHostSync():
        ids, h2d = sampler.sample(logits, params, gens)
        only_greedy, _ = sampler.sample(logits, [SamplingParams()] * 5, [None] * 5)
    assert ids.shape == (5,) and ids.device == logits.device
    assert ids[0] == logits[0].argmax()
    assert torch.equal(only_greedy, logits.argmax(-1))
    assert h2d > 0
