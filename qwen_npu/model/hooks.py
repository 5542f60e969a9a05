"""The forward's hook points and what a hook offers the forward.

A hook sees (name, tensor) at a named point of the forward and returns a tensor to use
instead, or None to keep it. The points, in the order a layer reaches them (see
``capture_names``; "tokens" = the step's tokens, "rows_out" = the rows that get logits)::

  embed                     [tokens, hidden]         token embeddings
  layers.{i}.resid_pre      [tokens, hidden]         the residual stream entering the layer
  layers.{i}.attn.in        [tokens, hidden]         input_layernorm output (what q/k/v project)
  layers.{i}.attn.q_pre_rope [tokens, heads, hd]     after q_norm, before RoPE
  layers.{i}.attn.k_pre_rope [tokens, kv_heads, hd]  after k_norm, before RoPE
  layers.{i}.attn.q         [tokens, heads, hd]      after RoPE: what attention sees
  layers.{i}.attn.k         [tokens, kv_heads, hd]   after RoPE: what is written to the cache
  layers.{i}.attn.v         [tokens, kv_heads, hd]   what is written to the cache
  layers.{i}.attn.scores    [tokens, heads, keys]    q.k * scale before softmax (float32), keys
                                                     0..the step's longest row; -inf where masked
  layers.{i}.attn.z         [tokens, heads, hd]      attention output per head, before o_proj
  layers.{i}.attn.out       [tokens, hidden]         after o_proj
  layers.{i}.resid_mid      [tokens, hidden]         the stream after the attention's residual add
  layers.{i}.mlp.in         [tokens, hidden]         post_attention_layernorm output
  layers.{i}.mlp.act        [tokens, intermediate]   silu(gate) * up, before down_proj
  layers.{i}.mlp.out        [tokens, hidden]         after down_proj
  layers.{i}.residual       [tokens, hidden]         the residual stream after the layer
  final_norm                [rows_out, hidden]       the final norm of the rows that get logits
  logits                    [rows_out, vocab]        float32 logits of those rows

The forward calls a hook only at the points it ``wants``. With a hook the residual stream is
materialised after every layer (x + residual, then a zero x); the sum is the one the fused
add_rms_norm would form, so the numbers do not change. "resid_pre" and "resid_mid" are the
residual add_rms_norm returns; an edit there re-runs the norm on the edited stream.
"attn.scores" is built only when the hook wants it, and is read only (what the hook returns for
it is not used).

The forward makes one call per point on its tap (``qwen3.py``): a hook bound for one forward,
or, without a hook, a tap that hands every tensor back unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

ATTN_POINTS = ("in", "q_pre_rope", "k_pre_rope", "q", "k", "v", "scores", "z", "out")
MLP_POINTS = ("in", "act", "out")


class ForwardHook(Protocol):
    """What the forward calls at its hook points."""

    def wants(self, name: str) -> bool:
        """Does the hook look at ``name``? The forward skips every other point."""

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """The tensor to go on with instead of ``x`` (same shape), or None to keep ``x``."""


def capture_names(num_layers: int) -> list[str]:
    """Every hook point of the forward, in the order they are reached."""
    names = ["embed"]
    for i in range(num_layers):
        names += [f"layers.{i}.resid_pre"] + [f"layers.{i}.attn.{p}" for p in ATTN_POINTS]
        names += [f"layers.{i}.resid_mid"] + [f"layers.{i}.mlp.{p}" for p in MLP_POINTS] + [f"layers.{i}.residual"]
    return names + ["final_norm", "logits"]


@dataclasses.dataclass(frozen=True)
class LayerPoints:
    """The hook names of one layer, formed once (a forward without a hook formats no string)."""

    resid_pre: str
    attn_in: str
    q_pre_rope: str
    k_pre_rope: str
    q: str
    k: str
    v: str
    scores: str
    z: str
    attn_out: str
    resid_mid: str
    mlp_in: str
    mlp_act: str
    mlp_out: str
    residual: str

    @classmethod
    def of_layer(cls, i: int) -> LayerPoints:
        p = f"layers.{i}."
        return cls(p + "resid_pre", *(p + "attn." + n for n in ATTN_POINTS), p + "resid_mid",
                   *(p + "mlp." + n for n in MLP_POINTS), p + "residual")
