"""Reusing what a kernel derived from one step's inputs across the model's layers.

Every layer of a forward calls the kernels with the same metadata object and the same slot
mapping tensor; index tensors derived from them need building once per step, not once per
layer. ``LastResult`` keeps the last one: it is reused only for the very same object (a weak
reference, so a dead object never matches a new one) whose tensors have not been changed in
place since (their version counters) and with the same ``extra`` key; anything else builds
anew. Tensors made under ``torch.inference_mode`` have no version counter: they always build.
It holds derived data only, replaced by one assignment, so an interrupted build leaves the
previous entry whole. The entry goes when its object does: nothing a step derived outlives the
step (nor a closed Session).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch


class LastResult:
    def __init__(self) -> None:
        self._entry = None          # (weak reference, versions, extra, value)

    def get(self, obj: object, tensors: Sequence[torch.Tensor], extra: tuple, make: Callable):
        """``make()``, or the value it returned for ``obj`` last time if nothing changed since."""
        try:
            versions = tuple(t._version for t in tensors)
        except RuntimeError:        # inference tensors do not track versions
            return make()
        entry = self._entry
        if entry is not None and entry[0]() is obj and entry[1] == versions and entry[2] == extra:
            return entry[3]
        value = make()
        self._entry = (weakref.ref(obj, self._dropped), versions, extra, value)
        return value

    def _dropped(self, ref: weakref.ref) -> None:
        """The object of an entry is gone: so is the entry (unless a newer one replaced it)."""
        entry = self._entry
        if entry is not None and entry[0] is ref:
            self._entry = None

    def clear(self) -> None:
        self._entry = None
