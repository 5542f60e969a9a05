"""``sess.close()``: give a Session's device memory back (weights, KV cache, buffers, live logits).

Afterwards its engine, scheduler and model are a ``ClosedSession``, which raises on any use.
"""
from __future__ import annotations

import functools
import gc

import torch

from .. import device as devices
from ..engine.step import Commit, commit
from ..errors import InvalidRequestError


class ClosedSession:
    """Stands in for a closed session's engine, scheduler and model: any use raises."""

    def __getattr__(self, name):
        raise InvalidRequestError("session is closed: its model, KV cache and buffers were freed; "
                                  "create a new one with Session.from_pretrained")


def close_session(sess) -> None:
    """Free the session's device memory (weights, KV cache, buffers, live logits). Idempotent.
    Closing the session that owns the cache closes every branch forked from it with it; closing
    a fork (``branch.close()``) aborts only that branch's requests and frees only their blocks.

    A transaction like a step: what to close is worked out first, then one ``commit`` applies
    it (the branch's aborts with it), so an interrupted close leaves the session open and whole."""
    if getattr(sess, "_closed", False):
        return
    engine = sess._engine
    if not getattr(sess, "_owns_engine", True):
        from .fork import branch_closing
        draft, leave = branch_closing(sess)      # a branch frees only its own requests' blocks
        commit(engine, Commit(draft=draft, session=sess, then=(leave, lambda: _closed(sess))))
        return
    model, dev, parallel = sess.model, sess.model.device, engine.parallel
    branches = engine.branches.sessions() if getattr(engine, "branches", None) is not None else []
    sessions = [sess] + [b for b in branches if b is not sess]

    then = (functools.partial(_free, engine, model, sessions),)
    commit(engine, Commit(then=then))
    del then, engine, model, sessions, branches             # the last references: gc frees them
    if parallel is not None:
        parallel.close()                # the other ranks leave the group; no process outlives this
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    elif dev.type == "npu":
        devices.load_torch_npu()
        torch.npu.empty_cache()


def _free(engine, model, sessions) -> None:
    """Plain assignments: drop the engine's tensors and the weights, close every session."""
    for buf in engine.buffers._outputs.values():
        buf.generation += 1                 # live DeviceLogits handles now raise instead of reading
        buf.free()
    engine.buffers.tensors.clear()
    engine.kv_cache.keys.clear()
    engine.kv_cache.values.clear()
    for name, value in list(vars(model).items()):
        if isinstance(value, torch.Tensor):
            setattr(model, name, None)
    model.layers = []
    for s in sessions:
        _closed(s)


def _closed(sess) -> None:
    """Plain assignments: the session forgets its steps and generators and refuses every call."""
    for step in sess.history:
        step.forget_device()
    sess.history.clear()
    sess._generators.clear()
    closed = ClosedSession()
    sess._engine = sess._scheduler = sess.model = closed
    sess._closed = True
