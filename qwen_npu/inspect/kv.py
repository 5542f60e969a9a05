"""``sess.kv``: the paged KV cache, slot by slot.

    key(layer), value(layer)   the LIVE device tensors [num_blocks, block_size, num_kv_heads, head_dim];
                               writing into them changes the cache (that is how a fault is injected)
    read(request, position, layer) -> (k, v)    host copies [num_kv_heads, head_dim] of one token
    slot(slot) -> SlotInfo     who wrote the slot last, when, its write history, who holds it now

    slot = block * block_size + offset            e.g. block_size 4: slot 27 = block 6, offset 3
    a request's position p lives in slot  block_table[p // block_size] * block_size + p % block_size

Everything but ``key``/``value`` is a snapshot copied when taken.
"""
from __future__ import annotations

import dataclasses
import operator

import torch

from ..cache.ledger import SlotCollision, SlotWrite
from ..engine.request import DECODING, PREFILLING, Request
from ..errors import InvalidRequestError

RUNNING = (PREFILLING, DECODING)


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """One slot, copied when taken. ``request_id``/``position``/``written_at_step`` describe the
    last write (None if the slot was never written since the cache was last cleared)."""

    slot: int
    block: int
    offset: int
    request_id: int | None
    position: int | None
    written_at_step: int | None
    history: tuple[SlotWrite, ...] = ()            # oldest first, bounded by the ledger
    held_by: tuple[tuple[int, int], ...] = ()      # (request id, position) of running requests whose
                                                   # computed token lives here now
    collisions: tuple[SlotCollision, ...] = ()     # steps that wrote this slot more than once
    faults: tuple[str, ...] = ()                   # EMULATED faults applied to this slot
    rolled_back_in: int | None = None              # the last write was a draft this step rejected

    @property
    def is_live(self) -> bool:
        """Does a running request still read this slot as one of its computed tokens?"""
        return bool(self.held_by)

    def _lines(self) -> list[str]:
        head = f"slot {self.slot} (block {self.block}, offset {self.offset})"
        if self.request_id is None:
            last = "never written"
        else:
            last = f"request {self.request_id} at position {self.position}, step {self.written_at_step}"
            if self.rolled_back_in is not None:
                last += f" (a rejected draft, rolled back in step {self.rolled_back_in}: no request reads it)"
        held = ", ".join(f"request {r} @ {p}" for r, p in self.held_by) or "nobody (not a live token)"
        lines = [head, f"  last write: {last}", f"  held by:    {held}"]
        if self.history:
            lines.append("  history:    " + "; ".join(
                f"step {w.step}: request {w.request_id} @ {w.position}" for w in self.history))
        lines += [f"  COLLISION   {c}" for c in self.collisions]
        lines += [f"  {f}" for f in self.faults]
        return lines

    def __repr__(self) -> str:
        return "\n".join(self._lines())

    def _repr_html_(self) -> str:
        from .report_views import slot_info_html
        return slot_info_html(self)


class KVView:
    """The Session's KV cache with its bookkeeping; see the module docstring."""

    def __init__(self, engine, requests: dict[int, Request]):
        self._engine = engine
        self._requests = requests
        self._cache = engine.kv_cache

    @property
    def num_layers(self) -> int:
        return self._cache.num_layers

    @property
    def num_blocks(self) -> int:
        return self._cache.num_blocks

    @property
    def block_size(self) -> int:
        return self._cache.block_size

    @property
    def num_slots(self) -> int:
        return self._cache.num_slots

    @property
    def dtype(self) -> torch.dtype:
        return self._cache.keys[0].dtype

    @property
    def device(self) -> torch.device:
        return self._cache.keys[0].device

    def key(self, layer: int) -> torch.Tensor:
        """The live key cache of ``layer``: [num_blocks, block_size, num_kv_heads, head_dim]. With
        tensor parallelism a host copy gathered from every rank (the whole layer crosses)."""
        return self._whole(layer, "key")

    def value(self, layer: int) -> torch.Tensor:
        """The live value cache of ``layer``: [num_blocks, block_size, num_kv_heads, head_dim]. With
        tensor parallelism a host copy gathered from every rank (the whole layer crosses)."""
        return self._whole(layer, "value")

    def _whole(self, layer: int, kind: str) -> torch.Tensor:
        layer = self._layer(layer)
        if self._engine.parallel is not None:
            return self._engine.parallel.layer(self._cache, layer, kind)
        return (self._cache.keys if kind == "key" else self._cache.values)[layer]

    @property
    def head_ranks(self) -> list[range]:
        """The KV heads each rank holds, in rank order (one range for one device)."""
        from ..parallel.sharding import head_ranges
        size = self._engine.config.tensor_parallel_size
        return head_ranges(self._cache.keys[0].shape[2] * size, size)

    def rows(self, slots, layers=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies (k, v) [layers, slots, num_kv_heads, head_dim] of ``slots`` (every layer by
        default), every KV head of the model: with tensor parallelism gathered from the ranks in
        ``head_ranks`` order."""
        layers = range(self.num_layers) if layers is None else [self._layer(i) for i in layers]
        k, v = self._engine.kv_rows(list(layers), [int(s) for s in slots])
        return k.cpu(), v.cpu()

    def slot_of(self, request, position: int) -> int:
        """The slot holding computed ``position`` of a running ``request`` (Request or id)."""
        req = self._request(request)
        position = _index(position, "position")
        if req.status not in RUNNING:
            why = "its blocks were freed" if req.is_done else "it holds no blocks (not admitted, or preempted)"
            raise InvalidRequestError(f"request {req.id} is {req.status}: {why}, so position {position} is not "
                                      f"in the cache; sess.kv.slot(s) still shows what a slot last held")
        n = req.num_computed_tokens
        if not 0 <= position < n:
            have = f"positions 0..{n - 1}" if n else "no positions yet"
            raise InvalidRequestError(f"request {req.id} has computed {have}; position {position} is not in "
                                      f"the cache")
        table = self._engine.manager.block_table(req.id)
        bs = self.block_size
        return table[position // bs] * bs + position % bs

    def read(self, request, position: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies (k, v), each [num_kv_heads, head_dim], of one computed token in ``layer``."""
        layer = self._layer(layer)
        k, v = self.rows([self.slot_of(request, position)], [layer])
        return k[0, 0].clone(), v[0, 0].clone()

    def slot(self, slot: int) -> SlotInfo:
        """A snapshot of ``slot``: its last write, write history, current holders, collisions, faults."""
        slot = _index(slot, "slot")
        if not 0 <= slot < self.num_slots:
            raise InvalidRequestError(f"slot {slot!r} is outside the cache: slots are "
                                      f"0..{self.num_slots - 1} ({self.num_blocks} blocks x {self.block_size})")
        ledger, bs = self._engine.ledger, self.block_size
        block, offset = divmod(slot, bs)
        last = ledger.last(slot)
        held = slot_holders(self._engine.manager, self._requests, slot, bs)
        faults = self._engine.faults
        found = tuple(str(f) for f in faults.applied if f.slot == slot) if faults is not None else ()
        return SlotInfo(slot, block, offset, last.request_id if last else None, last.position if last else None,
                        last.step if last else None, ledger.history(slot), held,
                        tuple(c for c in ledger.collisions if c.slot == slot), found,
                        last.rolled_back_in if last else None)

    def _layer(self, layer) -> int:
        layer = _index(layer, "layer")
        if not 0 <= layer < self.num_layers:
            raise InvalidRequestError(f"layer {layer!r} does not exist: the model has layers "
                                      f"0..{self.num_layers - 1}")
        return layer

    def _request(self, request) -> Request:
        rid = request.id if isinstance(request, Request) else request
        try:
            return self._requests[int(rid)]
        except (KeyError, TypeError, ValueError):
            raise InvalidRequestError(f"no request with id {rid!r}") from None

    def __repr__(self) -> str:
        k = self._cache.keys[0]
        shape = list(k.shape[:2]) + [k.shape[2] * len(self.head_ranks), k.shape[3]]
        ranks = (f"; {len(self.head_ranks)} ranks, KV heads " + ", ".join(
            f"{r.start}..{r.stop - 1} on rank {i}" for i, r in enumerate(self.head_ranks))
            if len(self.head_ranks) > 1 else "")
        return (f"KVCache({self.num_layers} layers x K/V {shape} (blocks, slots, kv heads, head dim), "
                f"{k.dtype}, {k.device}; {self.num_slots} slots, {len(self._engine.ledger)} written{ranks})")

    def _repr_html_(self) -> str:
        from .report_views import kv_html
        return kv_html(self)


def slot_holders(manager, requests: dict, slot: int, block_size: int) -> tuple[tuple[int, int], ...]:
    """Who holds ``slot`` now: (request id, position) of each running request among ``requests``
    (a session's own, or every branch's after a fork) whose computed tokens include the slot.
    A block table that merely lists the block (a finished request's cached prefix, positions not
    computed yet) does not hold it. ``sess.kv.slot`` and ``inspect_slot`` both answer with this."""
    block, offset = divmod(slot, block_size)
    held = []
    for rid in manager.owners(block):
        req = requests.get(rid)
        pos = manager.block_table(rid).index(block) * block_size + offset
        if req is not None and req.status in RUNNING and pos < req.num_computed_tokens:
            held.append((rid, pos))
    return tuple(held)


def _index(x, name: str) -> int:
    """An int (also a numpy or 0-d torch integer); refuses bools and floats with a clear error."""
    if isinstance(x, bool):
        raise InvalidRequestError(f"{name} must be an int, not bool")
    try:
        return operator.index(x)
    except TypeError:
        raise InvalidRequestError(f"{name} must be an int, not {type(x).__name__}") from None
