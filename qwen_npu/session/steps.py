"""The Session's transactions (mixed into ``Session``): the call gate, and which rows each kind
of step takes.

Every state-changing Session method is ``@exclusive``: it holds the engine's ``CallGate`` (one
call at a time across threads; another thread is refused at once) with Ctrl-C held back
(``engine/transaction.py``). ``prefill``, ``decode_step`` and ``step`` say how their rows are
scheduled, ``sample`` which step it samples; each then runs ``engine/step.py`` top to bottom.
"""
from __future__ import annotations

import collections
import functools
import threading

import torch

from ..engine import speculative
from ..engine.interrupts import hold_interrupts, release_interrupts
from ..engine.plan import StepResult
from ..engine.request import DECODING, PREFILLING, WAITING, Request
from ..engine.step import Commit, check_not_pending, commit, run_step, sample_step
from ..engine.transaction import StepDraft
from ..errors import InvalidRequestError, SessionBusyError, StaleOutputError


class CallGate:
    """A re-entrant, never-waiting lock with the name of the outermost call that holds it; it
    also knows whether that call is inside a step (``stepping``)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self.holder: tuple[str, str] | None = None     # (thread name, call) of the outermost call
        self.stepping: int | None = None               # the index of the step running, if any

    def enter(self, call: str, *, changes_state: bool) -> None:
        if not self._lock.acquire(blocking=False):
            thread, running = self.holder or ("another thread", "a call")
            raise SessionBusyError(
                f"cannot run {call}(): {running}() of this session (or a fork sharing its KV cache) is "
                f"running in thread {thread!r}; wait for it to finish (nothing was changed)")
        if changes_state and self.stepping is not None:
            self._lock.release()
            raise InvalidRequestError(
                f"cannot run {call}() inside step {self.stepping}: it was called from code the step runs "
                f"(an intervention or capture callback), and the step's commit would undo it; call it "
                f"after the step returns (nothing was changed)")
        if self._depth == 0:
            self.holder = (threading.current_thread().name, call)
        self._depth += 1

    def leave(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.holder = None
        self._lock.release()

    @property
    def free(self) -> bool:
        return self._depth == 0

    @property
    def outermost(self) -> bool:
        """Between ``enter`` and ``leave``: the call is not one made from inside another (a read
        from a step's callback is)."""
        return self._depth == 1


def exclusive(method=None, *, changes_state: bool = True, returns_handle: bool = False):
    """Run a Session method as a transaction: holding its engine's gate, with Ctrl-C held back
    (see the module docstring). ``changes_state=False``: a read that must not overlap a step of
    another thread but may run inside a step of its own (a check from a callback).
    ``returns_handle``: the call hands back a new object the caller must get (a fork), so a
    Ctrl-C that lands after its commit becomes a warning instead of losing the object."""
    if method is None:
        return functools.partial(exclusive, changes_state=changes_state, returns_handle=returns_handle)
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        gate = None if getattr(self, "_closed", False) else getattr(self._engine, "calls", None)
        if gate is None:                                    # a closed session: the call says so
            return method(self, *args, **kwargs)
        held = hold_interrupts()
        try:
            gate.enter(name, changes_state=changes_state)
            try:
                if self._engine.dropped and gate.outermost:   # forks garbage-collected with live requests;
                    self._engine.collect_dropped()             # never inside a step, whose commit would undo it
                return method(self, *args, **kwargs)
            finally:
                gate.leave()
        finally:
            release_interrupts(held, name if returns_handle else None)
    return call


class SessionSteps:
    """``prefill``, ``decode_step``, ``sample``, ``step``: the Session's transactions."""

    @exclusive
    def prefill(self, requests=None) -> StepResult:
        """One prefill step over waiting/prefilling requests (default: all, in arrival order;
        a request named twice runs once)."""
        check_not_pending(self._last_step(), "prefill", self._requests)
        if requests is None:
            cands = [r for r in self._requests.values() if r.status in (WAITING, PREFILLING)]
        else:
            if isinstance(requests, (Request, int)):
                requests = [requests]
            picked = {}
            for r in requests:
                req = self.request(r.id if isinstance(r, Request) else r)
                picked.setdefault(req.id, req)
            cands = list(picked.values())
            bad = [r for r in cands if r.status not in (WAITING, PREFILLING)]
            if bad:
                raise InvalidRequestError(f"cannot prefill request {bad[0].id}: it is {bad[0].status}")

        def plan(draft):
            return "prefill", self._scheduler.prefill_rows(draft, list(self._requests.values()), cands)
        return self._transact(plan, "prefill", sample=False)

    @exclusive
    def decode_step(self) -> StepResult:
        """One runtime-batch decode step over every decoding request. The drafts ``propose()``
        staged are verified in it (kind "verify": each such row computes its last token and its
        drafts); ``sample()`` then keeps the accepted ones and rolls the rest back."""
        check_not_pending(self._last_step(), "decode", self._requests)
        if not any(r.status == DECODING for r in self._requests.values()):
            raise InvalidRequestError(self._nothing_to_run("decode"))

        def plan(draft):
            return step_kind(self._decode_rows(draft, fresh=False))
        return self._transact(plan, "decode", sample=False)

    def _decode_rows(self, draft, *, fresh: bool) -> list[tuple]:
        """Every decode row, with drafts when the session speculates (``fresh``: proposed now)."""
        rows = [(r, 1) for r in self._scheduler.decode_rows(draft, list(self._requests.values()))]
        return self._drafts(draft, rows, self.config.chunk_size - len(rows), fresh=fresh)

    def _drafts(self, draft, rows: list[tuple], budget: int, *, fresh: bool) -> list[tuple]:
        if self.config.speculative is None:
            return rows
        return speculative.attach_drafts(draft, rows, budget, self.config, fresh=fresh)

    def speculation_stats(self):
        """The speculation counts of this session's requests together (``SpecStats``: drafts
        verified and accepted, per draft position)."""
        return speculative.speculation_stats(self._requests.values())

    @exclusive
    def propose(self) -> dict[int, tuple[int, ...]]:
        """Stage the drafter's drafts on every decoding request (``speculative="ngram"``) and
        return them by request id; the next ``decode_step()`` verifies them. A transaction:
        drafts are request state (``draft_token_ids``), never computed tokens."""
        if self.config.speculative is None:
            raise InvalidRequestError("cannot propose: this session does not speculate; make it with "
                                      "Session.from_pretrained(..., speculative='ngram')")
        check_not_pending(self._last_step(), "propose", self._requests)
        decoding = [r for r in self._requests.values() if r.status == DECODING]
        if not decoding:
            raise InvalidRequestError(self._nothing_to_run("propose"))
        draft = StepDraft(self._engine.manager, self._requests)
        out = {}
        for r in decoding:
            d = draft.of(r)
            d.draft_token_ids = out[r.id] = speculative.propose(d, self.config)
        commit(self._engine, Commit(draft=draft, session=self))
        return out

    def _last_step(self) -> StepResult | None:
        return self.history[-1] if self.history else None

    def _transact(self, schedule, action: str, *, sample: bool, force=None) -> StepResult:
        return run_step(self, schedule, action, sample=sample, force=force)

    def _visible_requests(self) -> dict:
        """Every branch's requests, and those of branches dropped since the last call (they hold
        their blocks until the next call aborts them)."""
        engine = self._engine
        if engine.branches is None:
            return self._requests
        out = engine.branches.requests()
        for dropped in engine.dropped:
            out.update(dropped)
        return out

    def _nothing_to_run(self, kind: str) -> str:
        by = collections.Counter(r.status for r in self._requests.values())
        state = ", ".join(f"{n} {s}" for s, n in by.items()) or "no requests"
        msg = f"nothing to {kind}: {state}" + ("; add a request first" if not by else "")
        if (by.get(WAITING) or by.get(DECODING) or by.get(PREFILLING)) and self._engine.branches is not None:
            from .fork import sibling_holders
            msg += sibling_holders(self)
        return msg

    @exclusive
    def sample(self, step: StepResult | None = None, *, force=None) -> torch.Tensor:
        """Sample one token per logits row of ``step`` (default: the last) on the device.

        ``force`` teacher-forces instead: a list with one token id per logits row, or a dict
        request id -> token id (rows not named are sampled as usual).
        """
        last = self._last_step()
        step = step if step is not None else last
        if step is None:
            raise InvalidRequestError("nothing to sample: no step has run yet")
        if step is not last:
            raise InvalidRequestError(f"cannot sample step {step.index}: only the last step "
                                      f"({last.index}) can be sampled")
        if step.sampled_tokens is not None:
            raise InvalidRequestError(f"step {step.index} was already sampled")
        if step.logits is None:
            raise InvalidRequestError(f"step {step.index} produced no logits (no row finished its prompt)")
        if step.logits.is_stale:
            raise StaleOutputError(f"cannot sample step {step.index}: its logits were overwritten by a step "
                                   f"of another branch sharing this cache")
        if force is not None and step.plan.num_drafts:
            raise InvalidRequestError(f"cannot force step {step.index}: it verifies drafts of requests "
                                      f"{sorted(step.drafts)}; teacher-force a step without drafts")
        if force is not None:
            force = self._forced(step, force)
        return sample_step(self, step, force)

    def _forced(self, step: StepResult, force) -> dict[int, int]:
        ids = step.logits_request_ids
        if isinstance(force, dict):
            unknown = sorted(set(force) - set(ids))
            if unknown:
                raise InvalidRequestError(f"force names requests {unknown} that have no logits row in step {step.index}")
            out = {int(k): int(v) for k, v in force.items()}
        else:
            force = list(force)
            if len(force) != len(ids):
                raise InvalidRequestError(f"force has {len(force)} tokens but step {step.index} has {len(ids)} logits rows")
            out = {rid: int(t) for rid, t in zip(ids, force)}
        bad = {k: v for k, v in out.items() if not 0 <= v < self.model_config.vocab_size}
        if bad:
            raise InvalidRequestError(f"forced tokens outside the vocabulary: {bad}")
        return out

    @exclusive
    def step(self) -> StepResult:
        """Schedule, run and sample one step. Separate steps (the default): prefill when a prompt
        can make progress, else decode. With ``mixed_steps=True``: decode rows first, then prefill
        chunks in the rest of the token budget, in one forward (kind "mixed" when both are there).
        One transaction: forward and sampling commit together or not at all."""
        check_not_pending(self._last_step(), "step", self._requests)
        mixed = self.config.mixed_steps

        def plan(draft):
            cands = [r for r in self._requests.values() if r.status in (WAITING, PREFILLING)]
            if mixed:
                return step_kind(self._scheduler.mixed_rows(
                    draft, list(self._requests.values()), cands,
                    None if self.config.speculative is None else
                    lambda rows, budget: self._drafts(draft, rows, budget, fresh=True)))
            rows = self._scheduler.prefill_rows(draft, list(self._requests.values()), cands)
            if rows:
                return "prefill", rows
            return step_kind(self._decode_rows(draft, fresh=True))
        return self._transact(plan, "step", sample=True)


def step_kind(rows: list[tuple]) -> tuple[str, list[tuple]]:
    """(kind, rows) for the rows of a mixed plan: "mixed" when decoding and prefilling rows share
    the step, else the one kind they all have ("verify" for decode rows of which some carry drafts)."""
    decoding = sum(r.status == DECODING for r, _ in rows)
    kind = "decode" if decoding == len(rows) else "prefill" if decoding == 0 else "mixed"
    if kind == "decode" and any(n > 1 for _, n in rows):
        kind = "verify"
    return kind, rows
