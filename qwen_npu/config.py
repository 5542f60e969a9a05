"""Frozen configuration: the model's shape (from config.json) and a Session's settings.

Both are immutable; derive a changed copy with ``dataclasses.replace``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from .errors import CheckpointError

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape of a Qwen3 checkpoint, read from its ``config.json``."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    architecture: str = "Qwen3ForCausalLM"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "config.json",
                  generation: dict | None = None) -> "ModelConfig":
        """Build from a Hugging Face config dict (RoPE as ``rope_theta`` or ``rope_parameters``)."""
        archs = d.get("architectures") or [d.get("model_type", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES and d.get("model_type") != "qwen3":
            raise CheckpointError(f"{source}: unknown architecture {arch!r}; "
                                  f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            rope = d.get("rope_parameters") or {}
            theta = d.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
            rope_type = rope.get("rope_type", (d.get("rope_scaling") or {}).get("rope_type", "default"))
            if rope_type not in ("default", None):
                raise CheckpointError(f"{source}: RoPE type {rope_type!r} is not supported (only 'default')")
            eos = _int_tuple((generation or {}).get("eos_token_id", d.get("eos_token_id")))
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                head_dim=int(d.get("head_dim") or hidden // heads),
                intermediate_size=int(d["intermediate_size"]),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                rope_theta=float(theta),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
                eos_token_ids=eos,
                bos_token_id=d.get("bos_token_id"),
                architecture=arch,
            )
        except KeyError as e:
            raise CheckpointError(f"{source}: missing field {e.args[0]!r}") from None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{cfg_file}: not found (a checkpoint folder needs config.json)")
        try:
            d = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
        gen = None
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            try:
                gen = json.loads(gen_file.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{gen_file}: not valid JSON ({e})") from None
        return cls.from_dict(d, source=str(cfg_file), generation=gen)


def _int_tuple(v) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v)
    return (int(v),)


@dataclasses.dataclass(frozen=True)
class SessionConfig:
    """A Session's settings after defaults were resolved (see ``Session.from_pretrained``)."""

    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = 16
    block_size: int = 16
    num_blocks: int = 256
    max_model_len: int = 4096
    chunk_size: int = 512
    prefix_cache: bool = True
    device_outputs: bool = True
    slot_check: str = "raise"
    decode_padding: str = "runtime"
    kernels: str = "reference"
    deterministic: bool = False     # one forward per token: results independent of batch and chunking
    sync_timings: bool = False      # end the prepare and forward phases at a device synchronisation
    mixed_steps: bool = False       # step()/generate() put decode rows and prefill chunks in one forward

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def device_outputs_default() -> bool:
    """``device_outputs=None`` resolved: the ``QWEN_NPU_DEVICE_OUTPUTS`` environment variable,
    read now (unset or anything but "0" is on). The one place that variable is read."""
    return os.environ.get("QWEN_NPU_DEVICE_OUTPUTS", "1").strip() != "0"


def sync_timings_default() -> bool:
    """``sync_timings=None`` resolved: the ``QWEN_NPU_SYNC_TIMINGS`` environment variable, read
    now ("1" is on, anything else off). The one place that variable is read."""
    return os.environ.get("QWEN_NPU_SYNC_TIMINGS", "0").strip() == "1"
