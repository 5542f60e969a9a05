"""The step hook behind captures and interventions, and the names it answers to.

While at least one ``capture`` or ``intervene`` block is open, ``Engine.hook`` holds a HookSet;
when the last one closes it is None again, and the forward pays one flag check per hook point.
For every step the engine calls ``begin_step(plan)``, which returns the model hook for that step.
That hook knows which tokens of the step belong to which row::

    prefill step, rows A (3 tokens) and B (2 tokens)      decode step, 3 rows
    tokens   a0 a1 a2 | b0 b1                              tokens  a9 | b4 | c7
    "layers.1.attn.q"  [5, heads, hd] -> A: [3, ...], B: [2, ...]     -> one token per row
    "final_norm", "logits": one row per row that gets logits (the row's last token)

A runner may call the forward several times in one step (say, one token per call); every name
keeps its own running offset into the step's tokens, so a call's rows are always matched to the
right request and position.

Order at one hook point: interventions in the order their blocks were entered, then captures,
so a capture records the value the forward goes on with. The forward calls the hook only at the
points some entry names (``StepHook.wants``), so "attn.scores" is built only when asked for.

``HookSet`` is the engine's ``StepHooks`` and ``StepHook`` its per-step hook
(``qwen_npu/engine/hooks.py``); every entry is a ``HookEntry`` (``entry.py``), so the set calls
each step method on every entry. ``after_commit`` hands every entry its turn even when one
raises, then raises one ``CaptureCallbackError`` for the step.

The prefix cache: while entries are open, ``HookSet.prefix_limit`` tells the scheduler (through
the step's draft) how many leading tokens a request admitted now may take from the cache (the first position an entry
wants to see or edit, rounded down to a block), so those positions are recomputed inside the
block instead of silently skipped. An entry that wants a position its request computed before
(and will not compute again) refuses the step before it runs (``check_step``).
"""
from __future__ import annotations

import difflib
import fnmatch

import torch

from ..engine import hooks as engine_hooks
from ..engine.interrupts import hold_interrupts, release_interrupts
from ..errors import CaptureCallbackError, InvalidRequestError
from ..model.hooks import capture_names

ROW_NAMES = ("final_norm", "logits")       # one row per logits row, not one per token


def resolve_names(patterns, num_layers: int) -> tuple[str, ...]:
    """Expand names and glob patterns ("layers.*.attn.q") into hook names, in forward order.

    Raises InvalidRequestError, naming close matches, for a name or pattern that matches nothing.
    """
    known = capture_names(num_layers)
    globbed = [n for n in known if not n.endswith(".attn.scores")]     # costly: only when named
    if isinstance(patterns, str):
        patterns = [patterns]
    patterns = list(patterns)
    if not patterns:
        raise InvalidRequestError("no activation names given; see sess.capture_names()")
    chosen = set()
    for p in patterns:
        if not isinstance(p, str):
            raise InvalidRequestError(f"activation names are strings, not {type(p).__name__} ({p!r})")
        glob = any(ch in p for ch in "*?[")
        hits = fnmatch.filter(known if "scores" in p else globbed, p) if glob else [p] if p in known else []
        if not hits:
            close = difflib.get_close_matches(p, known, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise InvalidRequestError(f"no activation named {p!r} in this {num_layers}-layer model{hint} "
                                      f"(sess.capture_names() lists all {len(known)})")
        chosen.update(hits)
    return tuple(n for n in known if n in chosen)


def request_ids(sess, requests) -> frozenset[int] | None:
    """Request ids of ``requests`` (Requests or ids) in ``sess``; None stays None (every row)."""
    if requests is None:
        return None
    if not isinstance(requests, (list, tuple, set, frozenset)):
        requests = [requests]
    return frozenset(sess.request(getattr(r, "id", r)).id for r in requests)


def attach(engine, entry) -> None:
    """Start running ``entry`` (a Capture or Intervention) in every step of ``engine``."""
    hooks = engine.hook
    if hooks is None:
        hooks = engine.hook = HookSet()
    elif not isinstance(hooks, HookSet):
        raise InvalidRequestError(f"the engine already runs another hook ({hooks!r}); remove it first")
    hooks.entries.append(entry)


def leave(engine, entry) -> None:
    """The end of ``entry``'s ``with`` block: detach it and mark it inactive, with Ctrl-C held
    back, so an interrupt as the block ends never leaves it running in later steps."""
    held = hold_interrupts()
    try:
        detach(engine, entry)
        entry.active = False
    finally:
        release_interrupts(held)


def detach(engine, entry) -> None:
    hooks = engine.hook
    if isinstance(hooks, HookSet):
        hooks.entries = [e for e in hooks.entries if e is not entry]
        if not hooks.entries:
            engine.hook = None


def wants_request(entry, request_id: int) -> bool:
    """Does ``entry`` (with ``_sess`` and ``_wanted``) look at this request's rows?"""
    wanted = entry._wanted
    return request_id in entry._sess.state.requests if wanted is None else request_id in wanted


def recompute_from(entry, request_id: int) -> int | None:
    """The first position ``entry`` needs computed for a request admitted now (its prefix-cache
    cap), or None when it does not look at the request."""
    if not wants_request(entry, request_id):
        return None
    return min(entry.absolute_positions) if entry.absolute_positions else 0


def staged_seen(entry, plan, what: str) -> dict[int, set[int]]:
    """``entry._seen`` as it will be once ``plan`` commits: which of its chosen positions each
    request has computed in the block. Refuses ``plan`` (changing nothing) when ``entry`` names
    absolute positions a row's request computed before and never showed to it (they are in the
    cache and will not be computed again)."""
    wanted = entry.absolute_positions
    if wanted is None:
        return entry._seen
    seen = {rid: set(ps) for rid, ps in entry._seen.items()}
    for row in plan.rows[:plan.num_active]:
        rid = row.request.id
        if not wants_request(entry, rid):
            continue
        missed = sorted(p for p in wanted if p < row.start and p not in seen.get(rid, ()))
        if missed:
            shown = missed if len(missed) <= 8 else missed[:8] + ["..."]
            raise InvalidRequestError(
                f"step {plan.index}: {what} positions {shown} of request {rid}, but the request already "
                f"holds their K/V (computed before this block or taken from the prefix cache) and will "
                f"not compute them again; add the prompt as a new request inside the block (it then "
                f"recomputes them), open the session with prefix_cache=False if they came from the cache, "
                f"or pass requests=[...] without request {rid}")
        seen.setdefault(rid, set()).update(p for p in wanted if row.start <= p < row.end)
    return seen


class HookSet(engine_hooks.StepHooks):
    """The active captures and interventions of one engine, in the order they were entered."""

    def __init__(self):
        self.entries: list = []          # HookEntry
        self.committed: int | None = None   # the step the last commit_step published

    def begin_step(self, plan) -> StepHook:
        entries = sorted(self.entries, key=lambda e: e.is_capture)      # stable: interventions first
        for e in entries:                # may refuse the step; nothing has run yet
            e.check_step(plan)
        for e in entries:
            e.begin_step(plan)
        return StepHook(plan, entries)

    def commit_step(self, index: int) -> None:
        """The step ``index`` committed: entries publish what they staged for it (plain
        assignments only: this runs inside the commit)."""
        self.committed = index
        for e in self.entries:
            e.commit_step(index)

    def after_commit(self) -> None:
        """After the commit, with the state whole: entries call user code (streaming callbacks).

        Every entry gets its turn even when one raises; then one ``CaptureCallbackError`` names the
        committed step and every failure (chained from the first). Ctrl-C is not held back here."""
        failures, delivered, first = [], 0, None
        for e in list(self.entries):
            try:
                e.after_commit()
            except CaptureCallbackError as err:
                failures += err.failures
                delivered += err.delivered
                first = first or err.__cause__ or err
            except Exception as err:         # reported below, once every entry had its turn
                failures.append((repr(e), err))
                first = first or err
        if failures:
            raise CaptureCallbackError(self.committed, failures, delivered) from first

    def prefix_limit(self, request_id: int) -> int | None:
        """The most leading tokens a request admitted now may take from the prefix cache."""
        limits = [e.prefix_limit(request_id) for e in self.entries]
        limits = [n for n in limits if n is not None]
        return min(limits) if limits else None

    def __repr__(self) -> str:
        return f"HookSet({self.entries!r})"


class Span:
    """The part of one hook call's rows that belongs to one request row of the step."""

    __slots__ = ("end", "positions", "request_id", "start")

    def __init__(self, request_id: int, start: int, end: int, positions: list[int]):
        self.request_id, self.start, self.end, self.positions = request_id, start, end, positions


class StepHook(engine_hooks.StepHook):
    """The model hook of one step: splits each tensor by row and hands it to the entries."""

    def __init__(self, plan, entries):
        self.plan = plan
        self.entries = entries
        self.by_name: dict[str, list] = {}
        for e in entries:
            for name in e.names:
                self.by_name.setdefault(name, []).append(e)
        self.offsets: dict[str, int] = {}
        self._spans: dict[tuple[bool, int, int], list[Span]] = {}
        # active rows only: (request id, first token, end token) and (logits row -> request id, position)
        self._rows = [(plan.rows[r].request.id, a, b) for r, a, b in plan.row_slices() if r < plan.num_active]
        self._logit_rows = [(plan.rows[r].request.id, plan.positions[plan.logits_index[k]])
                            for k, r in enumerate(plan.logits_rows)]

    def private_requests(self) -> dict[int, str]:
        """Requests whose K/V this step computed under an edit (id -> why): the step books them
        as private on its draft, so their blocks are never published to the prefix cache."""
        out: dict[int, str] = {}
        for e in self.entries:
            for rid, why in e.private_requests().items():
                out.setdefault(rid, why)
        return out

    def wants(self, name: str) -> bool:
        """Is any entry looking at ``name``? (the forward skips the other points)"""
        return name in self.by_name

    def __call__(self, name: str, x: torch.Tensor):
        entries = self.by_name.get(name)
        if entries is None:
            return None
        n = x.shape[0]
        off = self.offsets.get(name, 0)
        self.offsets[name] = off + n
        spans = self.spans(name in ROW_NAMES, off, n)
        if not spans:
            return None
        out = None
        for e in entries:
            y = e.on_tensor(self.plan, name, x if out is None else out, spans)
            if y is not None:
                out = y
        return out

    def spans(self, by_logits_row: bool, off: int, n: int) -> list[Span]:
        """The rows of a call that covers step tokens (or logits rows) ``off..off+n-1``."""
        key = (by_logits_row, off, n)
        found = self._spans.get(key)
        if found is not None:
            return found
        found = []
        if by_logits_row:
            for k in range(off, min(off + n, len(self._logit_rows))):
                rid, pos = self._logit_rows[k]
                found.append(Span(rid, k - off, k - off + 1, [pos]))
        else:
            for rid, a, b in self._rows:
                lo, hi = max(a, off), min(b, off + n)
                if lo < hi:
                    found.append(Span(rid, lo - off, hi - off, self.plan.positions[lo:hi]))
        self._spans[key] = found
        return found
