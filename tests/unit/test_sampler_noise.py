"""The sampler's noise: every 32-bit hash gives finite, positive Exp(1) noise, and a token of
probability 0 (outside top-k, top-p or a stop mask) is never sampled."""
from __future__ import annotations

import torch

from qwen_npu import SamplingParams
from qwen_npu.engine import sampler

TOP = 2 ** 32


def test_every_hash_at_both_ends_of_the_range_gives_finite_positive_noise():
    ends = torch.cat([torch.arange(0, 2 ** 20), torch.arange(TOP - 2 ** 20, TOP)])
    q = sampler.exp1(ends)
    assert torch.isfinite(q).all() and (q > 0).all()
    assert q.min() < 1e-9 and q.max() > 16                  # resolution at both ends
    assert (q[1:2 ** 20] > q[:2 ** 20 - 1]).all()           # distinct near 0: no two small hashes collide


def test_noise_is_exp1_distributed():
    h = torch.randint(0, TOP, (1 << 20,), generator=torch.Generator().manual_seed(3))
    q = sampler.exp1(h).double()
    assert abs(q.mean().item() - 1.0) < 0.01 and abs(q.var().item() - 1.0) < 0.02
    for t in (0.1, 1.0, 3.0):                                # P(q > t) = exp(-t)
        assert abs((q > t).double().mean().item() - torch.exp(torch.tensor(-t)).item()) < 0.004


def test_tokens_of_probability_zero_are_never_sampled():
    """With Qwen3's vocabulary a noise value of zero would pick a masked token in about 1% of rows;
    none of 768 seeded rows may leave its top 5 (or its temperature-underflow support)."""
    vocab, rows = 151936, 32
    gen = torch.Generator().manual_seed(11)
    params = [SamplingParams(temperature=1.0, top_k=5) for _ in range(rows // 2)]
    params += [SamplingParams(temperature=0.02) for _ in range(rows // 2)]
    for batch in range(24):
        logits = torch.randn(rows, vocab, generator=gen) * 3
        gens = [sampler.new_generator(torch.device("cpu"), batch * rows + r) for r in range(rows)]
        ids, _ = sampler.sample(logits, params, gens)
        top5 = logits[: rows // 2].topk(5, dim=-1).indices
        assert (top5 == ids[: rows // 2, None]).any(dim=-1).all(), f"batch {batch}: a token outside the top 5"
        probs = torch.softmax(logits[rows // 2:] / 0.02, dim=-1)
        assert (probs.gather(1, ids[rows // 2:, None]) > 0).all(), f"batch {batch}: a token of probability 0"


def test_a_row_samples_the_same_token_whatever_rows_share_its_batch():
    """Greedy rows make no noise and sampled rows are computed on their own: each row's token is
    the one it draws alone, in batches of sampled and greedy rows in any order."""
    vocab = 997
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, vocab, generator=gen) * 2
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=40),
              SamplingParams(temperature=1.3, top_p=0.9), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=3, top_p=0.7)]

    def gens(rows):
        return [None if params[r].temperature == 0 else sampler.new_generator(torch.device("cpu"), 40 + r)
                for r in rows]
    alone = [sampler.sample(logits[r:r + 1], [params[r]], gens([r]))[0].item() for r in range(6)]
    assert alone[0] == logits[0].argmax().item() and alone[3] == logits[3].argmax().item()
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1], [1, 2, 4], [4, 0], [3, 0]):
        ids, h2d = sampler.sample(logits[order], [params[r] for r in order], gens(order))
        assert ids.tolist() == [alone[r] for r in order], order
        assert (h2d == 0) == all(params[r].temperature == 0 for r in order)


def test_noise_is_made_for_the_sampled_rows_only(monkeypatch):
    made = []
    real = sampler.exponential_noise

    def counted(keys, vocab):
        made.append(keys.shape[0])
        return real(keys, vocab)
    monkeypatch.setattr(sampler, "exponential_noise", counted)
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0)] * 5 + [SamplingParams(temperature=1.0)] * 3
    gens = [None] * 5 + [sampler.new_generator(torch.device("cpu"), s) for s in range(3)]
    ids, _ = sampler.sample(logits, params, gens)
    assert made == [3]
    assert ids[:5].tolist() == logits[:5].argmax(-1).tolist()
