"""Ctrl-C during a Session call: held back for the whole call, landing only where it is safe.

A Ctrl-C that arrives while the call holds it back is kept and raised when the call ends (the
state is then "as after"), or at once when the call next enters an ``interruptible`` region
(the forward), inside the region whose failure restores the K/V (the state is then "as
before"). Raising there closes the region first, so the code that cleans up after it runs with
Ctrl-C held back again. A process that ignores SIGINT keeps ignoring it. Only the main thread
receives signals. The handler is read and set through ``_signal``, the C module under ``signal``:
the same calls without ``signal``'s conversion of handlers to enums, which costs more than the
rest of a call's hold and release together.
"""
from __future__ import annotations

import _signal
import contextlib
import signal
import threading

from ..errors import warn


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

    def interruptible(self) -> "_Interruptible":
        """A region where Ctrl-C lands at once (one held back before it lands on entry)."""
        return _Interruptible(self)


class _Interruptible:
    """``HeldInterrupts.interruptible``'s region: opened on entry, closed on every way out. (A
    class, not a generator: it is entered once per step, where a generator's machinery costs
    several times as much.) A Ctrl-C that lands once ``open`` is set closes the region itself
    (``HeldInterrupts.__call__``), so a raise from ``__enter__`` leaves it closed."""

    __slots__ = ("held",)

    def __init__(self, held: HeldInterrupts):
        self.held = held

    def __enter__(self) -> None:
        held = self.held
        held.open = True
        if held.pending:
            held.pending = False
            held(signal.SIGINT, None)

    def __exit__(self, *exc) -> bool:
        self.held.open = False
        return False


def hold_interrupts():
    """Install the holding handler for an outermost call on the main thread (None otherwise)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    current = _signal.getsignal(signal.SIGINT)
    if isinstance(current, HeldInterrupts) or current is None:
        return None                              # a call inside a call, or a handler not set from Python
    held = HeldInterrupts(current)
    _signal.signal(signal.SIGINT, held)
    return held


def release_interrupts(held, keeps: str | None = None) -> None:
    """Give the previous handler back; deliver a Ctrl-C held back since the commit (as a
    warning for a call that ``keeps`` what it made)."""
    if held is None:
        return
    if keeps is None:
        _signal.signal(signal.SIGINT, held.previous)
        if held.pending:
            held.deliver()
        return
    if held.pending:
        warn(f"Ctrl-C arrived as {keeps}() finished; what it made is kept and returned", RuntimeWarning)
    # A call that hands back a new object never raises from here: the previous handler goes back
    # on the last line that runs, so a Ctrl-C after it lands in the caller's code, with the object
    # in hand (one on this very line is held back and not raised).
    _signal.signal(signal.SIGINT, held.previous)


class _NoSignals:
    """Stands in for ``HeldInterrupts`` off the main thread, where no signal arrives."""

    def checkpoint(self) -> None:
        pass

    def interruptible(self):
        return contextlib.nullcontext()


NO_SIGNALS = _NoSignals()


def held_interrupts():
    """The handler of the call in progress (a no-op stand-in off the main thread or outside a call)."""
    if threading.current_thread() is not threading.main_thread():
        return NO_SIGNALS
    handler = _signal.getsignal(signal.SIGINT)
    return handler if isinstance(handler, HeldInterrupts) else NO_SIGNALS
