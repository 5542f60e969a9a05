"""The needle test: with ``deterministic=True`` a request's bits do not depend on the batch around it.

One request (the needle) runs alone, then inside random batches of 2 to 16 other requests
(some sharing its prefix, some arriving later), with random chunk sizes, the prefix cache on or
off, mixed steps on or off, and caches small enough to preempt. Every logits row it gets and
the K/V of every position it computed (each layer, as last written) must be bitwise equal to
the lone run's, in both CPU kernel sets and both dtypes. Without ``deterministic=True`` the same
schedules give different bits (``test_without_deterministic_the_bits_differ``), so the needle
test can fail.
"""
from __future__ import annotations

import random

import pytest
import torch

from qwen_npu import SamplingParams, Session
from qwen_npu.kernels import cpu
from qwen_npu.testing import make_tiny_qwen3

VOCAB = 389            # not a multiple of 8: the products' column tails run too
NEW = 6
SCHEDULES = 6


def checkpoint(root, dtype: torch.dtype):
    return make_tiny_qwen3(root, vocab_size=VOCAB + 1, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                           head_dim=32, intermediate_size=160, tie_word_embeddings=False, seed=3, dtype=dtype)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def ckpt(request, tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp(f"needle-{request.param}"), getattr(torch, request.param))


@pytest.fixture(scope="module")
def ckpt32(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("needle-float32"), torch.float32)


def needle() -> list[int]:
    return random.Random(0).choices(range(VOCAB), k=21)


def schedule(seed: int) -> dict:
    """A random batch around the needle and the Session options it runs under."""
    rng = random.Random(seed)
    others = []
    for _ in range(rng.randint(2, 16)):
        shared = needle()[:rng.choice((0, 0, 4, 8, 12))]           # 0 or 1 to 3 of its blocks of 4
        others.append((rng.randint(0, 3), shared + rng.choices(range(VOCAB), k=rng.randint(2, 30)),
                       rng.randint(1, 9)))
    return dict(others=others, needle_at=rng.randint(0, 3), chunk_size=rng.choice((3, 5, 8, 16, 64)),
                prefix_cache=rng.random() < 0.5, mixed_steps=rng.random() < 0.5,
                num_blocks=rng.choice((12, 16, 256)))


def run(ckpt, kernels: str, plan: dict | None, *, deterministic: bool = True) -> tuple:
    """Run the needle (alone when ``plan`` is None); returns (its tokens, {output index: logits
    row}, {(layer, position): (k, v)} as last written, preemptions of any request)."""
    plan = plan or dict(others=[], needle_at=0, chunk_size=64, prefix_cache=False, mixed_steps=False,
                        num_blocks=256)
    sess = Session.from_pretrained(ckpt, device="cpu", kernels=kernels, max_batch=16, block_size=4,
                                   num_blocks=plan["num_blocks"], max_model_len=64, chunk_size=plan["chunk_size"],
                                   prefix_cache=plan["prefix_cache"], mixed_steps=plan["mixed_steps"],
                                   deterministic=deterministic)
    arrivals = sorted([(at, prompt, n) for at, prompt, n in plan["others"]] + [(plan["needle_at"], None, NEW)],
                      key=lambda a: a[0])
    arrivals = [(at - arrivals[0][0], prompt, n) for at, prompt, n in arrivals]     # someone arrives first
    mine, logits, kv, step_no = None, {}, {}, 0
    while arrivals or not all(r.is_done for r in sess.requests):
        while arrivals and arrivals[0][0] <= step_no:
            _, prompt, n = arrivals.pop(0)
            req = sess.add_request(prompt or needle(), SamplingParams(max_new_tokens=n, ignore_eos=True))
            mine = req if prompt is None else mine
        step = sess.step()
        step_no += 1
        if mine is not None and mine.id in step.logits_request_ids:
            logits[len(mine.output_token_ids) - 1] = step.logits.tensor[step.logits_request_ids.index(mine.id)].clone()
        if mine is not None and mine.status in ("prefilling", "decoding"):
            read_kv(sess, mine, kv)
    return mine.output_token_ids, logits, kv, sum(r.num_preemptions for r in sess.requests)


def read_kv(sess: Session, req, into: dict) -> None:
    bs = sess.kv.block_size
    for layer in range(sess.kv.num_layers):
        keys, values = sess.kv.key(layer), sess.kv.value(layer)
        for p in range(req.num_computed_tokens):
            b, o = req.block_table[p // bs], p % bs
            into[layer, p] = (keys[b, o].clone(), values[b, o].clone())


def differences(alone: tuple, got: tuple) -> list[str]:
    out = []
    if got[0] != alone[0]:
        out.append(f"tokens {got[0]} != {alone[0]}")
    for i in sorted(alone[1]):
        if not torch.equal(got[1].get(i, torch.empty(0)), alone[1][i]):
            out.append(f"logits of output {i}")
    for key in sorted(alone[2]):
        k, v = got[2][key]
        if not (torch.equal(k, alone[2][key][0]) and torch.equal(v, alone[2][key][1])):
            out.append(f"K/V of layer {key[0]} position {key[1]}")
    return out


KERNEL_SETS = ["reference"] + (["cpu"] if cpu.available() else [])


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_the_needle_is_bitwise_the_same_alone_and_in_any_batch(ckpt, kernels):
    alone = run(ckpt, kernels, None)
    assert len(alone[1]) == NEW and len(alone[2]) == 2 * (len(needle()) + NEW - 2)   # the last K/V is freed unread
    preempted = 0
    for seed in range(SCHEDULES):
        plan = schedule(seed)
        got = run(ckpt, kernels, plan)
        preempted += got[3]
        assert not differences(alone, got), (plan, differences(alone, got)[:5])
    assert preempted > 0, "no schedule preempted: the resume path went untested"


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_without_deterministic_the_bits_differ(ckpt32, kernels):
    """In float32, where torch's product rounds a row alone otherwise than in a batch of five or
    more (in bf16 on a CPU with native bf16 the ordinary products happen to be invariant)."""
    alone = run(ckpt32, kernels, None, deterministic=False)
    differ = [seed for seed in range(SCHEDULES) if differences(alone, run(ckpt32, kernels, schedule(seed),
                                                                               deterministic=False))]
    assert differ, "the ordinary kernels gave the lone run's bits in every schedule: the needle test proves nothing"


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_captures_are_invariant_too_the_attention_scores_included(ckpt32, kernels):
    """The attn.scores point is built outside the kernel set; a batch-invariant Session builds it
    one token at a time, so a token's scores do not depend on its chunk or neighbours."""
    names = ["layers.0.attn.scores", "layers.1.mlp.out", "logits"]

    def run_captured(chunk_size, neighbours):
        sess = Session.from_pretrained(ckpt32, device="cpu", kernels=kernels, deterministic=True, block_size=4,
                                       max_model_len=64, chunk_size=chunk_size, prefix_cache=False)
        rng = random.Random(1)
        for _ in range(neighbours):                  # older neighbours take the chunk budget first
            sess.add_request(rng.choices(range(VOCAB), k=11), SamplingParams(max_new_tokens=2, ignore_eos=True))
        mine = sess.add_request(needle(), SamplingParams(max_new_tokens=3, ignore_eos=True))
        with sess.capture(names, requests=[mine]) as cap:
            while not all(r.is_done for r in sess.requests):
                sess.step()
        return {n: cap.stack(n, mine) for n in names}

    alone, batched = run_captured(64, 0), run_captured(7, 3)
    for n in names:
        assert torch.equal(alone[n], batched[n]), n


@pytest.mark.skipif(not cpu.available() or cpu.native_bf16(),
                    reason="cpu kernels unavailable, or with native bf16 the products run in oneDNN or on "
                           "AMX tiles, whose bits may depend on the number of rows")
def test_without_deterministic_a_bf16_prompt_cut_into_chunks_keeps_its_bits_on_the_cpu_set(tmp_path):
    """In bf16 the cpu set's products (on panels) and prefill attention do not depend on how a
    prompt is cut into chunks of two or more tokens, so even without ``deterministic=True`` a
    prompt prefilled in chunks gets the logits and K/V bits of the whole prompt (float32 weights'
    products are not invariant). Attention tiles take 32 tokens here (64 query rows over 2 query
    heads per KV head): chunks of 33 and 65 tokens end in a tile of one. Wide heads and a long
    prompt give the fp32 sums enough values for a different order to show after rounding to bf16."""
    ckpt = make_tiny_qwen3(tmp_path, vocab_size=VOCAB + 1, hidden_size=128, num_hidden_layers=4,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=256,
                           seed=4, dtype=torch.bfloat16)
    prompt = random.Random(5).choices(range(VOCAB), k=230)

    def go(chunk_size: int) -> tuple:
        sess = Session.from_pretrained(ckpt, device="cpu", kernels="cpu", max_batch=4, block_size=16, num_blocks=32,
                                       max_model_len=256, chunk_size=chunk_size, prefix_cache=False)
        req = sess.add_request(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
        logits, kv = {}, {}
        while not req.is_done:
            step = sess.step()
            if req.id in step.logits_request_ids:
                logits[len(req.output_token_ids) - 1] = step.logits.tensor[step.logits_request_ids.index(req.id)].clone()
            if req.status in ("prefilling", "decoding"):
                read_kv(sess, req, kv)
        sess.close()
        return req.output_token_ids, logits, kv

    whole = go(256)
    assert len(whole[1]) == 3 and len(whole[2]) == 4 * (len(prompt) + 1)
    for chunk_size in (33, 65, 2):
        assert not differences(whole, go(chunk_size)), chunk_size
