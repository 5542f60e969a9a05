"""The steps of a Session, each one transaction (mixed into ``Session``).

    plan (a StepDraft) ─> validate ─> dispatch (+ sampling) ─> commit ─> warnings

``prefill``, ``decode_step`` and ``step`` plan their rows on a draft of the cache manager and
the requests; ``sample`` stages its tokens on one. Only ``Commit.apply`` changes the Session
(see ``engine/transaction.py``), so a call that raises before it leaves everything as it was.
"""
from __future__ import annotations

import collections
import time

import torch

from .engine.calls import exclusive
from .engine.commit import Commit
from .engine.draft import StepDraft
from .engine.engine import check_not_pending
from .engine.outputs import StepResult
from .engine.plan import build_plan
from .engine.request import DECODING, PREFILLING, WAITING, Request
from .engine.transaction import fault_point
from .errors import InvalidRequestError, StaleOutputError


class SessionSteps:
    """``prefill``, ``decode_step``, ``sample``, ``step``: the Session's transactions."""

    @exclusive
    def prefill(self, requests=None) -> StepResult:
        """One prefill step over waiting/prefilling requests (default: all, in arrival order;
        a request named twice runs once)."""
        self._engine.collect_dropped()
        check_not_pending(self.last_step, "prefill", self._requests)
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
            return "prefill", self._scheduler.prefill_rows(draft, self.requests, cands)
        return self._transact(plan, "prefill", sample=False)

    @exclusive
    def decode_step(self) -> StepResult:
        """One runtime-batch decode step over every decoding request."""
        self._engine.collect_dropped()
        check_not_pending(self.last_step, "decode", self._requests)
        if not any(r.status == DECODING for r in self._requests.values()):
            raise InvalidRequestError(self._nothing_to_run("decode"))

        def plan(draft):
            return "decode", [(r, 1) for r in self._scheduler.decode_rows(draft, self.requests)]
        return self._transact(plan, "decode", sample=False)

    def _transact(self, schedule, action: str, *, sample: bool, force=None) -> StepResult:
        """One step as a transaction: plan on a draft, validate, dispatch, commit (see module doc)."""
        t0 = time.perf_counter()
        draft = StepDraft(self._engine.manager, self._requests)
        kind, rows = schedule(draft)
        fault_point("planned")
        if not rows:
            raise InvalidRequestError(self._nothing_to_run(action))
        cfg = self.config
        pad = cfg.max_batch if kind == "decode" and cfg.decode_padding == "replicate" else None
        tables = {r.id: draft.manager.block_table(r.id) for r, _ in rows}
        plan = build_plan(kind, self._step_index, rows, tables, cfg.block_size, pad_to=pad)
        timings = {"schedule": time.perf_counter() - t0}
        step, commit = self._engine.run(plan, draft, self._visible_requests(), timings)
        try:
            if sample and step.logits is not None:
                self._engine.sample(step, draft, self._generators, commit, force=force)
        except BaseException:
            commit.abandon()
            raise
        commit.then.append(lambda: self.history.append(step))
        commit.then.append(self._advance)
        commit.apply(self._generators, stacklevel=5)     # warnings point at the caller of step()
        return step

    def _advance(self) -> None:
        self._step_index += 1

    def _visible_requests(self) -> dict:
        branches = self._engine.branches
        return self._requests if branches is None else branches.requests()

    def _nothing_to_run(self, kind: str) -> str:
        by = collections.Counter(r.status for r in self._requests.values())
        state = ", ".join(f"{n} {s}" for s, n in by.items()) or "no requests"
        msg = f"nothing to {kind}: {state}" + ("; add a request first" if not by else "")
        if (by.get(WAITING) or by.get(DECODING) or by.get(PREFILLING)) and self._engine.branches is not None:
            from .session_fork import sibling_holders
            msg += sibling_holders(self)
        return msg

    @exclusive
    def sample(self, step: StepResult | None = None, *, force=None) -> torch.Tensor:
        """Sample one token per logits row of ``step`` (default: the last) on the device.

        ``force`` teacher-forces instead: a list with one token id per logits row, or a dict
        request id -> token id (rows not named are sampled as usual).
        """
        step = step if step is not None else self.last_step
        if step is None:
            raise InvalidRequestError("nothing to sample: no step has run yet")
        if step is not self.last_step:
            raise InvalidRequestError(f"cannot sample step {step.index}: only the last step "
                                      f"({self.last_step.index}) can be sampled")
        if step.token_ids is not None:
            raise InvalidRequestError(f"step {step.index} was already sampled")
        if step.logits is None:
            raise InvalidRequestError(f"step {step.index} produced no logits (no row finished its prompt)")
        if step.logits.is_stale:
            raise StaleOutputError(f"cannot sample step {step.index}: its logits were overwritten by a step "
                                   f"of another branch sharing this cache")
        if force is not None:
            force = self._forced(step, force)
        draft = StepDraft(self._engine.manager, self._requests)
        commit = Commit(self._engine, draft)
        ids = self._engine.sample(step, draft, self._generators, commit, force=force)
        commit.apply(self._generators, stacklevel=4)    # the caller of sample()
        return ids

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
        self._engine.collect_dropped()
        check_not_pending(self.last_step, "step", self._requests)
        mixed = self.config.mixed_steps

        def plan(draft):
            cands = [r for r in self._requests.values() if r.status in (WAITING, PREFILLING)]
            if mixed:
                return step_kind(self._scheduler.mixed_rows(draft, self.requests, cands))
            rows = self._scheduler.prefill_rows(draft, self.requests, cands)
            if rows:
                return "prefill", rows
            return "decode", [(r, 1) for r in self._scheduler.decode_rows(draft, self.requests)]
        return self._transact(plan, "step", sample=True)


def step_kind(rows: list[tuple]) -> tuple[str, list[tuple]]:
    """(kind, rows) for the rows of a mixed plan: "mixed" when decoding and prefilling rows share
    the step, else the one kind they all have."""
    decoding = sum(r.status == DECODING for r, _ in rows)
    kind = "decode" if decoding == len(rows) else "prefill" if decoding == 0 else "mixed"
    return kind, rows
