"""What a higher layer lends a lower one, so that every import in the package points down.

A few things a lower object offers are implemented above it: a ``Request``, ``StepResult`` or
snapshot renders itself with the views of ``qwen_npu.inspect``; a Session's ``snapshot()``,
``check()``, ``capture()`` or ``attention()`` live in ``inspect`` and ``research``. Those
modules register each implementation here under a name when they are imported
(``@provides("name")``), and the lower object calls ``implementation("name")``. The package's
``__init__`` imports ``inspect`` and ``research``, so every name is registered before any
object of the package exists.
"""
from __future__ import annotations

from collections.abc import Callable

_IMPLEMENTATIONS: dict[str, Callable] = {}


def provides(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as the implementation of ``name`` (one per name)."""
    def register(fn: Callable) -> Callable:
        have = _IMPLEMENTATIONS.get(name)
        if have is not None and have is not fn and getattr(have, "__qualname__", None) != fn.__qualname__:
            raise ValueError(f"{name!r} is already provided by {have.__module__}.{have.__qualname__}")
        _IMPLEMENTATIONS[name] = fn
        return fn
    return register


def implementation(name: str) -> Callable:
    """The function registered for ``name``; a clear error when no module provided it."""
    fn = _IMPLEMENTATIONS.get(name)
    if fn is None:
        raise LookupError(f"nothing provides {name!r}: import qwen_npu (which loads qwen_npu.inspect "
                          f"and qwen_npu.research) before using it")
    return fn
