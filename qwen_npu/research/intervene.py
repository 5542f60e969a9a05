"""``with sess.intervene(name, fn, requests=..., positions=...):`` — edit an activation in flight.

For every step run inside the block, at hook point ``name`` (or every name a glob matches), each
chosen request row's slice of the tensor is handed to ``fn``::

    fn(x) -> tensor | None     x: [tokens of the row (or the chosen positions), ...], a private copy
                               return the replacement (same shape), or None after editing x in place

The forward goes on with the edited tensor, so the step's logits, its sampled token and the K/V
it writes to the cache all follow the edit (the request keeps those K/V after the block: they are
what it computed). When the block closes, the hook is removed; later steps run unedited.
Ready-made edits: ``zero()``, ``zero_heads(*heads)``, ``scale(f)``, ``add(vector)``, ``replace(tensor)``.

The prefix cache never spreads an edit, nor hides a position from it:

* a request edited at any point before the final norm publishes none of its blocks from then on
  (nor do its forks), so no later request, in this branch or another, reuses edited K/V;
* a request admitted inside the block recomputes the positions the edit covers instead of taking
  them from the cache (from its first chosen position, rounded down to a block);
* naming ``positions`` that a running request already computed before the block is refused,
  before the step runs, with the positions and the remedy;
* ``sess.attention`` refuses an edited request (its queries cannot be rebuilt without the edit):
  capture "layers.{i}.attn.scores" inside the block instead.

Edits of "final_norm" or "logits" change only the sampled tokens, never K/V, so they keep the
request's blocks shareable. "attn.scores" is a capture point only. A request the scheduler
preempts after the block closed is recomputed without the edit (its tokens stay as sampled, its
K/V become the unedited ones, and it may share them again).
"""
from __future__ import annotations

import torch

from ..errors import InvalidRequestError
from . import hooks
from .entry import HookEntry


class Intervention(HookEntry):
    """One edit, active inside its ``with`` block (see module docstring)."""

    is_capture = False

    def __init__(self, sess, name, fn, *, requests=None, positions=None):
        if not callable(fn):
            raise InvalidRequestError(f"intervene: fn must be callable (tensor -> tensor | None), not "
                                      f"{type(fn).__name__}")
        self.names = hooks.resolve_names(name, sess.model_config.num_hidden_layers)
        scores = [n for n in self.names if n.endswith(".attn.scores")]
        if scores:
            raise InvalidRequestError(f"intervene: {scores[0]!r} is a capture point only (the kernels fuse "
                                      f"softmax); edit 'attn.q' or 'attn.k' to change the scores")
        self.fn = fn
        self._sess = sess
        self._wanted = hooks.request_ids(sess, requests)
        if positions is not None:
            positions = [positions] if isinstance(positions, int) else list(positions)
            if any(not isinstance(p, int) or p < 0 for p in positions):
                raise InvalidRequestError(f"intervene: positions must be ints >= 0, not {positions!r}")
            positions = frozenset(positions)
        self.positions = positions
        self.num_edits = 0          # row slices edited so far
        self.active = False
        self._seen: dict[int, set[int]] = {}     # request id -> chosen positions this block computed
        # what a step in progress adds; published by commit_step only (a failed step leaves no trace)
        self._staged_seen: dict[int, set[int]] | None = None
        self._staged_edits = 0
        self.staged_private: dict[int, str] = {}  # request id -> why (read by the step's booking)

    @property
    def absolute_positions(self) -> frozenset[int] | None:
        return self.positions

    def check_step(self, plan) -> None:
        self._staged_seen = hooks.staged_seen(self, plan, f"intervene({', '.join(self.names[:2])}) names")

    def prefix_limit(self, request_id: int) -> int | None:
        """Recompute every position this edit covers (see module docstring)."""
        return hooks.recompute_from(self, request_id)

    def __enter__(self) -> Intervention:
        hooks.attach(self._sess.state.engine, self)
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        hooks.leave(self._sess.state.engine, self)

    def begin_step(self, plan) -> None:
        self._staged_edits, self.staged_private = 0, {}

    def private_requests(self) -> dict[int, str]:
        return self.staged_private

    def commit_step(self, index: int) -> None:
        if self._staged_seen is not None:
            self._seen = self._staged_seen
        self.num_edits += self._staged_edits
        self._staged_seen, self._staged_edits, self.staged_private = None, 0, {}

    def on_tensor(self, plan, name: str, x: torch.Tensor, spans) -> torch.Tensor | None:
        out = None
        for s in spans:
            rid = s.request_id
            if not hooks.wants_request(self, rid):
                continue
            if self.positions is None:
                idx = slice(s.start, s.end)
            else:
                keep = [s.start + j for j, p in enumerate(s.positions) if p in self.positions]
                if not keep:
                    continue
                idx = torch.tensor(keep, dtype=torch.int64, device=x.device)
            if out is None:
                out = x.clone()
            part = out[idx].clone()
            got = self.fn(part)
            got = part if got is None else got
            if not isinstance(got, torch.Tensor) or got.shape != part.shape:
                shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise InvalidRequestError(
                    f"step {plan.index}: intervene fn for {name!r} (request {rid}) returned {shape}, "
                    f"expected a tensor of shape {list(part.shape)}")
            out[idx] = got.to(device=out.device, dtype=out.dtype)
            self._staged_edits += 1
            if name not in hooks.ROW_NAMES:
                self.staged_private.setdefault(rid, f"request {rid} was edited at {name!r} in step {plan.index}")
        return out

    def __repr__(self) -> str:
        who = "every row" if self._wanted is None else f"requests {sorted(self._wanted)}"
        where = "" if self.positions is None else f" at positions {sorted(self.positions)}"
        state = "active" if self.active else "inactive"
        return (f"Intervention({', '.join(self.names)}: {getattr(self.fn, '__name__', 'fn')} on {who}{where}; "
                f"{state}, {self.num_edits} edits)")


# ---- ready-made edits --------------------------------------------------------------------------
def zero():
    """Replace the activation with zeros."""
    def zero_(x):
        return torch.zeros_like(x)
    return zero_


def zero_heads(*heads: int):
    """Zero the given heads of a per-head activation ([tokens, heads, head_dim]: q, k, v, z)."""
    if not heads:
        raise InvalidRequestError("zero_heads: name at least one head")

    def zero_heads_(x):
        if x.dim() != 3 or max(heads) >= x.shape[1] or min(heads) < 0:
            raise InvalidRequestError(f"zero_heads{heads}: needs a [tokens, heads, head_dim] activation with "
                                      f"those heads, got {list(x.shape)}")
        x[:, list(heads)] = 0
    return zero_heads_


def scale(factor: float):
    """Multiply the activation by ``factor``."""
    def scale_(x):
        return x * factor
    return scale_


def add(vector: torch.Tensor, coeff: float = 1.0):
    """Add ``coeff * vector`` to every token (a steering vector, broadcast over tokens)."""
    vector = torch.as_tensor(vector)

    def add_(x):
        return x + coeff * vector.to(device=x.device, dtype=x.dtype)
    return add_


def replace(tensor: torch.Tensor):
    """Replace the activation with ``tensor`` (broadcast to the row's shape)."""
    tensor = torch.as_tensor(tensor)

    def replace_(x):
        return tensor.to(device=x.device, dtype=x.dtype).expand_as(x).clone()
    return replace_
