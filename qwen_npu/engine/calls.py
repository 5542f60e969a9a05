"""One call at a time on an engine, across threads.

Notebook front ends may run widget callbacks on a thread other than the one running cells
(JupyterLab's kernel subshells do), so an explorer button can fire while a cell is still in the
middle of ``generate``. Steps are transactions against one state; two threads interleaving them
would each plan against a state the other is changing. So every state-changing Session call
passes through its engine's ``CallGate``: the thread that holds it may re-enter (``generate``
calls ``step``), any other thread is refused at once with ``SessionBusyError`` naming the call and
the thread that runs it — it never waits, so nothing can hang on a forgotten cell. Forks share
their parent's engine, and so its gate.
"""
from __future__ import annotations

import functools
import threading

from ..errors import SessionBusyError


class CallGate:
    """A re-entrant, never-waiting lock with the name of the outermost call that holds it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self.holder: tuple[str, str] | None = None     # (thread name, call) of the outermost call

    def enter(self, call: str) -> None:
        if not self._lock.acquire(blocking=False):
            thread, running = self.holder or ("another thread", "a call")
            raise SessionBusyError(
                f"cannot run {call}(): {running}() of this session (or a fork sharing its KV cache) is "
                f"running in thread {thread!r}; wait for it to finish (nothing was changed)")
        if self._depth == 0:
            self.holder = (threading.current_thread().name, call)
        self._depth += 1

    def leave(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.holder = None
        self._lock.release()


def exclusive(method):
    """Run a Session method holding its engine's gate (see the module docstring)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if getattr(self, "_closed", False):             # a closed session has no engine: the call says so
            return method(self, *args, **kwargs)
        gate = getattr(self._engine, "calls", None)
        if gate is None:
            return method(self, *args, **kwargs)
        gate.enter(name)
        try:
            return method(self, *args, **kwargs)
        finally:
            gate.leave()
    return call
