"""The trained tiny Qwen3 shipped in the package: HF parity, English, an induction head, chat."""
import json

import pytest
import torch

from qwen_npu import SamplingParams, Session
from qwen_npu.testing import tiny_trained_qwen3
from test_hf_parity import DECODE_POSITIONS, PROMPT_LENS, TOL, dense_logits, paged_logits, sequences

INDUCTION_LEN = 24           # random tokens, then the same tokens again


@pytest.fixture(scope="module")
def ckpt():
    return tiny_trained_qwen3()


@pytest.fixture(scope="module")
def sess(ckpt):
    return Session.from_pretrained(ckpt, kernels="reference", block_size=4, num_blocks=128,
                                   max_model_len=256, max_batch=4)


def test_shipped_checkpoint_is_complete_and_small(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]       # grouped-query attention
    assert (ckpt / "model.safetensors").stat().st_size <= 25 * 2**20
    report = json.loads((ckpt / "training_report.json").read_text())
    loss = report["held_out_loss"]
    assert loss["trained"] < loss["unigram"] < loss["untrained"]


@pytest.mark.parametrize("block_size,chunk_size", [(1, 5), (4, 512), (16, 1)])
def test_paged_logits_match_dense_hf(ckpt, block_size, chunk_size):
    cfg = json.loads((ckpt / "config.json").read_text())
    seqs = sequences(cfg["vocab_size"], seed=3)
    ref = dense_logits(ckpt, seqs)
    got = paged_logits(ckpt, seqs, block_size, chunk_size)
    worst = 0.0
    for (rid, rows), dense, plen in zip(got.items(), ref, PROMPT_LENS):
        assert sorted(rows) == list(range(plen - 1, plen - 1 + DECODE_POSITIONS))
        worst = max(worst, max((row - dense[pos]).abs().max().item() for pos, row in rows.items()))
    assert worst <= TOL


def test_it_prefers_english_word_order(sess):
    sentences = ["the dog barked at the man", "she opened the door of the house",
                 "a large group of people", "the water in the river was cold"]
    for s in sentences:
        words = s.split()
        shuffled = " ".join(words[1:] + words[:1])
        real = sess.score("a", " " + s).total
        rotated = sess.score("a", " " + shuffled).total
        assert real > rotated + 2.0, (s, real, rotated)


def test_greedy_continuation_is_made_of_words(sess):
    out = sess.generate("the dog", SamplingParams(max_new_tokens=16, ignore_eos=True), progress=False)[0]
    words = out.text.replace(".", " ").replace(",", " ").split()
    assert len(words) >= 6
    assert sum(w.isalpha() and w.isascii() for w in words) >= 0.8 * len(words), out.text


def induction_scores(sess, req, length):
    """[layers, heads]: mean attention from each token of the repeat to the token that followed
    its first occurrence (query position p attends key p - length + 1)."""
    rows = []
    for layer in range(sess.model_config.num_hidden_layers):
        pat = sess.attention(req, layer)
        q = torch.arange(length + 1, 2 * length + 1)                  # the second copy (after a pad at 0)
        idx = torch.tensor([pat.positions.index(int(p)) for p in q])
        rows.append(pat.probs[:, idx, q - length + 1].mean(-1))
    return torch.stack(rows)


def test_an_induction_head_attends_to_the_token_after_the_earlier_copy(sess):
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(9, sess.model_config.vocab_size, (INDUCTION_LEN,), generator=g).tolist()
    req = sess.add_request([0] + seq + seq, SamplingParams(max_new_tokens=8, ignore_eos=True))
    while req.num_computed_tokens < len(req.prompt_token_ids):
        sess.step()
    scores = induction_scores(sess, req, INDUCTION_LEN)
    best = scores.max().item()
    assert best > 0.3, scores
    # the behaviour belongs to particular heads, not to attention in general
    assert scores.mean().item() < best / 2


def test_chat_answers_with_a_definition(sess):
    out = sess.generate([{"role": "user", "content": "What does dog mean?"}],
                        SamplingParams(max_new_tokens=24), progress=False)[0]
    assert out.text.startswith("dog means"), out.text
