"""The trained tiny Qwen3 shipped in the package: HF parity, English, attention heads, chat."""
import json

import pytest
import torch
from test_hf_parity import DECODE_POSITIONS, PROMPT_LENS, TOL, dense_logits, paged_logits, sequences

from qwen_npu import SamplingParams, Session
from qwen_npu.testing import tiny_trained_qwen3

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
        backwards = " ".join(reversed(s.split()))
        real = sess.score("a", " " + s).total
        reversed_ = sess.score("a", " " + backwards).total
        assert real > reversed_ + 5.0, (s, real, reversed_)


def test_greedy_continuation_is_made_of_words(sess):
    out = sess.generate("music means", SamplingParams(max_new_tokens=16, ignore_eos=True), progress=False)[0]
    words = out.text.replace(".", " ").replace(",", " ").split()
    assert len(words) >= 6
    assert sum(w.isalpha() and w.isascii() for w in words) >= 0.8 * len(words), out.text


def head_scores(sess, req, length):
    """Per layer and head, over the second copy of a repeated sequence (query position p):
    mean attention to the previous token (key p - 1) and to the token that followed the first
    occurrence of p's token (key p - length + 1, the induction target)."""
    q = torch.arange(length + 1, 2 * length + 1)                      # after a pad token at 0
    prev, induction = [], []
    for layer in range(sess.model_config.num_hidden_layers):
        pat = sess.attention(req, layer)
        assert pat.positions == tuple(range(2 * length + 1))
        prev.append(pat.probs[:, q, q - 1].mean(-1))
        induction.append(pat.probs[:, q, q - length + 1].mean(-1))
    return torch.stack(prev), torch.stack(induction)


def test_previous_token_and_induction_heads_are_found_through_the_paged_cache(sess):
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(9, sess.model_config.vocab_size, (INDUCTION_LEN,), generator=g).tolist()
    req = sess.add_request([0] + seq + seq, SamplingParams(max_new_tokens=8, ignore_eos=True))
    while req.num_computed_tokens < len(req.prompt_token_ids):
        sess.step()
    prev, induction = head_scores(sess, req, INDUCTION_LEN)
    uniform = 1 / (1.5 * INDUCTION_LEN)
    assert prev.max().item() > 5 * uniform, prev          # a head that looks at the previous token
    assert induction.max().item() > 0.3, induction        # one that looks at what followed last time
    assert induction.max().item() > 10 * uniform
    layer = divmod(int(induction.argmax()), induction.shape[1])[0]
    assert prev[:layer].max().item() > 5 * uniform        # fed by previous-token heads below it
    sess.abort(req)
    # and it copies: the second copy is far more likely than the first
    first = sess.score([0], seq).logprobs[1:]
    second = sess.score([0] + seq, seq).logprobs[1:]
    assert sum(second) / len(second) > sum(first) / len(first) + 0.5


def test_chat_answers_with_a_definition(sess):
    out = sess.generate([{"role": "user", "content": "What does dog mean?"}],
                        SamplingParams(max_new_tokens=24), progress=False)[0]
    word, sep, rest = out.text.partition(" means ")       # the definition format it was trained on
    assert sep and word.isalpha() and len(rest.split()) >= 3, out.text
