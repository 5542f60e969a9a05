"""The training script end to end on a small WordNet-format folder: a loadable, reproducible checkpoint."""
import json
import sys
from pathlib import Path

import pytest
import torch

from qwen_npu import SamplingParams, Session
from qwen_npu.train.model import TinyShape
from qwen_npu.train.tokenizer import SPECIAL_TOKENS
from qwen_npu.train.trainer import TrainConfig, train_tiny

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_train_corpus import write_wordnet

SHAPE = TinyShape(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128)
CFG = TrainConfig(seed=7, steps=4, batch_size=2, seq_len=32, warmup_steps=2, eval_windows=4, shape=SHAPE)


def test_train_tiny_writes_a_checkpoint_both_loaders_read(tmp_path):
    root = write_wordnet(tmp_path / "wn")
    logs = []
    report = train_tiny(root, tmp_path / "a", CFG, log=logs.append)
    again = train_tiny(root, tmp_path / "b", CFG, log=lambda s: None)
    out = tmp_path / "a"

    # same seed, same bytes
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (out / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert report["held_out_loss"] == again["held_out_loss"]
    assert report["parameters"] == sum(p.numel() for p in _hf(out).parameters())
    assert set(report["held_out_loss"]) == {"trained", "untrained", "unigram"}
    heads = report["heads"]
    assert 0 <= heads["induction"]["layer"] < 2 and 0 <= heads["induction"]["head"] < 4
    assert 0 < heads["induction"]["score"] <= 1 and 0 < heads["previous_token"]["score"] <= 1
    assert any(line.startswith("step     3") for line in logs)
    card = (out / "README.md").read_text()
    assert "Princeton University" in card and f"{report['held_out_loss']['trained']:.3f}" in card

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 320 and cfg["tie_word_embeddings"] is True
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and "<|im_start|>" in tok_cfg["chat_template"]
    ids = {v["content"]: int(k) for k, v in tok_cfg["added_tokens_decoder"].items()}
    assert ids == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]

    # our loader, with its tokenizer and chat path, and transformers agree on the logits
    sess = Session.from_pretrained(out, kernels="reference", max_model_len=64, num_blocks=32, block_size=4)
    text = sess.generate("the word1 3", SamplingParams(max_new_tokens=5, ignore_eos=True), progress=False)[0]
    assert len(text.token_ids) == 5
    chat = sess.generate([{"role": "user", "content": "What does word2_5 mean?"}],
                         SamplingParams(max_new_tokens=3, ignore_eos=True), progress=False)[0]
    prompt = sess.tokenizer.decode(chat.prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = torch.tensor([sess.tokenizer.encode("the word3 is a thing number 7 of kind 3")])
    scored = sess.score(ids[0, :3].tolist(), ids[0, 3:].tolist())
    with torch.no_grad():
        dense = torch.log_softmax(_hf(out)(ids).logits[0].float(), -1)
    want = dense[2:-1].gather(1, ids[0, 3:, None])[:, 0]
    assert torch.allclose(torch.tensor(scored.logprobs), want, atol=1e-4)


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_a_second_stage_continues_from_a_checkpoint_with_copy_rows(tmp_path):
    root = write_wordnet(tmp_path / "wn")
    first = train_tiny(root, tmp_path / "a", CFG, log=lambda s: None)
    cfg = TrainConfig(seed=7, steps=3, batch_size=2, seq_len=32, warmup_steps=1, eval_windows=4, shape=SHAPE,
                      copy_rows=1, copy_len=(4, 8), init=str(tmp_path / "a"))
    logs = []
    second = train_tiny(root, tmp_path / "b", cfg, log=logs.append)
    # the same tokenizer, new weights, the first stage's figures kept
    assert (tmp_path / "b" / "tokenizer.json").read_bytes() == (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert (tmp_path / "b" / "model.safetensors").read_bytes() != (tmp_path / "a" / "model.safetensors").read_bytes()
    assert second["stages"] == [json.loads((tmp_path / "a" / "training_report.json").read_text())]
    assert second["held_out_loss"]["untrained"] == first["held_out_loss"]["untrained"]
    assert second["held_out_loss"]["start_of_stage"] == pytest.approx(first["held_out_loss"]["trained"], abs=1e-5)
    assert second["train_seconds_all_stages"] == pytest.approx(first["train_seconds"] + second["train_seconds"], abs=0.2)
    assert any("held-out loss at the start" in line for line in logs)
    card = (tmp_path / "b" / "README.md").read_text()
    assert "1. seed 7, 4 steps of 2 x 32 tokens, peak" in card
    assert "2. seed 7, 3 steps of 2 x 32 tokens, 1 of them copy rows" in card
    assert f"score {second['heads']['induction']['score']:.2f}" in card
    third = train_tiny(root, tmp_path / "c", cfg, log=lambda s: None)
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert third["held_out_loss"] == second["held_out_loss"]


class _PlantedHeads(torch.nn.Module):
    """Stands in for a causal LM with 2 layers x 3 heads: layer 1 head 2 attends from every token
    to the one after the previous occurrence of the same token, layer 0 head 1 to the previous
    token, the rest uniformly; the logits copy the induction target."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.config = type("Config", (), {"_attn_implementation": "sdpa"})()
        self.calls = []

    def set_attn_implementation(self, name):
        self.config._attn_implementation = name

    def forward(self, input_ids, output_attentions=False):
        self.calls.append((self.config._attn_implementation, self.training, output_attentions))
        ids = input_ids[0].tolist()
        n = len(ids)
        att = torch.tril(torch.ones(2, 3, n, n))
        att = att / att.sum(-1, keepdim=True)
        logits = torch.zeros(1, n, self.vocab)
        for q in range(1, n):
            att[0, 1, q] = 0
            att[0, 1, q, q - 1] = 1
            earlier = [j for j in range(q) if ids[j] == ids[q]]
            if earlier:
                att[1, 2, q] = 0
                att[1, 2, q, earlier[-1] + 1] = 1
                logits[0, q, ids[earlier[-1] + 1]] = 20.0
        return type("Out", (), {"attentions": tuple(a[None] for a in att), "logits": logits})()


def test_induction_probe_finds_the_copying_head_and_restores_the_model():
    from qwen_npu.train.evaluate import induction
    model = _PlantedHeads(4096).train()
    got = induction(model, pad_id=0, first_id=9, vocab_size=4096, length=12, probes=2)
    assert got["induction"] == {"layer": 1, "head": 2, "score": pytest.approx(1.0, abs=0.1)}
    assert got["previous_token"] == {"layer": 0, "head": 1, "score": 1.0}
    assert got["logprob_second_copy"] > -0.01 > got["logprob_first_copy"]      # copied the second time
    assert model.calls and all(c == ("eager", False, True) for c in model.calls)
    assert model.training and model.config._attn_implementation == "sdpa"     # put back as it was


def test_an_interrupted_write_leaves_the_checkpoint_folder_as_it_was(tmp_path, monkeypatch):
    from qwen_npu.train import trainer
    root = write_wordnet(tmp_path / "wn")
    out = tmp_path / "ckpt"
    train_tiny(root, out, CFG, log=lambda s: None)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(trainer, "write_model_card", interrupted)   # the last file written
    with pytest.raises(KeyboardInterrupt):
        train_tiny(root, out, TrainConfig(**{**CFG.__dict__, "seed": 8}), log=lambda s: None)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "wn"]       # no partial folder left
