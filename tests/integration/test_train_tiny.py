"""The training script end to end on a small WordNet-format folder: a loadable, reproducible checkpoint."""
import json
import sys
from pathlib import Path

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
