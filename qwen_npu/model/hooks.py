"""The forward's hook points, what a hook offers the forward, and the tap the forward calls.

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

The forward makes one call per point on a tap: ``Tap`` (a hook bound for one forward) or
``NO_TAP`` (no hook: every call hands its tensors back unchanged).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
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


class Tap:
    """A ``ForwardHook`` bound for one forward; ``rms_norm`` and ``eps`` re-run a norm after an
    edit of the residual stream."""

    __slots__ = ("eps", "hook", "rms_norm")

    def __init__(self, hook: ForwardHook, rms_norm: Callable, eps: float):
        self.hook, self.rms_norm, self.eps = hook, rms_norm, eps

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The tensor the forward goes on with at ``name``."""
        if not self.hook.wants(name):
            return x
        y = self.hook(name, x)
        return x if y is None else y

    def stream(self, name: str, residual: torch.Tensor, h: torch.Tensor,
               weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual, its norm) after the hook at a residual-stream point; an edit re-runs the norm."""
        if not self.hook.wants(name):
            return residual, h
        y = self.hook(name, residual)
        if y is None:
            return residual, h
        return y, self.rms_norm(y, weight, self.eps)

    def read(self, name: str, build: Callable[..., torch.Tensor], *args) -> None:
        """Show ``build(*args)`` at ``name``, built only when wanted; read only."""
        if self.hook.wants(name):
            self.hook(name, build(*args))

    def residual(self, name: str, x: torch.Tensor,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) after a layer: the stream materialised (a zero x, x + residual) and shown."""
        return torch.zeros_like(x), self(name, x + residual)


class NoTap:
    """The tap of a forward without a hook: every call returns its tensors unchanged."""

    __slots__ = ()

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x

    def stream(self, name: str, residual: torch.Tensor, h: torch.Tensor,
               weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return residual, h

    def read(self, name: str, build: Callable[..., torch.Tensor], *args) -> None:
        return None

    def residual(self, name: str, x: torch.Tensor,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, residual


NO_TAP = NoTap()


def tap_for(hook: ForwardHook | None, rms_norm: Callable, eps: float) -> Tap | NoTap:
    return NO_TAP if hook is None else Tap(hook, rms_norm, eps)
