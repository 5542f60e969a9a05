"""``with sess.capture(names) as cap:`` — named activations of every step run inside the block.

Each step's tensor at a hook point is cloned once when the forward reaches it (a snapshot: later
steps and later edits cannot change it) and split by request row::

    cap.get("layers.1.attn.q", step=4, request=2)   # [tokens of that row in step 4, heads, hd]
    cap.stack("layers.1.attn.q", request=2)          # every captured position, in position order
    cap.positions(request=2)                         # the positions of that stack

"final_norm" and "logits" have one row per request row that produced logits (its last token).
Tensors stay on the model's device. The capture keeps what it recorded after the block closes;
nothing of it stays attached to the session.
"""
from __future__ import annotations

import dataclasses
import html

import torch

from ..errors import InvalidRequestError
from . import hooks


@dataclasses.dataclass
class CaptureRecord:
    """What one request row of one step produced: ``tensors[name]`` is [tokens of the row, ...]."""

    step: int
    kind: str
    request_id: int
    positions: dict[str, list[int]]
    chunks: dict[str, list[torch.Tensor]]

    def tensor(self, name: str) -> torch.Tensor:
        parts = self.chunks[name]
        if len(parts) > 1:                      # a runner that called the forward several times
            self.chunks[name] = parts = [torch.cat(parts)]
        return parts[0]


class Capture:
    """Recorded activations by (step, request, name); a context manager (see module docstring)."""

    is_capture = True

    def __init__(self, sess, names, *, requests=None):
        self.names = hooks.resolve_names(names, sess.model_config.num_hidden_layers)
        self._wanted = hooks.request_ids(sess, requests)
        self._sess = sess
        self._records: dict[tuple[int, int], CaptureRecord] = {}
        self._steps: dict[int, str] = {}
        self.active = False
        self._used = False

    # ---- the context --------------------------------------------------------------------------
    def __enter__(self) -> Capture:
        if self._used:
            raise InvalidRequestError("this capture was already used; call sess.capture(...) again")
        hooks.attach(self._sess.state.engine, self)
        self.active = self._used = True
        return self

    def __exit__(self, *exc) -> None:
        hooks.detach(self._sess.state.engine, self)
        self.active = False

    # ---- called by the step hook ---------------------------------------------------------------
    def begin_step(self, plan) -> None:
        # records go to a pending buffer that only the step's commit publishes (commit_step):
        # a step that fails or is interrupted leaves no record
        self._pending, self._pending_kind = {}, None

    def commit_step(self, index: int) -> None:
        pending = getattr(self, "_pending", None)
        if pending:
            self._records.update(pending)
            self._steps[index] = self._pending_kind
        self._pending, self._pending_kind = {}, None

    def on_tensor(self, plan, name: str, x: torch.Tensor, spans) -> None:
        owned = self._sess.state.requests
        wanted = self._wanted
        snap = None
        for s in spans:
            rid = s.request_id
            if (rid not in owned) if wanted is None else (rid not in wanted):
                continue
            if snap is None:
                snap = x.detach().clone()        # one copy per call; rows below are views of it
                self._pending_kind = plan.kind
            rec = self._pending.get((plan.index, rid))
            if rec is None:
                rec = self._pending[(plan.index, rid)] = CaptureRecord(plan.index, plan.kind, rid, {}, {})
            rec.chunks.setdefault(name, []).append(snap[s.start:s.end])
            rec.positions.setdefault(name, []).extend(s.positions)

    # ---- reading --------------------------------------------------------------------------------
    @property
    def steps(self) -> list[int]:
        """Indices of the steps that recorded something, in order."""
        return sorted(self._steps)

    @property
    def request_ids(self) -> list[int]:
        return sorted({rid for _, rid in self._records})

    @property
    def records(self) -> list[CaptureRecord]:
        """Every (step, request) record, in step then request order."""
        return [self._records[k] for k in sorted(self._records)]

    def _name(self, name: str) -> str:
        if name not in self.names:
            found = hooks.resolve_names(name, self._sess.model_config.num_hidden_layers)
            raise InvalidRequestError(f"{found[0]!r} was not captured; this capture holds "
                                      f"{', '.join(self.names)}")
        return name

    def get(self, name: str, step, request) -> torch.Tensor:
        """The tensor of ``name`` for one request row of one step: [tokens of the row, ...]."""
        self._name(name)
        step = getattr(step, "index", step)
        rid = getattr(request, "id", request)
        rec = self._records.get((step, rid))
        if rec is None or name not in rec.chunks:
            raise InvalidRequestError(f"nothing captured for request {rid} in step {step} (captured steps "
                                      f"{self.steps}, requests {self.request_ids})")
        return rec.tensor(name)

    def __getitem__(self, name: str) -> dict[tuple[int, int], torch.Tensor]:
        """``{(step, request id): tensor}`` of one name."""
        self._name(name)
        return {k: r.tensor(name) for k, r in sorted(self._records.items()) if name in r.chunks}

    def _ordered(self, name: str, request) -> tuple[list[int], list[tuple[CaptureRecord, int]]]:
        """Positions ascending and, for each, (record, row) of its latest computation."""
        self._name(name)
        rid = getattr(request, "id", request)
        latest: dict[int, tuple[CaptureRecord, int]] = {}
        for rec in self.records:
            if rec.request_id == rid and name in rec.chunks:
                for j, p in enumerate(rec.positions[name]):
                    latest[p] = (rec, j)          # a recomputed position (after preemption) wins
        if not latest:
            raise InvalidRequestError(f"nothing of {name!r} captured for request {rid} (captured requests "
                                      f"{self.request_ids})")
        order = sorted(latest)
        return order, [latest[p] for p in order]

    def positions(self, request, name: str | None = None) -> list[int]:
        """The positions ``stack(name, request)`` returns, ascending."""
        return self._ordered(name or self.names[0], request)[0]

    def steps_of(self, request, name: str | None = None) -> list[int]:
        """For each position of ``positions(request, name)``, the step that computed it."""
        return [rec.step for rec, _ in self._ordered(name or self.names[0], request)[1]]

    def stack(self, name: str, request) -> torch.Tensor:
        """Every captured position of one request, in position order: [positions, ...]."""
        _, where = self._ordered(name, request)
        return torch.stack([rec.tensor(name)[j] for rec, j in where])

    # ---- views ------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for r in self._records.values() for parts in r.chunks.values() for t in parts)

    def _summary(self) -> list[str]:
        names = list(self.names)
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} names)" if len(names) > 6 else "")
        kinds = {}
        for k in self._steps.values():
            kinds[k] = kinds.get(k, 0) + 1
        steps = self.steps
        span = f"{steps[0]}..{steps[-1]}" if steps else "none"
        how = ", ".join(f"{n} {k}" for k, n in kinds.items())
        state = "recording" if self.active else "closed"
        return [f"Capture ({state}): {shown}",
                f"  steps {span} ({len(steps)}{': ' + how if how else ''}), requests {self.request_ids}, "
                f"{len(self._records)} rows, {self.nbytes / 1024:.1f} KiB"]

    def __repr__(self) -> str:
        lines = self._summary()
        for rec in self.records[:8]:
            pos = next(iter(rec.positions.values()))
            first = rec.tensor(self.names[0]) if self.names[0] in rec.chunks else None
            shape = f" {self.names[0]} {list(first.shape)}" if first is not None else ""
            lines.append(f"  step {rec.step} ({rec.kind}) request {rec.request_id}: positions "
                         f"{pos[0]}..{pos[-1]}{shape}")
        if len(self._records) > 8:
            lines.append(f"  ... and {len(self._records) - 8} more rows (see .records)")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return f"<pre style='font-size:12px'>{html.escape(repr(self))}</pre>"
