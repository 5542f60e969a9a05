"""Pinned host buffers that a step's host-to-device copies go through, on an accelerator.

A copy from ordinary (pageable) host memory to a CUDA or NPU device blocks the host until the
driver has copied it out; from page-locked ("pinned") memory it is queued like a kernel
(``non_blocking=True``) and the host goes on planning the next step. So on a device that is not
the CPU every step copy is written into a pinned buffer allocated once, then copied without
blocking. On the CPU there is nothing to copy: the data is used where it is (no pinning cost).

Two sets of buffers are used in turn, like the output buffers of ``runner.py``: a step writes
the spare set, and its commit publishes it (``publish``, called from ``step.commit`` through
``DispatchBuffers.publish``). A step that fails or is interrupted half way has then written only
the spare set; the set of the last committed step stays as it was. Before a step writes a set it
waits for that set's last copies to have left it (an event recorded after them), so a queued
copy never reads a buffer the host is rewriting::

    step 7 (set 0) fill -> copies queued -> event 0 -> commit: set 0 current
    step 8 (set 1) fill -> ...                      -> commit: set 1 current
    step 9 (set 0) waits for event 0 (long done), fill -> ...

A set is written inside ``writing()``, which waits for it (at most ``WAIT_S`` seconds, then
raises) and records its event on every way out, so a copy queued before an error is waited for
too. A device whose backend has no events does not pin: without an event nothing could say when
a buffer is free again.

``pins(device)`` and ``pinned_empty`` are the one place that decides and allocates; the copy
tests replace them to run a CPU Session as if its device were an accelerator. On the CPU the
dispatch buffers hold no ``PinnedCopies`` at all, and a step never enters this file.
"""
from __future__ import annotations

import contextlib
import time

import torch

from ..errors import DeviceError

WAIT_S = 60.0          # the longest a step waits for its pinned set's previous copies


def pins(device: torch.device) -> bool:
    """Do host-to-device copies to ``device`` go through pinned buffers? (Not on the CPU, nor on
    a backend without events.)"""
    return device.type != "cpu" and _event(device) is not None


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host buffer of ``numel`` elements."""
    return torch.empty(numel, dtype=dtype, pin_memory=True)


def _event(device: torch.device):
    if device.type == "cpu":
        return None
    try:
        return torch.Event(device=device)
    except (RuntimeError, ValueError, TypeError):      # a backend without generic events
        return None


class PinnedCopies:
    """The pinned buffers of one kind of copy (a step kind's dispatch data, or the sampler's), for
    a device that ``pins``: the dispatch buffers make them only there."""

    def __init__(self, device: torch.device, sizes: dict[str, tuple[int, torch.dtype]] | None = None):
        self.device = device
        self.current = 0                       # the set the last committed step wrote
        self._sets: list[dict[str, torch.Tensor]] = [{}, {}]
        self._events = [None, None]
        for name, (numel, dtype) in (sizes or {}).items():
            for s in self._sets:
                s[name] = pinned_empty(numel, dtype)

    @property
    def spare(self) -> int:
        return 1 - self.current

    @contextlib.contextmanager
    def writing(self):
        """Write the spare set: first wait until its previous copies have left it; on every way
        out, record that the copies queued inside have been queued."""
        self._wait(self._events[self.spare])
        try:
            yield self
        finally:
            event = self._events[self.spare] = self._events[self.spare] or _event(self.device)
            if event is not None:
                event.record()

    def _wait(self, event) -> None:
        if event is None or event.query():
            return
        deadline = time.monotonic() + WAIT_S
        while not event.query():
            if time.monotonic() > deadline:
                raise DeviceError(f"{self.device}: copies queued {WAIT_S:.0f} s ago from a pinned "
                                         f"buffer have not left it; the device is not making progress")
            time.sleep(1e-4)

    def publish(self) -> None:
        """The commit of the step that wrote the spare set: it becomes current."""
        self.current = self.spare

    def _buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of the spare set's pinned buffer ``name`` (grown if too small)."""
        spare = self._sets[self.spare]
        buf = spare.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = spare[name] = pinned_empty(max(numel, 2 * (0 if buf is None else buf.numel())), dtype)
        return buf[:numel]

    def copy_into(self, dst: torch.Tensor, values, name: str) -> None:
        """``dst`` set to ``values`` (ints, or rows of ints, of ``dst``'s shape): written into the
        spare pinned buffer ``name`` (no host tensor is made for them), then copied without blocking."""
        view = self._buffer(name, dst.numel(), dst.dtype).view(dst.shape)
        view.numpy()[...] = values
        dst.copy_(view, non_blocking=True)

    def put(self, host: torch.Tensor, name: str) -> torch.Tensor:
        """``host`` on the device, through the spare pinned buffer ``name`` without blocking."""
        view = self._buffer(name, host.numel(), host.dtype).view(host.shape)
        view.copy_(host)
        return view.to(self.device, non_blocking=True)
