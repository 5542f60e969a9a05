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

from . import html as h


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
        return slot_detail_text(self)

    def _repr_html_(self) -> str:
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
        k = torch.stack([t[block, offset].float().norm() for t in kv.keys])     # [layers]
        v = torch.stack([t[block, offset].float().norm() for t in kv.values])   # [layers]
        norms = torch.stack([k, v]).cpu().tolist()                             # [2, layers]
    return SlotDetail(slot, block, offset, info.ref_count, info.block_hash is not None, slot_info.held_by, history,
                      tuple(round(x, 4) for x in norms[0]), tuple(round(x, 4) for x in norms[1]))


def _state(d: SlotDetail) -> str:
    if d.ref_count > 1:
        return f"shared (ref count {d.ref_count})"
    if d.ref_count == 1:
        return "used"
    return "cached (ref count 0, reusable prefix)" if d.cached else "free"


def slot_detail_text(d: SlotDetail) -> str:
    held = ", ".join(f"request {r} position {p}" for r, p in d.holders) or "nobody"
    hist = "; ".join(f"request {r} position {p} at step {s}" for r, p, s in d.history) or "never written"
    norms = ", ".join(f"L{i} {k:.3f}/{v:.3f}" for i, (k, v) in enumerate(zip(d.k_norms, d.v_norms)))
    return (f"Slot {d.slot} (block {d.block}, offset {d.offset}): {_state(d)}\n  held by: {held}\n"
            f"  writes: {hist}\n  |K|/|V| by layer: {norms}")


def slot_detail_html(d: SlotDetail) -> str:
    held = " ".join(f"{h.request_chip(r)} position {p}" for r, p in d.holders) or h.muted("nobody")
    rows = [(h.request_chip(r), str(p), str(s)) for r, p, s in d.history]
    hist = h.table(("request", "position", "step"), rows) if rows else h.muted("never written")
    norms = h.table(["layer"] + [str(i) for i in range(len(d.k_norms))],
                    [["|K|"] + [f"{x:.3f}" for x in d.k_norms], ["|V|"] + [f"{x:.3f}" for x in d.v_norms]])
    body = (h.fields([("block", str(d.block)), ("offset", str(d.offset)), ("state", h.esc(_state(d)))])
            + h.section("held by", held) + h.section("write history (oldest first)", hist)
            + h.section("K/V norms", norms))
    return h.view(f"Slot {d.slot}", body)
