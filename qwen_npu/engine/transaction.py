"""Every state-changing Session call is a transaction: one call at a time, Ctrl-C only where it
is safe, and the K/V that committed state points to given back if the call fails.

    call ──> gate: one thread at a time (another is refused at once: SessionBusyError)
             Ctrl-C held back for the whole call ──────────────────────────────────┐
               plan, check (pure)                                                  │
               forward ── the one place Ctrl-C lands at once (``interruptible``) ──┤
               book, sample (on copies)          any way out: KVGuard.restore()    │
               commit (plain assignments)                                          │
             held-back Ctrl-C raised once the call is over, the state whole <──────┘

A Ctrl-C that arrives while the call holds it back is kept and raised when the call ends (the
state is then "as after"), or at once when the call next enters an ``interruptible`` region
(the forward), inside the region whose failure restores the K/V (the state is then "as
before"). Raising there closes the region first, so the code that cleans up after it runs with
Ctrl-C held back again. A process that ignores SIGINT keeps ignoring it.

Only the main thread receives signals: elsewhere the gate still serialises calls and nothing
else changes. ``fault_point(name)`` marks places a test may raise at (``inject_faults``).
"""
from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Sequence

import torch

from ..errors import InvalidRequestError, SessionBusyError, warn

_injector: Callable[[str], None] | None = None


def fault_point(name: str) -> None:
    """A named point between the phases of a call (for fault-injection tests)."""
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


class HeldInterrupts:
    """The SIGINT handler while a call runs: holds Ctrl-C back, except in ``interruptible`` regions."""

    def __init__(self, previous):
        self.previous = previous      # the handler to give back (and to deliver a held Ctrl-C to)
        self.pending = False
        self.open = False             # inside an interruptible region

    def __call__(self, signum, frame) -> None:
        if self.open:
            self.open = False         # whatever runs next (the clean-up) holds Ctrl-C back again
            self.deliver(frame)
        else:
            self.pending = True

    def deliver(self, frame=None) -> None:
        """Act on a Ctrl-C as the process would without us (raise, call its handler, or ignore)."""
        previous = self.previous
        if callable(previous):
            previous(signal.SIGINT, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    def checkpoint(self) -> None:
        """The last safe point before a commit: a Ctrl-C held back so far lands here."""
        if self.pending:
            self.pending = False
            self.deliver()

    @contextlib.contextmanager
    def interruptible(self):
        """A region where Ctrl-C lands at once (one held back before it lands on entry)."""
        self.open = True
        try:
            if self.pending:
                self.pending = False
                self(signal.SIGINT, None)
            yield
        finally:
            self.open = False


class _NoSignals:
    """Stands in for ``HeldInterrupts`` off the main thread, where no signal arrives."""

    def checkpoint(self) -> None:
        pass

    @contextlib.contextmanager
    def interruptible(self):
        yield


NO_SIGNALS = _NoSignals()


def held_interrupts():
    """The handler of the call in progress (a no-op stand-in off the main thread or outside a call)."""
    if threading.current_thread() is not threading.main_thread():
        return NO_SIGNALS
    handler = signal.getsignal(signal.SIGINT)
    return handler if isinstance(handler, HeldInterrupts) else NO_SIGNALS


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
        held = _hold()
        try:
            gate.enter(name, changes_state=changes_state)
            try:
                if self._engine.dropped:              # forks garbage-collected with live requests
                    self._engine.collect_dropped()
                return method(self, *args, **kwargs)
            finally:
                gate.leave()
        finally:
            _release(held, name if returns_handle else None)
    return call


def _hold():
    """Install the holding handler for an outermost call on the main thread (None otherwise)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    current = signal.getsignal(signal.SIGINT)
    if isinstance(current, HeldInterrupts) or current is None:
        return None                              # a call inside a call, or a handler not set from Python
    held = HeldInterrupts(current)
    signal.signal(signal.SIGINT, held)
    return held


def _release(held, keeps: str | None = None) -> None:
    """Give the previous handler back; deliver a Ctrl-C held back since the commit (as a
    warning for a call that ``keeps`` what it made)."""
    if held is None:
        return
    signal.signal(signal.SIGINT, held.previous)
    if held.pending and keeps is not None:
        warn(f"Ctrl-C arrived as {keeps}() finished; what it made is kept and returned", RuntimeWarning)
    elif held.pending:
        held.deliver()


class KVGuard:
    """A copy of the K/V of blocks a call overwrites although committed state points to them.

    Planning may hand a step blocks that the live state still uses: a cached prefix block it
    evicts, or a block of a request it preempts. If the step then fails, those blocks go back to
    their owners, so their K/V must be as it was; ``restore`` copies it back.
    """

    def __init__(self, kv_cache, blocks: Sequence[int], buffers=None, kind: str = "decode"):
        """``buffers``: the dispatch buffers whose ``kind`` staging the block index reaches the
        device through (pinned on an accelerator, ``pinned.py``; a plain ``.to`` without them)."""
        self.kv_cache = kv_cache
        self.blocks = list(blocks)
        self.saved = None
        if self.blocks:
            index = torch.tensor(self.blocks, dtype=torch.int64)
            staging = buffers.staging(kind) if buffers is not None else None
            if staging is None:
                index = index.to(kv_cache.keys[0].device)
            else:
                with staging.writing():
                    index = staging.put(index, "guard")
            self.index = index
            self.saved = [t.index_select(0, index) for t in kv_cache.keys + kv_cache.values]

    def restore(self) -> None:
        if self.saved is None:
            return
        for t, s in zip(self.kv_cache.keys + self.kv_cache.values, self.saved):
            t.index_copy_(0, self.index, s)
