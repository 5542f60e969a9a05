"""Fault injection for the step-transaction tests: raise at a named point of a step.

Points are the phase boundaries (``qwen_npu.engine.transaction.fault_point``: planned, validated,
dispatched, booked, sampled, d2h, staged, commit) and every hook point of the forward
(``embed``, ``layers.i.attn.*`` — ``z`` comes after the layer's ``write_kv`` — ``layers.i.mlp.*``,
``final_norm``, ``logits``), named ``fwd:<name>``; the n-th time a point is reached in a call
is ``<point>#n``.
"""
from __future__ import annotations

import contextlib

from qwen_npu.engine.transaction import inject_faults


class _ForwardPoints:
    """Stands in for the engine's step hooks: reports each forward hook point, then delegates."""

    def __init__(self, inner, on_point):
        self.inner = inner              # the engine's StepHooks (a HookSet) or None
        self.on_point = on_point
        self.entries = getattr(inner, "entries", [])

    def begin_step(self, plan):
        return _PointHook(self.inner.begin_step(plan) if self.inner is not None else None, self.on_point)

    def commit_step(self, index):
        if self.inner is not None:
            self.inner.commit_step(index)

    def after_commit(self):
        if self.inner is not None:
            self.inner.after_commit()

    def prefix_limit(self, request_id):
        return self.inner.prefix_limit(request_id) if self.inner is not None else None


class _PointHook:
    """A step's forward hook that wants every point: reports it, then hands it to the inner one."""

    def __init__(self, inner, on_point):
        self.inner, self.on_point = inner, on_point

    def wants(self, name):
        return True

    def __call__(self, name, x):
        self.on_point("fwd:" + name)
        return self.inner(name, x) if self.inner is not None and self.inner.wants(name) else None

    def private_requests(self):
        return self.inner.private_requests() if self.inner is not None else {}


@contextlib.contextmanager
def points(sess, on_point):
    """Call ``on_point(name#n)`` at every phase boundary and forward hook point while inside."""
    engine = sess.state.engine
    seen: dict[str, int] = {}

    def reached(name):
        n = seen[name] = seen.get(name, 0) + 1
        on_point(f"{name}#{n}")

    inner = engine.hook
    engine.hook = _ForwardPoints(inner, reached)
    try:
        with inject_faults(reached):
            yield
    finally:
        engine.hook = inner


def record_points(sess, action):
    """Run ``action(sess)`` for real; returns (its result, the points it reached, in order)."""
    found = []
    with points(sess, found.append):
        out = action(sess)
    return out, found


class Boom(RuntimeError):
    """The ordinary exception the sweep raises."""


def raise_at(sess, action, point: str, exc: type[BaseException]) -> bool:
    """Run ``action`` raising ``exc`` at ``point``; True when it raised there (and was caught)."""
    def on_point(name):
        if name == point:
            raise exc(f"injected at {point}")
    try:
        with points(sess, on_point):
            action(sess)
    except exc:
        return True
    return False
