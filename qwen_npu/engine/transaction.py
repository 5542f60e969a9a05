"""Steps as transactions: the phases of a step and the tools that keep them apart.

    plan ──> validate ──> dispatch ──────────────> commit ─────────> warn
    (draft)  (slot        (forward + sampling on     (apply: plain      (warnings, once the
     pure     checks)      the device; writes only    assignments,       state is consistent)
                           plan-owned K/V slots and   Ctrl-C deferred)
                           spare output buffers)

Anything raised before ``commit`` — an error, ``KeyboardInterrupt``, a warning turned into an
error — leaves the Session exactly as it was: the draft is dropped, and K/V slots that committed
state still points to and that the dispatch overwrote (blocks the plan took from the prefix cache
or from a preempted request) are restored from the copy ``KVGuard`` made before the forward.

``fault_point(name)`` marks the places a test may raise at (``inject_faults``); with no injector
set it costs one global lookup.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Sequence

import torch

_injector: Callable[[str], None] | None = None


def fault_point(name: str) -> None:
    """A named point between or inside the phases of a step (for fault-injection tests)."""
    if _injector is not None:
        _injector(name)


@contextlib.contextmanager
def inject_faults(fn: Callable[[str], None]):
    """Call ``fn(point name)`` at every ``fault_point`` while the block runs; ``fn`` may raise."""
    global _injector
    previous, _injector = _injector, fn
    try:
        yield
    finally:
        _injector = previous


@contextlib.contextmanager
def deferred_interrupts():
    """Hold back Ctrl-C (SIGINT) while a commit applies, and raise it right after.

    Only the main thread receives signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []

    def hold(signum, frame):
        pending.append(signum)

    try:
        previous = signal.signal(signal.SIGINT, hold)
    except (ValueError, TypeError):          # no signal support here (an embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if not pending or previous == signal.SIG_IGN:
        return
    if callable(previous):
        previous(signal.SIGINT, None)              # the default handler raises KeyboardInterrupt
    else:
        raise KeyboardInterrupt


class KVGuard:
    """A copy of the K/V of blocks a dispatch overwrites although committed state points to them.

    Planning may hand a step blocks that the live state still uses: a cached prefix block it
    evicts, or a block of a request it preempts. If the step then fails, those blocks go back to
    their owners, so their K/V must be as it was; ``restore`` copies it back.
    """

    def __init__(self, kv_cache, blocks: Sequence[int]):
        self.kv_cache = kv_cache
        self.blocks = list(blocks)
        self.saved = None
        if self.blocks:
            index = torch.tensor(self.blocks, dtype=torch.int64, device=kv_cache.keys[0].device)
            self.index = index
            self.saved = [t.index_select(0, index) for t in kv_cache.keys + kv_cache.values]

    def restore(self) -> None:
        if self.saved is None:
            return
        for t, s in zip(self.kv_cache.keys + self.kv_cache.values, self.saved):
            t.index_copy_(0, self.index, s)
