"""The commit phase of a step: the one place a step changes the Session's state.

A ``Commit`` collects what the earlier phases computed (the step's draft, its ledger writes,
which output buffers it filled, its sampled tokens, what the Session adds to its history) and
``apply`` publishes all of it with plain assignments while Ctrl-C is held back. Warnings about
the step (stream health, EMULATED faults) are raised only afterwards, when the state is whole,
so a warning turned into an error never leaves a step half applied.
"""
from __future__ import annotations

import warnings

from .transaction import deferred_interrupts, fault_point


class StreamHealthWarning(UserWarning):
    """A row's logits are all zero, all equal or non-finite: its stream is broken."""


class Commit:
    def __init__(self, engine, draft):
        self.engine = engine
        self.draft = draft
        self.guard = None           # KVGuard of the dispatch (restored if the commit is abandoned)
        self.ledger = None          # LedgerWrites
        self.outputs = None         # kind of the output buffers the dispatch filled
        self.step_index = None
        self.sampled = None         # (step, tokens, health, h2d, d2h, seconds)
        self.then: list = []        # the Session's own plain assignments (history, step counter)

    def abandon(self) -> None:
        """Give the K/V that committed state points to back (the step failed before commit)."""
        if self.guard is not None:
            self.guard.restore()

    def apply(self, generators: dict, *, stacklevel: int = 3) -> None:
        """Publish the step; a failure before the assignments start changes nothing."""
        e = self.engine
        try:
            collisions = self.ledger.collisions if self.ledger is not None else []
            emulate = e.faults is not None and bool(collisions)
            hook = getattr(e.hook, "commit_step", None) if self.outputs is not None else None
            fault_point("commit")
        except BaseException:
            self.abandon()
            raise
        faults = []
        with deferred_interrupts():
            self.draft.apply(generators)
            if self.ledger is not None:
                e.ledger.apply(self.ledger)
            if self.outputs is not None:
                e.buffers.publish(self.outputs)
            if self.sampled is not None:
                step, tokens, health, h2d, d2h, seconds = self.sampled
                step.token_ids, step.health = tokens, health
                step.transfers["h2d"] += h2d
                step.transfers["d2h"] += d2h
                step.timings["sample"] = seconds
            if hook is not None:
                hook(self.step_index)
            for fn in self.then:
                fn()
            if emulate:
                faults = e.faults.apply(self.step_index, collisions, e.kv_cache, warn=False)
        after = getattr(e.hook, "after_commit", None) if hook is not None else None
        if after is not None:
            after()                    # user callbacks (streamed captures), with the state whole
        if faults:
            from .faults import warn_faults
            warn_faults(faults, stacklevel=stacklevel)
        if self.sampled is not None and self.sampled[2]:
            step, health = self.sampled[0], self.sampled[2]
            warnings.warn(f"step {step.index}: " + "; ".join(f"request {rid}: {why}" for rid, why in health),
                          StreamHealthWarning, stacklevel=stacklevel)
