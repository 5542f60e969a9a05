"""The shape of the small trained Qwen3 and its conversion to a checkpoint folder.

Training runs on ``transformers``' own ``Qwen3ForCausalLM`` in float32, so the module structure is
Qwen3's by construction: q/k RMSNorm, grouped-query attention, RoPE, SwiGLU MLP, tied embeddings.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TinyShape:
    vocab_size: int = 4096
    hidden_size: int = 192
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 48
    intermediate_size: int = 512
    max_position_embeddings: int = 1024
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6


def config_dict(shape: TinyShape, *, pad_id: int, eos_id: int) -> dict:
    """``config.json`` for ``shape`` (tied embeddings, float32), every field explicit."""
    from ..testing import qwen3_config
    return qwen3_config(**asdict(shape), tie_word_embeddings=True, bos_token_id=None,
                        eos_token_id=eos_id, pad_token_id=pad_id, dtype=torch.float32)


def build_model(config: dict, seed: int):
    """A freshly initialised ``transformers`` ``Qwen3ForCausalLM`` (float32, seeded)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**config)).float()
    return model


def load_model(path: str | Path):
    """(the ``Qwen3ForCausalLM`` saved at ``path`` in float32, its ``config.json`` as a dict)."""
    from transformers import Qwen3ForCausalLM
    model = Qwen3ForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model, json.loads((Path(path) / "config.json").read_text())


def num_parameters(model) -> int:
    """Distinct parameters (the tied embedding counted once)."""
    return sum(p.numel() for p in model.parameters())


def save_checkpoint(model, config: dict, path: str | Path, *, eos_ids: list[int], pad_id: int) -> Path:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` (HF tensor names;
    ``lm_head.weight`` left out because it is the tied embedding)."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float32).contiguous().clone()
             for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": None, "eos_token_id": eos_ids, "pad_token_id": pad_id}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return path
