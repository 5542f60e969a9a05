"""``with sess.capture(names) as cap:`` — named activations of every step run inside the block.

At each hook point the chosen tokens of the chosen rows are gathered in one copy (a snapshot:
later steps and later edits cannot change it), reduced and offloaded if asked, and split by
request row::

    cap.get("layers.1.attn.q", step=4, request=2)   # [tokens of that row in step 4, heads, hd]
    cap.stack("layers.1.attn.q", request=2)          # every captured position, in position order
    cap.positions(request=2)                         # the positions of that stack

Options (all checked before the block opens):

    positions="last"        only each row's last token of a step (the one whose logits pick the next)
    positions="generated"   only positions past the prompt (the generated tokens)
    positions=[3, 7] / 5    only those absolute positions (a cached one is recomputed or refused)
    reduce=fn               fn(x [tokens, ...]) -> [tokens, ...] on the device before keeping
                            (reductions.py: norm(), topk_logits(k), mean_positions())
    offload="host"          copy what is kept to host memory (pinned when the device allows),
                            non_blocking: no host sync in the step; the first read waits for it
    budget=bytes            refuse the block (estimate) or a step (exact) that would keep more
    on_step=fn              streaming: fn(CaptureSlice) per name and row of every step, called
                            after the step commits (the session's state whole), in forward order;
                            nothing is kept (offloaded slices: ``slice.wait()`` before reading)

A step whose ``on_step`` raises has already committed: the callback still receives every other
slice of the step, then one ``CaptureCallbackError`` names the step and the slices that raised
(chained from the first exception); the session stays usable. Ctrl-C inside the callback stops
the deliveries at once.

"final_norm" and "logits" have one row per request row that produced logits (its last token).
"attn.scores" rows are cut to the keys the row's last chosen token sees. A request admitted inside
the block recomputes the cached prefix positions the capture wants (see hooks.py). The capture keeps
what it recorded after the block closes; nothing of it stays attached to the session.
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import CaptureCallbackError, InvalidRequestError
from ..inspect.html import fmt_bytes
from . import capture_memory, hooks
from .capture_views import CaptureViews, pad_keys
from .entry import HookEntry


@dataclasses.dataclass
class CaptureRecord:
    """What one request row of one step produced: ``tensor(name)`` is [tokens of the row, ...]."""

    step: int
    kind: str                               # the step's kind: "prefill" | "decode" | "mixed"
    request_id: int
    positions: dict[str, list[int]]
    chunks: dict[str, list[torch.Tensor]]
    row_kind: str = ""                      # this row's: "decode" | "prefill" (differs only in a mixed step)

    def tensor(self, name: str) -> torch.Tensor:
        parts = self.chunks[name]
        if len(parts) > 1:                      # a runner that called the forward several times
            self.chunks[name] = parts = [_cat(parts)]
        return parts[0]


@dataclasses.dataclass(frozen=True)
class CaptureSlice:
    """What a streaming capture hands its callback: one name, one request row, one step."""

    step: int
    kind: str
    request_id: int
    name: str
    positions: list[int]
    tensor: torch.Tensor                # [tokens, ...] (reduced; on the host with offload="host")
    event: object = None                # the pending host copy's event (offload="host" on a device)
    row_kind: str = ""                  # the row's kind, "decode" | "prefill" (``kind`` is the step's)

    def wait(self) -> torch.Tensor:
        """The tensor once its host copy is complete (a no-op unless offloaded from a device)."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensor


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    if parts[0].dim() == 3:                     # scores of several calls
        parts = pad_keys(parts)
    return torch.cat(parts)


class Capture(CaptureViews, HookEntry):
    """Recorded activations by (step, request, name); a context manager (see module docstring)."""

    is_capture = True

    def __init__(self, sess, names, *, requests=None, positions=None, reduce=None, offload=None,
                 budget=None, on_step=None):
        self.names = hooks.resolve_names(names, sess.model_config.num_hidden_layers)
        self._wanted = hooks.request_ids(sess, requests)
        self._sess = sess
        self.position_filter, self.absolute_positions = _positions(positions)
        if reduce is not None and not callable(reduce):
            raise InvalidRequestError(f"capture: reduce must be callable (tensor -> tensor), not "
                                      f"{type(reduce).__name__}")
        if offload not in (None, "host"):
            raise InvalidRequestError(f"capture: offload={offload!r}; use None (keep on the device) or "
                                      f"'host'")
        bad_budget = isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0
        if budget is not None and bad_budget:
            raise InvalidRequestError(f"capture: budget={budget!r}; give a number of bytes >= 0 (or None)")
        if on_step is not None and not callable(on_step):
            raise InvalidRequestError("capture: on_step must be callable (CaptureSlice -> None)")
        self.reduce, self.offload, self.budget, self.on_step = reduce, offload, budget, on_step
        self.accumulates = bool(getattr(reduce, "accumulate", False))
        self.streams = on_step is not None
        self.position_bytes = capture_memory.PositionBytes(sess.model_config, sess.model.dtype, reduce)
        device = sess.model.device
        self.pinned = offload == "host" and device.type != "cpu" and _can_pin()
        self._records: dict[tuple[int, int], CaptureRecord] = {}
        self._sums: dict[tuple[int, str], list] = {}           # (request, name) -> [float32 sum, count]
        # mean_positions: (request, name, sum, count, step) of steps not yet folded into _sums
        self._pending: list[tuple[int, str, torch.Tensor, int, int]] = []
        self._steps: dict[int, str] = {}
        self._seen: dict[int, set[int]] = {}
        self._event = None
        self._kept = 0
        # what the step in progress captured: published by commit_step only, so a step that fails or
        # is interrupted leaves no record (streamed slices go to on_step after the commit)
        self._staged = _Staged()
        self._staged_seen: dict[int, set[int]] | None = None
        self.active = False
        self._used = False

    # ---- the context --------------------------------------------------------------------------
    def estimate(self, requests=None) -> capture_memory.CaptureEstimate:
        """What this capture would keep if the chosen (default: live, wanted) requests ran to the end."""
        if requests is None:
            reqs = [r for r in self._sess.requests if not r.is_done and hooks.wants_request(self, r.id)]
        else:
            many = requests if isinstance(requests, (list, tuple)) else [requests]
            reqs = [self._sess.request(getattr(r, "id", r)) for r in many]
        return capture_memory.estimate(self, reqs)

    def __enter__(self) -> Capture:
        if self._used:
            raise InvalidRequestError("this capture was already used; call sess.capture(...) again")
        if self.budget is not None:
            est = self.estimate()
            if est.bytes > self.budget:
                raise InvalidRequestError(self._over_budget(est.bytes, f"the live requests {list(est.requests)} "
                                                            f"run to their max_new_tokens"))
        hooks.attach(self._sess.state.engine, self)
        self.active = self._used = True
        return self

    def __exit__(self, *exc) -> None:
        hooks.leave(self._sess.state.engine, self)

    def _over_budget(self, need: int, what: str) -> str:
        return (f"capture of {', '.join(self.names[:3])}{' ...' if len(self.names) > 3 else ''} would keep "
                f"{fmt_bytes(need)} for {what}, over its budget of {fmt_bytes(int(self.budget))}; narrow "
                f"names, requests or positions ('last', 'generated'), reduce on the device, or stream "
                f"with on_step")

    # ---- called by the step hook ---------------------------------------------------------------
    def keeps_position(self, req, p: int, step_last: int | None = None) -> bool:
        f = self.position_filter
        if f is None:
            return True
        if f == "generated":
            return p >= len(req.prompt_token_ids)
        if f == "last":
            return step_last is None or p == step_last
        return p in self.absolute_positions

    def prefix_limit(self, request_id: int) -> int | None:
        if self.position_filter in ("last", "generated"):
            return None
        return hooks.recompute_from(self, request_id)

    def check_step(self, plan) -> None:
        self._staged_seen = hooks.staged_seen(self, plan, "capture names")
        self._fold()
        if self.budget is None or self.streams:
            return
        need = 0
        for row in plan.rows[:plan.num_active]:
            if not hooks.wants_request(self, row.request.id):
                continue
            ps = [p for p in range(row.start, row.end) if self.keeps_position(row.request, p, row.end - 1)]
            for name in self.names:
                rows = ps if name not in hooks.ROW_NAMES else ([row.end - 1] if row.needs_logits else [])
                if self.accumulates:              # one running sum per request and name
                    rows = rows[:1] if (row.request.id, name) not in self._sums else []
                need += sum(self.position_bytes(name, p) for p in rows)
        if self._kept + need > self.budget:
            raise InvalidRequestError(f"step {plan.index}: " + self._over_budget(
                self._kept + need, f"the {fmt_bytes(self._kept)} kept so far and this step"))

    def begin_step(self, plan) -> None:
        self._staged = _Staged()
        self._last = {row.request.id: row.end - 1 for row in plan.rows[:plan.num_active]}
        self._row_kinds = {row.request.id: row.kind for row in plan.rows[:plan.num_active]}
        self._selections: dict[int, tuple[list, _Selection | None]] = {}

    def _select(self, spans, device) -> _Selection | None:
        """The chosen tokens of a call's ``spans``: the same for every name that shares the layout,
        so worked out once per step and layout (the step hook hands each layout's spans once)."""
        got = self._selections.get(id(spans))
        if got is not None and got[0] is spans:
            return got[1]
        chosen, picks = [], []
        for s in spans:
            rid = s.request_id
            if not hooks.wants_request(self, rid):
                continue
            req = self._sess.state.requests[rid]
            keep = [j for j, p in enumerate(s.positions) if self.keeps_position(req, p, self._last.get(rid))]
            if keep:
                chosen.append((s, [s.positions[j] for j in keep], len(picks)))
                picks += [s.start + j for j in keep]
        sel = None
        if picks:
            if picks == list(range(picks[0], picks[-1] + 1)):
                index = slice(picks[0], picks[-1] + 1)
            else:
                index = torch.tensor(picks, dtype=torch.int64, device=device)
            sel = _Selection(chosen, index, max(max(ps) for _, ps, _ in chosen) + 1)
        self._selections[id(spans)] = (spans, sel)
        return sel

    def on_tensor(self, plan, name: str, x: torch.Tensor, spans) -> None:
        sel = self._select(spans, x.device)
        if sel is None:
            return
        chosen = sel.chosen
        staged = self._staged
        staged.steps[plan.index] = plan.kind
        if isinstance(sel.index, slice):
            snap = x.detach()[sel.index]
        else:
            snap = x.detach().index_select(0, sel.index)
        if name.endswith(".attn.scores"):
            snap = snap[..., :sel.keys]
        if self.reduce is not None:
            snap = self.reduce(snap)
        if snap.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            snap = snap.clone()                 # a snapshot: the forward may reuse x's memory
        if self.accumulates:
            for s, positions, at in chosen:
                total = snap[at:at + len(positions)].sum(0)
                staged.sums.append((s.request_id, name, total, len(positions), plan.index))
            return
        event = None
        if self.offload == "host" and snap.device.type != "cpu":
            host = torch.empty(snap.shape, dtype=snap.dtype, pin_memory=self.pinned)
            host.copy_(snap, non_blocking=True)
            snap = host
            self._event = event = _record_event(x.device)
        cut = name.endswith(".attn.scores") and self.reduce is None
        for s, positions, at in chosen:
            part = snap[at:at + len(positions)]
            if cut:                             # the keys this row's tokens may see
                part = part[..., :max(positions) + 1]
            if self.streams:
                staged.slices.append(CaptureSlice(plan.index, plan.kind, s.request_id, name, list(positions), part,
                                                  event, self._row_kinds.get(s.request_id, plan.kind)))
                continue
            rec = staged.records.get((plan.index, s.request_id))
            if rec is None:
                rec = CaptureRecord(plan.index, plan.kind, s.request_id, {}, {},
                                    self._row_kinds.get(s.request_id, plan.kind))
                staged.records[(plan.index, s.request_id)] = rec
            rec.chunks.setdefault(name, []).append(part)
            rec.positions.setdefault(name, []).extend(positions)
        if not self.streams:
            staged.kept += snap.nbytes

    def commit_step(self, index: int) -> None:
        """The step committed: publish what it captured (plain assignments)."""
        staged = self._staged
        if self._staged_seen is not None:
            self._seen = self._staged_seen
        self._records.update(staged.records)
        self._steps.update(staged.steps)
        self._kept += staged.kept
        self._pending.extend(staged.sums)
        self._staged, self._staged_seen = _Staged(slices=staged.slices), None

    def after_commit(self) -> None:
        """Hand every slice of the committed step to ``on_step`` (user code, the state whole), even
        those after a slice whose call raised; then raise one CaptureCallbackError for them."""
        slices, self._staged.slices = self._staged.slices, []
        failures = []
        for piece in slices:
            try:
                self.on_step(piece)
            except Exception as err:         # reported once every slice was delivered
                failures.append((f"{piece.name} of request {piece.request_id} (positions "
                                 f"{_positions_text(piece.positions)})", err))
        if failures:
            raise CaptureCallbackError(slices[0].step, failures, len(slices)) from failures[0][1]

    def _fold(self) -> None:
        """Add the committed per-step sums of ``mean_positions`` into the totals."""
        for rid, name, total, n, _step in self._pending:
            got = self._sums.get((rid, name))
            if got is None:
                self._sums[(rid, name)] = [total, n]
                self._kept += total.nbytes
            else:
                got[0] = got[0] + total
                got[1] += n
        self._pending = []

    def _sync(self) -> None:
        """Wait for the offload copies (the only host sync, at the first read)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self._fold()


@dataclasses.dataclass
class _Selection:
    """The chosen tokens of one span layout in one step."""
    chosen: list            # (span, chosen positions, first row in the gathered tensor)
    index: slice | torch.Tensor     # rows of the call's tensor to gather
    keys: int               # keys the chosen tokens see ("attn.scores": one past the largest position)


@dataclasses.dataclass
class _Staged:
    """What one step in progress captured, until its commit."""
    records: dict = dataclasses.field(default_factory=dict)
    steps: dict = dataclasses.field(default_factory=dict)
    sums: list = dataclasses.field(default_factory=list)
    slices: list = dataclasses.field(default_factory=list)
    kept: int = 0


def _positions(positions):
    """(filter, absolute positions) from ``positions=``; a clear error for anything else."""
    if positions is None or positions in ("last", "generated"):
        return positions, None
    if isinstance(positions, int) and not isinstance(positions, bool):
        positions = [positions]
    try:
        got = frozenset(positions)
    except TypeError:
        got = None
    if got is None or not got or any(not isinstance(p, int) or isinstance(p, bool) or p < 0 for p in got):
        raise InvalidRequestError(f"capture: positions={positions!r}; use None (all), 'last', 'generated', "
                                  f"or absolute positions (ints >= 0)")
    return "absolute", got


def _positions_text(positions: list[int]) -> str:
    return ", ".join(map(str, positions)) if len(positions) <= 4 else f"{positions[0]}..{positions[-1]}"


def _can_pin() -> bool:
    try:
        torch.empty(1, pin_memory=True)
        return True
    except RuntimeError:
        return False


def _record_event(device: torch.device):
    mod = getattr(torch, device.type, None)
    event = mod.Event() if mod is not None and hasattr(mod, "Event") else None
    if event is not None:
        event.record()
    return event
