"""Which requests run in the next step, and with how many tokens. No tensors here.

Policy (continuous batching with chunked prefill):

* At most ``max_batch`` requests are admitted (prefilling or decoding) at once.
* A prefill step takes waiting/prefilling requests in arrival order; all its rows together
  compute at most ``chunk_size`` tokens, so a long prompt is split over several steps.
* A decode step takes every decoding request: one token each.
* When a running request needs a block and none is free, the most recently added running
  request is preempted: its blocks are freed and it waits again, keeping its tokens, to be
  recomputed later. Waiting requests are only admitted when their blocks are free.
* Older requests come first: a request only ever preempts requests added after it (a decoding
  request that is itself the newest preempts itself; a prefilling one skips the step, keeping
  its blocks). So the oldest running request always makes progress, and since every request
  alone fits in the cache, every request finishes while steps continue.
* A waiting request whose prompt starts with full blocks that a row of this step is computing
  waits for the next step, where it finds them in the prefix cache instead of computing them
  again; it stops admission for the step, like a request that finds no room.
* A waiting request that finds no room stops admission for the step (later arrivals must not
  overtake it), and so does a preemption (a request just preempted is not taken back in the same
  step); requests already prefilling still get their chunks.

Mixed steps (``mixed_steps=True``, used by ``step()`` and ``generate()``): one step takes every
decoding request first (one token each, as a decode step would, preempting the same way), then
fills what is left of the ``chunk_size`` token budget with prefill chunks, planned as a prefill
step would plan them (a preemption by a decode row stops admission for the step, as above). So
running requests keep decoding while newcomers prefill. When the decode rows alone use the
whole budget (more decoding requests than ``chunk_size`` tokens), the step is a plain decode step
and newcomers wait until a running request finishes.
"""
from __future__ import annotations

from .transaction import RUNNING, StepDraft, preempt
from .request import DECODING, PREFILLING, WAITING


class Scheduler:
    """Plans rows on a ``StepDraft``: admissions, allocations and preemptions change only the
    draft (its request drafts and its manager clone), never the live state."""

    def __init__(self, *, max_batch: int, chunk_size: int):
        self.max_batch = max_batch
        self.chunk_size = chunk_size

    @staticmethod
    def running(requests) -> list:
        return [r for r in requests if r.status in RUNNING]

    def prefill_rows(self, draft: StepDraft, requests, candidates, *, rows: list[tuple] | None = None,
                     admitting: bool = True) -> list[tuple]:
        """Admit and size the rows of a prefill step. May preempt (see module docstring).

        ``rows``: rows already planned for this step (a mixed step's decode rows), which use the
        budget first and may be preempted like any running request newer than a prefilling one.
        ``admitting``: False once a waiting request found no room or one was preempted (then no
        waiting request is admitted in this step).
        """
        rows = list(rows or [])
        if not candidates:
            return rows
        requests, candidates = draft.all(requests), draft.all(candidates)
        manager = draft.manager
        budget = self.chunk_size - sum(n for _, n in rows)
        num_running = len(self.running(requests))
        for req in candidates:
            if len(rows) == self.max_batch or budget == 0:
                break
            if req.status == WAITING:
                if not admitting or num_running >= self.max_batch:
                    continue
                if self._computes_shared_prefix(manager, req, rows):
                    admitting = False        # next step it finds those blocks cached
                    continue
                n = self._admit(manager, req, budget, draft.prefix_limit(req.id))
                if n == 0:
                    admitting = False        # no room: later arrivals must not overtake it
                    continue
                num_running += 1
            elif req.status == PREFILLING and req.num_computed_tokens < req.num_tokens:
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                while not manager.allocate(req.id, req.num_computed_tokens + n):
                    victim = self._victim(requests, newer_than=req)
                    if victim is None:
                        n = 0                # it is the newest: it waits, keeping its blocks
                        break
                    preempt(draft, victim)
                    admitting, num_running = False, num_running - 1
                    budget += sum(k for r, k in rows if r is victim)
                    rows = [(r, k) for r, k in rows if r is not victim]
                if n == 0:
                    continue
            else:
                continue
            rows.append((req, n))
            budget -= n
        return rows

    def mixed_rows(self, draft: StepDraft, requests, candidates, drafts=None) -> list[tuple]:
        """The rows of a mixed step: every decode row, then prefill chunks in the budget left.
        May preempt (see module docstring). ``drafts(rows, budget) -> rows``: speculative decoding
        grows the decode rows by their drafts (``speculative.attach_drafts``) before the chunks."""
        before = {r.id: draft.of(r).num_preemptions for r in requests}
        rows = [(r, 1) for r in self.decode_rows(draft, requests)]
        if drafts is not None:
            rows = drafts(rows, self.chunk_size - len(rows))
        if sum(n for _, n in rows) >= self.chunk_size:
            return rows
        preempted = any(draft.of(r).num_preemptions != before[r.id] for r in requests)
        return self.prefill_rows(draft, requests, candidates, rows=rows, admitting=not preempted)

    @staticmethod
    def _computes_shared_prefix(manager, req, rows) -> bool:
        """Does a row of this step compute a full block that ``req``'s prompt starts with too?

        Such a block is published when the step ends; admitting ``req`` in the same step would
        compute it a second time instead of reusing it.
        """
        if not rows or not manager.enable_prefix_cache:
            return False
        size = manager.block_size
        tokens = req.all_token_ids
        cached = manager.cached_prefix_tokens(tokens)
        shareable = (len(tokens) - 1) // size * size   # the blocks match_prefix may take
        for row, n in rows:
            end = min(shareable, (row.num_computed_tokens + n) // size * size)
            if end > max(cached, row.num_computed_tokens) and tokens[:end] == row.all_token_ids[:end]:
                return True
        return False

    @staticmethod
    def _admit(manager, req, budget: int, limit: int | None) -> int:
        """Take a waiting request in: reuse its cached prefix (at most ``limit`` tokens of it),
        allocate its first chunk."""
        cached = manager.match_prefix(req.id, req.all_token_ids, limit)
        n = min(req.num_tokens - cached, budget)
        if not manager.allocate(req.id, cached + n):
            manager.free(req.id)
            return 0
        req.num_computed_tokens = cached
        req.num_cached_tokens = cached
        req.status = PREFILLING
        return n

    def decode_rows(self, draft: StepDraft, requests) -> list:
        """Every decoding request, each with a block for its next token. May preempt."""
        requests = draft.all(requests)
        rows: list = []
        for req in [r for r in requests if r.status == DECODING]:
            if req.status != DECODING:
                continue                      # preempted by an earlier row of this loop
            ok = True
            while not draft.manager.allocate(req.id, req.num_tokens):
                victim = self._victim(requests)
                preempt(draft, victim)
                if victim is req:
                    ok = False
                    break
                if victim in rows:
                    rows.remove(victim)
            if ok:
                rows.append(req)
        return rows

    @staticmethod
    def _victim(requests, newer_than=None):
        """The most recently added running request (added after ``newer_than``, when given)."""
        for r in reversed(requests):
            if r is newer_than:
                return None
            if r.status in RUNNING:
                return r
        return None
