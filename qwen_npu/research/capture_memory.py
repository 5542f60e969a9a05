"""What a capture will keep: bytes per position of each hook point, an estimate before a run,
and the budget check a capture makes before each step.

Per position (one token of one request row)::

    [hidden] / [heads, hd] / ... points    the tensor's elements x the model dtype
    "logits"                               vocab x 4 (float32)
    "layers.{i}.attn.scores"               heads x (position + 1) x 4 (float32, keys up to the token)

a reduction replaces that by the size of its output for one token (measured by running it once
on a zero tensor of one token); ``mean_positions()`` keeps one row per request, not per position.
Examples, bf16, every point but the scores: Qwen3-8B (36 layers, hidden 4096, 32/8 heads,
head_dim 128, intermediate 12288) keeps 4.06 MB per position (3.47 MB without resid_pre and
resid_mid, which repeat the stream), plus 0.61 MB per logits row; 16 requests of 2k tokens, 133 GB.
Qwen3-0.6B: 1.09 MB per position + 0.61 MB per logits row, 26 MiB per batch-16 decode step. The
residual stream alone: 57 KB (0.6B) / 295 KB (8B) per position; "attn.scores" at 2k keys: 3.7 MB
(0.6B) / 9.4 MB (8B) per position.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..engine.request import DECODING, PREFILLING, WAITING
from ..inspect.html import fmt_bytes


def point_shape(name: str, config, width: int = 1) -> tuple[tuple[int, ...], torch.dtype | None]:
    """(shape of one token, dtype; None = the model's) at hook point ``name``."""
    c, leaf = config, name.rsplit(".", 1)[-1]
    if name == "logits":
        return (c.vocab_size,), torch.float32
    if name.endswith(".attn.scores"):
        return (c.num_attention_heads, width), torch.float32
    if leaf in ("q", "q_pre_rope", "z"):
        return (c.num_attention_heads, c.head_dim), None
    if leaf in ("k", "v", "k_pre_rope"):
        return (c.num_key_value_heads, c.head_dim), None
    if leaf == "act":
        return (c.intermediate_size,), None
    return (c.hidden_size,), None


class PositionBytes:
    """Bytes one position of a name keeps under a capture's reduction (cached per name and width)."""

    def __init__(self, config, dtype: torch.dtype, reduce):
        self.config, self.dtype, self.reduce = config, dtype, reduce
        self._cache: dict[tuple[str, int], int] = {}

    def __call__(self, name: str, position: int = 0) -> int:
        width = position + 1 if name.endswith(".attn.scores") else 1
        key = (name, width)
        got = self._cache.get(key)
        if got is None:
            shape, dtype = point_shape(name, self.config, width)
            dtype = dtype or self.dtype
            if self.reduce is None:
                got = math.prod(shape) * dtype.itemsize
            else:
                got = self.reduce(torch.zeros((1, *shape), dtype=dtype)).nbytes
            self._cache[key] = got
        return got


@dataclasses.dataclass(frozen=True)
class CaptureEstimate:
    """What a capture would keep if every chosen request ran to its ``max_new_tokens``."""

    bytes: int
    positions: int                      # positions that would be kept (each name)
    per_name: dict[str, int]            # name -> bytes
    requests: tuple[int, ...]

    def __repr__(self) -> str:
        top = sorted(self.per_name.items(), key=lambda kv: -kv[1])[:3]
        names = ", ".join(f"{n} {fmt_bytes(b)}" for n, b in top)
        return (f"CaptureEstimate({fmt_bytes(self.bytes)} for {self.positions} positions of requests "
                f"{list(self.requests)}; largest: {names})")


def future_positions(req) -> list[int]:
    """Positions the request will still compute: the rest of its prompt (all of it while it
    waits: a capture may make it recompute a cached prefix) and its remaining new tokens."""
    last = len(req.prompt_token_ids) + req.sampling.max_new_tokens - 1     # the last token is never computed
    if req.status == WAITING:
        start = 0
    elif req.status in (PREFILLING, DECODING):
        start = req.num_computed_tokens
    else:
        return []
    return list(range(start, last))


def estimate(cap, requests) -> CaptureEstimate:
    """The bytes ``cap`` keeps for ``requests`` run to the end (see module docstring)."""
    per_name = dict.fromkeys(cap.names, 0)
    count = 0
    for req in requests:
        positions = [p for p in future_positions(req) if cap.keeps_position(req, p)]
        count += len(positions)
        for name in cap.names:
            rows = positions if name not in ("final_norm", "logits") else [
                p for p in positions if p >= len(req.prompt_token_ids) - 1]
            if cap.accumulates:
                rows = rows[:1]
            if cap.streams:
                rows = []
            per_name[name] += sum(cap.position_bytes(name, p) for p in rows)
    return CaptureEstimate(sum(per_name.values()), count, per_name, tuple(r.id for r in requests))
