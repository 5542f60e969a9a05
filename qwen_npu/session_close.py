"""``sess.close()``: give a Session's device memory back (weights, KV cache, buffers, live logits).

Afterwards its engine, scheduler and model are a ``ClosedSession``, which raises on any use.
"""
from __future__ import annotations

import gc

import torch

from . import device as devices
from .errors import InvalidRequestError


class ClosedSession:
    """Stands in for a closed session's engine, scheduler and model: any use raises."""

    def __getattr__(self, name):
        raise InvalidRequestError("session is closed: its model, KV cache and buffers were freed; "
                                  "create a new one with Session.from_pretrained")


def close_session(sess) -> None:
    """Free the session's device memory (weights, KV cache, buffers, live logits). Idempotent.
    Closing the session that owns the cache closes every branch forked from it with it; closing
    a fork (``branch.close()``) aborts only that branch's requests and frees only their blocks."""
    if getattr(sess, "_closed", False):
        return
    if not getattr(sess, "_owns_engine", True):
        from .session_fork import close_branch
        close_branch(sess)                 # a branch frees only its own requests' blocks
        for step in sess.history:
            step.hidden = None
        sess.history.clear()
        sess._generators.clear()
        closed = ClosedSession()
        sess._engine = sess._scheduler = sess.model = closed
        sess._closed = True
        return
    engine, model = sess._engine, sess.model
    dev = model.device
    branches = engine.branches.sessions() if getattr(engine, "branches", None) is not None else []
    sessions = [sess] + [b for b in branches if b is not sess]
    for s in sessions:
        for step in s.history:
            step.hidden = None
        s.history.clear()
    for buf in engine.buffers._outputs.values():
        buf.generation += 1                     # live DeviceLogits handles now raise instead of reading
        buf.tensor = torch.empty(0)
    engine.buffers.tensors.clear()
    engine.kv_cache.keys.clear()
    engine.kv_cache.values.clear()
    for name, value in list(vars(model).items()):
        if isinstance(value, torch.Tensor):
            setattr(model, name, None)
    model.layers = []
    closed = ClosedSession()
    for s in sessions:
        s._generators.clear()
        s._engine = s._scheduler = s.model = closed
        s._closed = True
    del engine, model, sessions, branches
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    elif dev.type == "npu":
        devices.load_torch_npu()
        torch.npu.empty_cache()
