"""Reading a Capture: by step and request, stacked by position, running means, text and HTML.

Every read first waits for the capture's pending host copies (``offload="host"``), so a tensor
handed out is always complete.
"""
from __future__ import annotations

import torch

from ..errors import InvalidRequestError
from ..inspect import html as H
from . import hooks


class CaptureViews:
    """The reading half of ``Capture`` (see capture.py); state lives there."""

    @property
    def steps(self) -> list[int]:
        """Indices of the steps that recorded something, in order."""
        return sorted(self._steps)

    @property
    def request_ids(self) -> list[int]:
        return sorted({rid for _, rid in self._records} | {rid for rid, _ in self._sums}
                      | {p[0] for p in self._pending})

    @property
    def records(self) -> list:
        """Every (step, request) record, in step then request order."""
        self._sync()
        return [self._records[k] for k in sorted(self._records)]

    def _name(self, name: str) -> str:
        if name not in self.names:
            found = hooks.resolve_names(name, self._sess.model_config.num_hidden_layers)
            raise InvalidRequestError(f"{found[0]!r} was not captured; this capture holds "
                                      f"{', '.join(self.names)}")
        if self.accumulates:
            raise InvalidRequestError(f"this capture keeps means over positions (reduce=mean_positions()); "
                                      f"read them with cap.mean({name!r}, request)")
        return name

    def get(self, name: str, step, request) -> torch.Tensor:
        """The tensor of ``name`` for one request row of one step: [tokens of the row, ...]."""
        self._name(name)
        self._sync()
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
        self._sync()
        return {k: r.tensor(name) for k, r in sorted(self._records.items()) if name in r.chunks}

    def _ordered(self, name: str, request):
        """Positions ascending and, for each, (record, row) of its latest computation."""
        self._name(name)
        self._sync()
        rid = getattr(request, "id", request)
        latest = {}
        for k in sorted(self._records):
            rec = self._records[k]
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
        """Every captured position of one request, in position order: [positions, ...]
        ("attn.scores": keys padded with -inf to the longest row)."""
        _, where = self._ordered(name, request)
        rows = [rec.tensor(name)[j] for rec, j in where]
        if name.endswith(".attn.scores"):
            rows = pad_keys(rows)
        return torch.stack(rows)

    def mean(self, name: str, request) -> torch.Tensor:
        """With ``reduce=mean_positions()``: the mean of ``name`` over every captured position of
        ``request`` (float32, [...])."""
        if name not in self.names:
            raise InvalidRequestError(f"{name!r} was not captured; this capture holds {', '.join(self.names)}")
        if not self.accumulates:
            raise InvalidRequestError("cap.mean needs sess.capture(..., reduce=mean_positions()); "
                                      "this capture keeps every position (use cap.stack(...).mean(0))")
        self._sync()
        rid = getattr(request, "id", request)
        got = self._sums.get((rid, name))
        if got is None:
            raise InvalidRequestError(f"nothing of {name!r} captured for request {rid} (captured requests "
                                      f"{self.request_ids})")
        return got[0] / got[1]

    # ---- views ------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes kept (device or host), as counted against ``budget``."""
        self._sync()
        return self._kept

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
        reduce = self.reduce if self.reduce is None else getattr(self.reduce, "__name__", type(self.reduce).__name__)
        opts = [f"{k}={v!r}" for k, v in (("positions", self.position_filter), ("reduce", reduce),
                                          ("offload", self.offload), ("budget", self.budget)) if v is not None]
        opts += ["streaming"] if self.streams else []
        where = f" [{', '.join(opts)}]" if opts else ""
        return [f"Capture ({state}){where}: {shown}",
                f"  steps {span} ({len(steps)}{': ' + how if how else ''}), requests {self.request_ids}, "
                f"{len(self._records)} rows, {self.nbytes / 1024:.1f} KiB"]

    def __repr__(self) -> str:
        lines = self._summary()
        for rec in self.records[:8]:
            pos = next(iter(rec.positions.values()))
            first = rec.tensor(self.names[0]) if self.names[0] in rec.chunks else None
            shape = f" {self.names[0]} {list(first.shape)}" if first is not None else ""
            kind = f"mixed, {rec.row_kind} row" if rec.kind == "mixed" else rec.kind
            lines.append(f"  step {rec.step} ({kind}) request {rec.request_id}: positions "
                         f"{pos[0]}..{pos[-1]}{shape}")
        if len(self._records) > 8:
            lines.append(f"  ... and {len(self._records) - 8} more rows (see .records)")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return H.pre(repr(self))


def pad_keys(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """"attn.scores" rows cut to different numbers of keys, padded with -inf to the longest."""
    width = max(r.shape[-1] for r in rows)
    if all(r.shape[-1] == width for r in rows):
        return rows
    return [torch.nn.functional.pad(r, (0, width - r.shape[-1]), value=float("-inf")) for r in rows]
