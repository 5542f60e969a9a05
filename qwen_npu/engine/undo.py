"""Taking back what scheduling a step did when the step is then refused before dispatch.

Scheduling changes state before a step's plan exists: it admits waiting requests (status,
computed tokens, prefix-cache blocks) and appends blocks for the tokens about to be computed.
When the step is then refused (the slot checks, or any error before the forward returns), the
session restores every request to what this snapshot saw and hands the new blocks back::

    undo = SchedulingUndo(manager, requests)   # before scheduling
    rows = scheduler.prefill_rows(...)         # admits, allocates, maybe preempts
    ... refused ...  -> undo.restore()         # admissions and new blocks taken back

A request preempted by that scheduling stays waiting: its blocks were freed and its K/V is gone,
so it is recomputed later, exactly as after any preemption. Blocks evicted from the prefix cache
to make room stay evicted (a cache miss later, never a wrong token).
"""
from __future__ import annotations

import dataclasses

from ..cache.manager import KVCacheManager
from .request import Request


@dataclasses.dataclass(frozen=True)
class _Saved:
    request: Request
    status: str
    num_computed_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    num_blocks: int | None          # None: the request held no block table


class SchedulingUndo:
    """A snapshot of the unfinished requests' scheduling state and block-table lengths."""

    def __init__(self, manager: KVCacheManager, requests: list[Request]):
        self.manager = manager
        self.saved = [
            _Saved(r, r.status, r.num_computed_tokens, r.num_cached_tokens, r.num_preemptions,
                   len(manager.block_table(r.id)) if manager.has(r.id) else None)
            for r in requests if not r.is_done]

    def restore(self) -> None:
        """Undo admissions and allocations made since the snapshot (not preemptions)."""
        m = self.manager
        for s in self.saved:
            req = s.request
            if req.is_done or req.num_preemptions != s.num_preemptions:
                continue                                   # aborted meanwhile, or preempted
            if s.num_blocks is None:
                m.free(req.id)                             # admitted by this scheduling
            elif m.has(req.id) and len(m.block_table(req.id)) > s.num_blocks:
                m.truncate(req.id, s.num_blocks)
            req.status = s.status
            req.num_computed_tokens = s.num_computed_tokens
            req.num_cached_tokens = s.num_cached_tokens
