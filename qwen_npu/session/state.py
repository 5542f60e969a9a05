"""``sess.state``: the read-only door into a Session's live state.

Modules outside the Session and the engine (inspection, research tools, memory reports,
benchmarks) read the state through this view and never through the Session's private fields,
so every change to the state goes through a step's commit (``engine/transaction.py``)::

    sess.state.manager        block tables, block pool, prefix cache (KVCacheManager)
    sess.state.kv_cache       the K/V tensors          sess.state.ledger    who wrote each slot
    sess.state.buffers        dispatch/output buffers  sess.state.faults    EMULATED fault model
    sess.state.requests       id -> Request (read-only mapping)
    sess.state.generators     id -> torch.Generator of sampled requests (read-only mapping)
    sess.state.step_index     the index the next step gets
    sess.state.branches       the Sessions sharing this cache (forks), or None

The objects are live, not copies: read them, do not change them.
"""
from __future__ import annotations

import types


def _from_engine(name: str, doc: str | None = None) -> property:
    """A read-only property: the session's engine itself (``"engine"``) or one of its attributes."""
    if name == "engine":
        return property(lambda self: self._sess._engine, doc=doc)
    return property(lambda self: getattr(self._sess._engine, name), doc=doc)


class SessionState:
    __slots__ = ("_sess",)

    def __init__(self, sess):
        self._sess = sess

    engine = _from_engine("engine", "The engine (model runner, cache, ledger, hooks) this session runs on; "
                                    "shared by forks.")
    manager = _from_engine("manager")
    kv_cache = _from_engine("kv_cache")
    ledger = _from_engine("ledger")
    buffers = _from_engine("buffers")
    faults = _from_engine("faults")
    hook = _from_engine("hook")
    branches = _from_engine("branches")

    @property
    def requests(self) -> types.MappingProxyType:
        return types.MappingProxyType(self._sess._requests)

    @property
    def generators(self) -> types.MappingProxyType:
        return types.MappingProxyType(self._sess._generators)

    @property
    def step_index(self) -> int:
        return self._sess._step_index

    @property
    def seed_state(self):
        """The state of the stream unseeded sampled requests draw their seeds from."""
        return self._sess._seed_rng.getstate()

    def visible_requests(self) -> dict:
        """The requests a whole-cache check must know: every branch's, or just this session's."""
        return self._sess._visible_requests()

    def __repr__(self) -> str:
        return f"SessionState(step_index={self.step_index}, requests={len(self._sess._requests)})"
