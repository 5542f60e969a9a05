"""One KV slot in detail: where it is, who holds it now, who wrote it, and how big its K/V are.

    slot 2051 = block 128 * block_size 16 + offset 3
    holders:  running requests whose computed tokens include the slot (``inspect.kv.slot_holders``)
    history:  the ledger's last writes (request, position, step), oldest first
    norms:    |K| and |V| of the slot in every layer (over kv heads x head_dim)

Only 2 * num_layers numbers cross from the device to the host.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SlotDetail:
    slot: int
    block: int
    offset: int
    ref_count: int
    cached: bool
    holders: tuple[tuple[int, int], ...]            # (request id, position) of running requests reading it
    history: tuple[tuple[int, int, int], ...]       # (request id, position, step), oldest first
    k_norms: tuple[float, ...]                      # per layer
    v_norms: tuple[float, ...]

    def __repr__(self) -> str:
        from .record_views import slot_detail_text
        return slot_detail_text(self)

    def _repr_html_(self) -> str:
        from .record_views import slot_detail_html
        return slot_detail_html(self)


def inspect_slot(sess, slot: int) -> SlotDetail:
    """Describe ``slot`` of ``sess``'s cache (raises InvalidRequestError for a slot outside it)."""
    engine = sess.state.engine
    kv = engine.kv_cache
    slot_info = sess.kv.slot(slot)          # the same validation and the same holders as sess.kv.slot
    slot, block, offset = slot_info.slot, slot_info.block, slot_info.offset
    info = engine.manager.pool.block(block)
    history = tuple((w.request_id, w.position, w.step) for w in slot_info.history)
    with torch.no_grad():
        k, v = engine.kv_rows(range(kv.num_layers), [slot])                    # [layers, 1, kv_heads, hd]
        norms = torch.stack([k.float().flatten(1).norm(dim=1), v.float().flatten(1).norm(dim=1)]).cpu().tolist()
    return SlotDetail(slot, block, offset, info.ref_count, info.block_hash is not None, slot_info.held_by,
                      history, tuple(round(x, 4) for x in norms[0]), tuple(round(x, 4) for x in norms[1]))
