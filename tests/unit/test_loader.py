"""load_checkpoint: tensors by Hugging Face name, validated shapes, errors naming file and tensor."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen_npu.errors import CheckpointError, InvalidRequestError
from qwen_npu.model.loader import expected_shapes, load_checkpoint
from qwen_npu.testing import make_tiny_qwen3, save_sharded

UP_1 = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture
def ckpt(tmp_path, tiny_ckpt_small_vocab):
    """A private copy of the small-vocabulary checkpoint, free to damage."""
    return shutil.copytree(tiny_ckpt_small_vocab, tmp_path / "ckpt")


def _edit_tensors(folder, edit, file="model.safetensors"):
    tensors = load_file(folder / file)
    edit(tensors)
    save_file(tensors, str(folder / file), metadata={"format": "pt"})


def _edit_json(file, edit):
    d = json.loads(file.read_text())
    edit(d)
    file.write_text(json.dumps(d))


# --- what comes back ---------------------------------------------------------------------------

def test_loads_every_expected_tensor(tiny_ckpt_small_vocab):
    cfg, sd = load_checkpoint(tiny_ckpt_small_vocab)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (512, 64, 2)
    assert cfg.eos_token_ids == (511,) and cfg.bos_token_id is None
    shapes = expected_shapes(cfg)
    assert list(sd) == list(shapes)
    stored = load_file(tiny_ckpt_small_vocab / "model.safetensors")
    for name, t in sd.items():
        assert tuple(t.shape) == shapes[name], name
        assert t.dtype == torch.float32 and t.device.type == "cpu"
        if name != "lm_head.weight":
            assert torch.equal(t, stored[name]), name


def test_real_vocab_config(tiny_ckpt):
    cfg, sd = load_checkpoint(tiny_ckpt)
    assert cfg.vocab_size == 151936 and sd["lm_head.weight"].shape == (151936, 64)
    assert cfg.eos_token_ids == (151645, 151643) and cfg.bos_token_id == 151643
    assert cfg.rope_theta == 1_000_000.0 and cfg.tie_word_embeddings


def test_expected_shapes_match_transformers(tmp_path):
    """head_dim * heads != hidden and GQA: shapes agree with the independent implementation."""
    from transformers import AutoModelForCausalLM
    path = make_tiny_qwen3(tmp_path / "odd", vocab_size=100, hidden_size=48, num_hidden_layers=3,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=32, intermediate_size=80,
                           tie_word_embeddings=False)
    cfg, sd = load_checkpoint(path)
    hf = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert expected_shapes(cfg) == {k: tuple(v.shape) for k, v in hf.items()}
    for name, t in sd.items():
        assert torch.equal(t, hf[name]), name


def test_tied_embeddings_are_one_tensor(tiny_ckpt_small_vocab):
    _, sd = load_checkpoint(tiny_ckpt_small_vocab)
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]
    _, sd = load_checkpoint(tiny_ckpt_small_vocab, dtype="bfloat16")
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]


def test_untied_lm_head_is_its_own_tensor(tmp_path):
    path = make_tiny_qwen3(tmp_path / "u", vocab_size=64, tie_word_embeddings=False)
    _, sd = load_checkpoint(path)
    assert torch.equal(sd["lm_head.weight"], load_file(path / "model.safetensors")["lm_head.weight"])
    assert not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])


def test_tied_config_with_stored_lm_head_uses_stored(ckpt):
    """As transformers 5 does: a stored lm_head that differs from the embedding is used, untied."""
    _edit_tensors(ckpt, lambda t: t.update({"lm_head.weight": torch.zeros(512, 64)}))
    _, sd = load_checkpoint(ckpt)
    assert sd["lm_head.weight"] is not sd["model.embed_tokens.weight"]
    assert not sd["lm_head.weight"].any()


def test_extra_tensors_are_left_out(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    cfg, sd = load_checkpoint(ckpt)
    assert set(sd) == set(expected_shapes(cfg))


@pytest.mark.parametrize("dtype", ["bfloat16", torch.bfloat16, "torch.bfloat16"])
def test_dtype_conversion(tiny_ckpt_small_vocab, dtype):
    _, sd32 = load_checkpoint(tiny_ckpt_small_vocab)
    _, sd16 = load_checkpoint(tiny_ckpt_small_vocab, dtype=dtype)
    for name, t in sd16.items():
        assert t.dtype == torch.bfloat16, name
        assert torch.equal(t, sd32[name].to(torch.bfloat16)), name


def test_dtype_none_is_the_checkpoints(tmp_path):
    path = make_tiny_qwen3(tmp_path / "bf", vocab_size=64, dtype=torch.bfloat16)
    cfg, sd = load_checkpoint(path)
    assert cfg.torch_dtype == "bfloat16"
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    _, sd32 = load_checkpoint(path, dtype="float32")
    assert {t.dtype for t in sd32.values()} == {torch.float32}


@pytest.mark.parametrize("dtype", ["int8", torch.int64, "fp33"])
def test_unsupported_dtype(tiny_ckpt_small_vocab, dtype):
    with pytest.raises(InvalidRequestError, match="not supported"):
        load_checkpoint(tiny_ckpt_small_vocab, dtype=dtype)


def test_sharded_equals_single_file(tmp_path, tiny_ckpt_small_vocab):
    sharded = save_sharded(tiny_ckpt_small_vocab, tmp_path / "sharded", max_shard_tensors=4)
    cfg1, single = load_checkpoint(tiny_ckpt_small_vocab)
    cfg2, multi = load_checkpoint(sharded)
    assert cfg1 == cfg2
    assert list(single) == list(multi)
    for name in single:
        assert torch.equal(single[name], multi[name]), name
    assert multi["lm_head.weight"] is multi["model.embed_tokens.weight"]


@pytest.mark.parametrize("drop", ["rope_theta", "rope_parameters"])
def test_rope_given_one_way_parses(ckpt, drop):
    def edit(d):
        d["rope_theta"] = 5e5
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
        del d[drop]
    _edit_json(ckpt / "config.json", edit)
    cfg, _ = load_checkpoint(ckpt)
    assert cfg.rope_theta == 5e5
    from transformers import AutoConfig  # the oracle reads it the same way
    assert AutoConfig.from_pretrained(ckpt).rope_parameters["rope_theta"] == 5e5


# --- errors name the file and the tensor -------------------------------------------------------

def test_missing_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop(UP_1))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: missing tensor '{UP_1}'") as e:
        load_checkpoint(ckpt)
    assert str(ckpt) in str(e.value)


def test_untied_missing_lm_head(ckpt):
    _edit_json(ckpt / "config.json", lambda d: d.update(tie_word_embeddings=False))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing tensor 'lm_head\.weight'.*tie_word"):
        load_checkpoint(ckpt)


def test_wrong_shape(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({UP_1: torch.zeros(127, 64)}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{UP_1}' has shape \[127, 64\], "
                                              r"expected \[128, 64\]"):
        load_checkpoint(ckpt)


def test_unknown_architecture(ckpt):
    _edit_json(ckpt / "config.json", lambda d: d.update(architectures=["LlamaForCausalLM"], model_type="llama"))
    with pytest.raises(CheckpointError, match=r"config\.json: unknown architecture 'LlamaForCausalLM'"):
        load_checkpoint(ckpt)


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        load_checkpoint(ckpt)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="nope: not a checkpoint folder"):
        load_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize("keep", [0, 7, 100, -16])
def test_truncated_file(ckpt, keep):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_checkpoint(ckpt)


def test_corrupt_header(ckpt):
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[8:16] = b"\xff" * 8                                     # break the JSON header
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_checkpoint(ckpt)


def test_pickle_only_checkpoint_is_refused(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: only safetensors checkpoints are supported"):
        load_checkpoint(ckpt)


def test_no_weights_at_all(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_checkpoint(ckpt)


@pytest.fixture
def sharded(tmp_path, tiny_ckpt_small_vocab):
    return save_sharded(tiny_ckpt_small_vocab, tmp_path / "sharded", max_shard_tensors=10)


def test_index_names_missing_shard(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][UP_1]
    (sharded / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"model\.safetensors\.index\.json: shard '{shard}' "
                                              r"\(holding tensor '.+'\) not found"):
        load_checkpoint(sharded)


def test_tensor_missing_from_index(sharded):
    _edit_json(sharded / "model.safetensors.index.json", lambda d: d["weight_map"].pop(UP_1))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors\.index\.json: missing tensor '{UP_1}'"):
        load_checkpoint(sharded)


def test_tensor_listed_but_not_in_shard(sharded):
    shard = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"][UP_1]
    _edit_tensors(sharded, lambda t: t.pop(UP_1), file=shard)
    with pytest.raises(CheckpointError, match=rf"{shard}: missing tensor '{UP_1}'"):
        load_checkpoint(sharded)


def test_truncated_shard(sharded):
    shard = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"][UP_1]
    data = (sharded / shard).read_bytes()
    (sharded / shard).write_bytes(data[:-4])
    with pytest.raises(CheckpointError, match=rf"{shard}: not a readable safetensors file"):
        load_checkpoint(sharded)


def test_invalid_index(sharded):
    (sharded / "model.safetensors.index.json").write_text("{\"metadata\": {}}")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not a valid safetensors index"):
        load_checkpoint(sharded)
