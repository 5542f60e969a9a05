"""Frozen configuration: the model's shape (from config.json) and a Session's settings.

Both are immutable; derive a changed copy with ``dataclasses.replace``.
"""
from __future__ import annotations

import dataclasses
import json
import math
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
                  generation: dict | None = None, generation_source: str = "generation_config.json") -> ModelConfig:
        """Build from a Hugging Face config dict (RoPE as ``rope_theta`` or ``rope_parameters``).
        Every field is checked: CheckpointError naming ``source`` (or ``generation_source`` for
        the eos ids it gives), the field and its value."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: must hold a JSON object, not {type(d).__name__}")
        archs = d.get("architectures") or [d.get("model_type", "?")]
        arch = archs[0] if isinstance(archs, list) else archs
        if arch not in SUPPORTED_ARCHITECTURES and d.get("model_type") != "qwen3":
            raise CheckpointError(f"{source}: unknown architecture {arch!r}; "
                                  f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        f = _Fields(d, source)
        heads = f.count("num_attention_heads")
        hidden = f.count("hidden_size")
        kv_heads = f.count("num_key_value_heads", heads)
        if heads % kv_heads:
            raise CheckpointError(f"{source}: num_attention_heads={heads} is not a multiple of "
                                  f"num_key_value_heads={kv_heads}")
        rope = d.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise CheckpointError(f"{source}: field 'rope_parameters' must be an object, not {rope!r}")
        rope_type = rope.get("rope_type", (d.get("rope_scaling") or {}).get("rope_type", "default"))
        if rope_type not in ("default", None):
            raise CheckpointError(f"{source}: RoPE type {rope_type!r} is not supported (only 'default')")
        gen = generation or {}
        if not isinstance(gen, dict):
            raise CheckpointError(f"{generation_source}: must hold a JSON object, not {type(gen).__name__}")
        eos_from = (_Fields(gen, generation_source) if "eos_token_id" in gen else f)
        bos = d.get("bos_token_id")
        if bos is not None:
            bos = f.count("bos_token_id", minimum=0)
        return cls(
            vocab_size=f.count("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=f.count("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=(f.count("head_dim") if d.get("head_dim") is not None
                      else _derived_head_dim(hidden, heads, source)),
            intermediate_size=f.count("intermediate_size"),
            max_position_embeddings=f.count("max_position_embeddings", 32768),
            rope_theta=f.positive("rope_theta", rope.get("rope_theta", 1_000_000.0)),
            rms_norm_eps=f.positive("rms_norm_eps", 1e-6),
            tie_word_embeddings=f.flag("tie_word_embeddings", False),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            eos_token_ids=eos_from.ids("eos_token_id"),
            bos_token_id=bos,
            architecture=arch,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
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
        return cls.from_dict(d, source=str(cfg_file), generation=gen, generation_source=str(gen_file))


class _Fields:
    """Typed reads of one JSON object's fields; each refusal names the file, the field and the value."""

    def __init__(self, d: dict, source: str):
        self.d, self.source = d, source

    def _bad(self, name: str, why: str):
        raise CheckpointError(f"{self.source}: field {name!r} is {self.d[name]!r}; {why}")

    def count(self, name: str, default: int | None = None, *, minimum: int = 1) -> int:
        if name not in self.d or (self.d[name] is None and default is not None):
            if default is None:
                raise CheckpointError(f"{self.source}: missing field {name!r}")
            return default
        v = self.d[name]
        if not _is_int(v) or v < minimum:
            self._bad(name, f"it must be an int >= {minimum}")
        return int(v)

    def positive(self, name: str, default: float) -> float:
        v = self.d.get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            self._bad(name, "it must be a finite number > 0")
        return float(v)

    def flag(self, name: str, default: bool) -> bool:
        v = self.d.get(name, default)
        if not isinstance(v, bool):
            self._bad(name, "it must be true or false")
        return v

    def ids(self, name: str) -> tuple[int, ...]:
        v = self.d.get(name)
        if v is None:
            return ()
        items = v if isinstance(v, list) else [v]
        if not all(_is_int(t) and t >= 0 for t in items):
            self._bad(name, "it must be a token id (an int >= 0) or a list of them")
        return tuple(int(t) for t in items)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _derived_head_dim(hidden: int, heads: int, source: str) -> int:
    if hidden % heads:
        raise CheckpointError(f"{source}: no 'head_dim', and hidden_size={hidden} is not a multiple of "
                              f"num_attention_heads={heads}")
    return hidden // heads


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
    deterministic: bool = False     # batch-invariant kernels: results independent of batch and chunking
    sync_timings: bool = False      # end the prepare and forward phases at a device synchronisation
    mixed_steps: bool = False       # step()/generate() put decode rows and prefill chunks in one forward
    speculative: str | None = None  # the drafter of speculative decoding ("ngram"), or None
    num_speculative_tokens: int = 0  # drafts per decode row (0 without speculative)
    tensor_parallel_size: int = 1   # ranks the model is split over (``parallel/``)

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
