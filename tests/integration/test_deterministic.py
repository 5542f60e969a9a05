"""deterministic=True: a request's tokens and logits do not depend on its batch or on chunking."""
import pytest
import torch

from qwen_npu import SamplingParams, Session
from qwen_npu.testing import make_tiny_qwen3

NEW = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("det"), vocab_size=512, tie_word_embeddings=False, seed=6)


def batch_prompts():
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(3, 14, (16,), generator=g).tolist()
    return [torch.randint(0, 511, (n,), generator=g).tolist() for n in lens]


def run(ckpt, prompts, target, *, chunk_size, kernels, deterministic=True):
    """Generate ``prompts`` together; returns (tokens, logits rows [NEW, vocab]) of prompts[target]."""
    sess = Session.from_pretrained(ckpt, device="cpu", kernels=kernels, max_batch=16, block_size=4,
                                   num_blocks=256, max_model_len=64, chunk_size=chunk_size,
                                   deterministic=deterministic)
    reqs = [sess.add_request(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
    mine = reqs[target]
    rows = []
    while not all(r.is_done for r in reqs):
        step = sess.step()
        if mine.id in step.logits_request_ids:
            rows.append(step.logits.tensor[step.logits_request_ids.index(mine.id)].clone())
    return mine.output_token_ids, torch.stack(rows)


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_bit_identical_alone_and_in_a_batch_of_16_with_and_without_chunking(ckpt, kernels):
    prompts = batch_prompts()
    target = 5
    alone = run(ckpt, [prompts[target]], 0, chunk_size=512, kernels=kernels)
    for label, got in [
        ("batch of 16", run(ckpt, prompts, target, chunk_size=512, kernels=kernels)),
        ("batch of 16, chunks of 4", run(ckpt, prompts, target, chunk_size=4, kernels=kernels)),
        ("alone, chunks of 3", run(ckpt, [prompts[target]], 0, chunk_size=3, kernels=kernels)),
    ]:
        assert got[0] == alone[0], label
        assert torch.equal(got[1], alone[1]), f"{label}: max |diff| {(got[1] - alone[1]).abs().max():.3e}"
    # and it computes the same model: close to the ordinary batched path
    ordinary = run(ckpt, [prompts[target]], 0, chunk_size=512, kernels=kernels, deterministic=False)
    assert torch.allclose(ordinary[1], alone[1], atol=1e-4)


def test_deterministic_mode_is_in_the_config_and_keeps_transfers(ckpt):
    prompt = batch_prompts()[0]
    out = {}
    for det in (False, True):
        sess = Session.from_pretrained(ckpt, device="cpu", kernels="reference", max_batch=4, block_size=4,
                                       num_blocks=64, max_model_len=64, deterministic=det)
        sess.generate([prompt], SamplingParams(max_new_tokens=3, ignore_eos=True), progress=False)
        assert sess.config.deterministic is det
        out[det] = [(s.kind, s.transfers["h2d"], s.transfers["d2h"]) for s in sess.history]
    # the same steps, the same one token-id copy each, and no more h2d metadata than a batched step
    assert [(k, d2h) for k, _, d2h in out[True]] == [(k, d2h) for k, _, d2h in out[False]]
    assert all(0 < a[1] <= b[1] for a, b in zip(out[True], out[False]))


def test_an_engine_refuses_a_deterministic_config_without_batch_invariant_kernels(ckpt):
    from qwen_npu.engine.engine import Engine
    from qwen_npu.session.steps import CallGate
    sess = Session.from_pretrained(ckpt, device="cpu", kernels="reference", max_batch=4, block_size=4,
                                   num_blocks=64, max_model_len=64)
    import dataclasses
    with pytest.raises(ValueError, match="BatchInvariant"):
        Engine(sess._engine.model, dataclasses.replace(sess.config, deterministic=True), CallGate())
    det = Session.from_pretrained(ckpt, device="cpu", kernels="reference", max_batch=4, block_size=4,
                                  num_blocks=64, max_model_len=64, deterministic=True)
    with pytest.raises(ValueError, match="BatchInvariant"):
        Engine(det._engine.model, sess.config, CallGate())
