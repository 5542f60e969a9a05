"""EMULATED hardware faults: what unordered concurrent writes to one KV slot can leave behind.

When two rows of one step write the same slot, the kernels here (and on the CPU, always) apply
the writes in a fixed order, and when the rows carry the same token — as replicate padding does —
the slot ends up holding the right K/V. A device gives no such promise: the lanes race, and the
slot may end up with either value, a mix of their bytes, or nothing at all. A fault model makes
that visible on any machine by *emulating* one outcome after every step that wrote a slot more
than once (the ledger's collisions of the step):

    "zero_on_collision"   the slot's K and V are set to 0 in every layer: a lost write. A zero
                          key scores 0 against every query and a zero value adds nothing, so the
                          row's logits shift but stay finite; the stream may or may not change.
    "nan_on_collision"    the slot's K and V are set to NaN in every layer: a torn write whose
                          bytes form no valid number. Every later step of a request that reads
                          the slot gets non-finite logits, greedy argmax picks token 0, and the
                          stream turns into zeros (the failure seen on the NPU runner).

It is an emulation, not a measurement: which value real hardware leaves is undefined, and the
step that collided has already read the correct values (the fault lands after its forward).
It is off unless turned on, every fault it applies is reported as a FaultEmulationWarning that
says EMULATED, and it is shown in the Session repr while on.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

import torch

from .. import errors
from ..cache.kv_cache import KVCache
from ..cache.ledger import SlotCollision
from ..errors import InvalidRequestError

FAULT_MODELS = {"zero_on_collision": 0.0, "nan_on_collision": math.nan}
MAX_RECORDED = 1000


class FaultEmulationWarning(UserWarning):
    """An EMULATED hardware fault was applied to the KV cache (a fault model is on)."""


@dataclasses.dataclass(frozen=True)
class EmulatedFault:
    """One EMULATED fault: after step ``step``, ``slot`` was set to ``value`` in every layer."""

    model: str
    step: int
    slot: int
    block: int
    offset: int
    rows: tuple[int, ...]
    request_ids: tuple[int, ...]
    positions: tuple[int, ...]

    def __str__(self) -> str:
        what = "zeroed" if self.model == "zero_on_collision" else "set to NaN"
        rows = f"rows {', '.join(map(str, self.rows))}" if self.rows else f"{len(self.positions)} tokens"
        reqs = ", ".join(dict.fromkeys(map(str, self.request_ids)))
        return (f"EMULATED fault ({self.model}) after step {self.step}: slot {self.slot} (block {self.block}, "
                f"offset {self.offset}) was written by {rows} (request {reqs}) in one step; its K and V "
                f"were {what} in every layer")


class FaultEmulator:
    """Applies one fault model to the slots a step wrote more than once; remembers what it did."""

    def __init__(self, model: str):
        if not isinstance(model, str) or model not in FAULT_MODELS:
            raise InvalidRequestError(f"fault model {model!r}: choose one of "
                                      f"{', '.join(map(repr, FAULT_MODELS))}, or None to turn emulation off")
        self.model = model
        self.value = FAULT_MODELS[model]
        self.applied: collections.deque[EmulatedFault] = collections.deque(maxlen=MAX_RECORDED)

    def apply(self, step: int, collisions: Sequence[SlotCollision], kv_cache: KVCache, *,
              warn: bool = True) -> list[EmulatedFault]:
        """Overwrite every collided slot of ``step`` in every layer; warn once for the step
        (``warn=False``: the caller warns later with ``warn_faults``, once its state is consistent)."""
        if not collisions:
            return []
        bs = kv_cache.block_size
        faults = [EmulatedFault(self.model, step, c.slot, c.slot // bs, c.slot % bs, c.rows or (),
                                c.request_ids, c.positions) for c in collisions]
        slots = torch.tensor([c.slot for c in collisions], dtype=torch.int64).to(kv_cache.keys[0].device)
        for cache in kv_cache.keys + kv_cache.values:
            cache.view(-1, *cache.shape[2:]).index_fill_(0, slots, self.value)   # [num_slots, kv_heads, hd]
        self.applied.extend(faults)
        if warn:
            warn_faults(faults)
        return faults

    def find(self, step: int, slot: int) -> EmulatedFault | None:
        for f in self.applied:
            if f.step == step and f.slot == slot:
                return f
        return None

    def __repr__(self) -> str:
        return f"FaultEmulator(EMULATED {self.model}, {len(self.applied)} faults applied)"


def warn_faults(faults: Sequence[EmulatedFault]) -> None:
    """One FaultEmulationWarning for ``faults``, pointed at the first frame outside qwen_npu
    (``errors.warn``)."""
    if faults:
        errors.warn("\n".join(map(str, faults)), FaultEmulationWarning)


class FaultSetting:
    """What ``Session.emulate_faults`` returns: the setting is already applied; as a context
    manager it restores the previous setting on exit."""

    def __init__(self, owner, previous: FaultEmulator | None):
        self._owner = owner
        self._previous = previous

    def __enter__(self) -> FaultSetting:
        return self

    def __exit__(self, *exc) -> None:
        self._owner.faults = self._previous

    def __repr__(self) -> str:
        now = self._owner.faults
        state = f"EMULATED faults: {now.model}" if now is not None else "fault emulation off"
        return f"<{state}; leaving a `with` block restores the previous setting>"


def set_fault_model(owner, model: str | None) -> FaultSetting:
    """Set ``owner.faults`` (an Engine) to ``model`` (None = off); validated before anything changes."""
    if model is not None and getattr(owner, "parallel", None) is not None:   # an Engine, or a stand-in
        from ..errors import InvalidRequestError
        raise InvalidRequestError(f"emulate_faults is not available with tensor_parallel_size="
                                  f"{owner.config.tensor_parallel_size}: the emulation writes one rank's cache")
    new = None if model is None else FaultEmulator(model)
    previous = owner.faults
    owner.faults = new
    return FaultSetting(owner, previous)
