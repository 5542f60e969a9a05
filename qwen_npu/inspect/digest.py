"""``sess.state_digest()``: a fingerprint of the state a step may change.

Parts (each hashed on its own, so a difference says where it is)::

    requests     id, status, tokens, counts, preemptions, finish/stop reason, log-probabilities,
                 staged drafts and speculation counts
    blocks       every block table, the free-queue order, each block's ref count and hash
    prefix       the prefix-cache map (hash -> block) and its statistics
    ledger       every slot's write history and the collisions
    history      the steps kept (index, kind, rows, sampled tokens) and the next step index
    generators   the state of every request's random generator, the seed stream, the next request id
    buffers      output-buffer generations and which pair is current
    faults       the EMULATED faults applied
    captures     what open captures recorded (steps, requests)
    kv           (``kv=True`` only) the K/V bytes of every slot committed state relies on: each
                 request's computed tokens and every slot of a cached prefix block, every layer

Two digests are equal exactly when every part is; ``a.diff(b)`` names the parts that differ.
"""
from __future__ import annotations

import dataclasses
import hashlib

import torch


@dataclasses.dataclass(frozen=True)
class StateDigest:
    hexdigest: str
    parts: dict

    def diff(self, other: StateDigest) -> list[str]:
        """Names of the parts that differ from ``other``."""
        return [k for k in self.parts if self.parts[k] != other.parts.get(k)]

    def __eq__(self, other) -> bool:
        return isinstance(other, StateDigest) and self.hexdigest == other.hexdigest

    def __hash__(self) -> int:
        return hash(self.hexdigest)

    def __repr__(self) -> str:
        return f"StateDigest({self.hexdigest[:16]})"


def committed_slots(manager, pool) -> list[int]:
    """Every slot whose K/V committed state relies on: the computed tokens of every request
    holding blocks, and every slot of a cached prefix block (ref count 0, hashed)."""
    bs = manager.block_size
    slots = set()
    for rid in manager.request_ids():
        table, n = manager.block_table(rid), manager.num_computed_tokens(rid)
        slots.update(table[p // bs] * bs + p % bs for p in range(n))
    for b in pool.blocks():
        if b.ref_count == 0 and b.block_hash is not None:
            slots.update(range(b.block_id * bs, (b.block_id + 1) * bs))
    return sorted(slots)


def kv_checksum(engine, slots: list[int]) -> str:
    """sha256 of the K/V bytes of ``slots`` in every layer, every rank's heads (``Engine.kv_rows``)."""
    h = hashlib.sha256(repr(slots).encode())
    if slots:
        k, v = engine.kv_rows(range(engine.kv_cache.num_layers), slots)   # [layers, slots, kv_heads, hd]
        h.update(torch.cat([k, v]).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _h(obj) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()


def state_digest(sess, kv: bool = False) -> StateDigest:
    st = sess.state
    m, pool = st.manager, st.manager.pool
    reqs = tuple((r.id, r.status, tuple(r.prompt_token_ids), tuple(r.output_token_ids), r.num_computed_tokens,
                  r.num_cached_tokens, r.num_preemptions, r.finish_reason, r.stop_reason,
                  None if r.logprobs is None else tuple(repr(lp) for lp in r.logprobs),
                  None if r.stop_strings is None else (r.stop_strings.text.text, r.stop_strings.cut),
                  r.draft_token_ids, r.spec_stats)
                 for r in st.requests.values())
    tables = tuple((rid, tuple(m.block_table(rid)), m.num_computed_tokens(rid)) for rid in sorted(m.request_ids()))
    blocks = tuple((b.ref_count, b.block_hash, b.parent_hash, b.token_ids) for b in pool.blocks())
    ledger = st.ledger
    writes = tuple((slot, ledger.history(slot)) for slot in ledger.written_slots())
    history = (st.step_index, tuple((s.index, s.kind, tuple(s.request_ids), s.num_active,
                                     None if s.sampled_tokens is None else tuple(s.sampled_tokens),
                                     tuple(sorted(s.accepted.items())))
                                    for s in sess.history))
    gens = (tuple((rid, _h(g.get_state().tolist())) for rid, g in sorted(st.generators.items())),
            _h(st.seed_state), st.engine.next_request_id)
    faults = st.faults
    hook = st.hook
    captures = tuple((type(e).__name__, tuple(getattr(e, "steps", ())), tuple(getattr(e, "request_ids", ())))
                     for e in getattr(hook, "entries", ()) if getattr(e, "is_capture", False))
    parts = {
        "requests": _h(reqs),
        "blocks": _h((tables, tuple(pool.free_queue()), blocks)),
        "prefix": _h((m.stats, pool.num_cached)),
        "ledger": _h((writes, tuple(map(str, ledger.collisions)), ledger.num_collisions, ledger.last_step)),
        "history": _h(history),
        "generators": _h(gens),
        "buffers": _h((sorted(map(repr, st.buffers.generations().items())), sorted(st.buffers.current.items()))),
        "faults": _h(None if faults is None else (faults.model, tuple(map(str, faults.applied)))),
        "captures": _h(captures),
    }
    if kv:
        parts["kv"] = kv_checksum(st.engine, committed_slots(m, pool))
    return StateDigest(_h(sorted(parts.items())), parts)
