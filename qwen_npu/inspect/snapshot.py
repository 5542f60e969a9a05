"""Snapshots: frozen copies of session state, taken at one moment, that the views render.

A view never reads live state while it renders: it first copies what it shows into one of
these records, so a later step cannot change a cell a notebook already displayed, and the same
state always gives the same bytes. Taking a snapshot reads host-side bookkeeping only; it never
copies a device tensor to the host and never advances the session.

    sess ──take_session──> SessionSnapshot(cache: CacheSnapshot, requests: (RequestSnapshot, ...),
                                           last_step: StepSnapshot | None)
    step ──take_step─────> StepSnapshot(rows: (RowSnapshot, ...))
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from .blocks import take_blocks


@dataclasses.dataclass(frozen=True)
class BlockCell:
    """One physical block: ``state`` is "free" | "used" | "shared" | "cached"."""

    block_id: int
    ref_count: int
    owners: tuple[int, ...]        # request ids whose block table holds it, ascending
    state: str
    tokens_held: int               # computed tokens whose K/V the block holds (block_size when cached)


@dataclasses.dataclass(frozen=True)
class CacheSnapshot:
    num_blocks: int
    block_size: int
    num_used: int
    num_cached: int                # ref count 0 with a published prefix hash (allocatable, reusable)
    num_free: int                  # allocatable and holding nothing reusable
    cells: tuple[BlockCell, ...]
    prefix_cache: bool
    prefix_stats: tuple[tuple[str, float], ...]   # (name, value) pairs, e.g. ("hit_rate", 0.5)


@dataclasses.dataclass(frozen=True)
class RequestSnapshot:
    id: int
    status: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    num_computed_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    block_table: tuple[int, ...]
    finish_reason: str | None
    prompt_text: str | None
    output_text: str | None
    block_size: int | None = None

    def __repr__(self) -> str:
        from .views import request_text
        return request_text(self)

    def _repr_html_(self) -> str:
        from .views import request_html
        return request_html(self)


@dataclasses.dataclass(frozen=True)
class RowSnapshot:
    """One dispatched row of a step."""

    row: int
    request_id: int
    padding: bool                  # a replicate-padding row (copies row 0, not a real request)
    positions: tuple[int, ...]
    slots: tuple[int, ...]
    block_table: tuple[int, ...]   # without the -1 padding
    seq_len: int
    token_id: int | None           # the token sampled for this row (None: not sampled, or no logits)
    drafts: tuple[int, ...] = ()   # the drafts a verification row tests after its last token
    accepted: int | None = None    # how many of them the sample kept (None: not sampled, or no drafts)


@dataclasses.dataclass(frozen=True)
class StepSnapshot:
    kind: str
    index: int
    batch_size: int
    num_active: int
    rows: tuple[RowSnapshot, ...]
    logits_request_ids: tuple[int, ...]
    sampled: bool
    logits_state: str              # "none" | "live view" | "stale" | "private copy" | "host copy"
    logits_shape: tuple[int, ...] | None
    timings: tuple[tuple[str, float], ...]
    transfers: tuple[tuple[str, int], ...]
    health: tuple[str, ...]
    slot_problems: tuple[str, ...]
    block_size: int | None
    cache_usage: tuple[tuple[str, int], ...] = ()
    row_kinds: tuple[str, ...] = ()   # per row "decode" | "prefill" (a mixed step has both)
    rolled_back: tuple[tuple[int, tuple[int, ...]], ...] = ()   # (request id, slots given back) after sampling

    def row_kind(self, row: int) -> str:
        """The kind of row ``row``: its own in a mixed step, else the step's."""
        return self.row_kinds[row] if row < len(self.row_kinds) else self.kind

    @property
    def num_tokens(self) -> int:
        return sum(len(r.positions) for r in self.rows)

    def duplicate_slots(self) -> dict[int, tuple[int, ...]]:
        """slot -> rows writing it, for every slot written by more than one token of this step."""
        rows: dict[int, list[int]] = collections.defaultdict(list)
        for r in self.rows:
            for s in r.slots:
                if s >= 0:
                    rows[s].append(r.row)
        return {s: tuple(rs) for s, rs in sorted(rows.items()) if len(rs) > 1}

    def __repr__(self) -> str:
        from .step_view import step_text
        return step_text(self)

    def _repr_html_(self) -> str:
        from .step_view import step_html
        return step_html(self)


@dataclasses.dataclass(frozen=True)
class SessionSnapshot:
    model_name: str
    model: tuple[tuple[str, object], ...]       # (name, value): layers, hidden, heads, vocab
    settings: tuple[tuple[str, object], ...]    # (name, value): device, dtype, kernels, ...
    cache: CacheSnapshot
    requests: tuple[RequestSnapshot, ...]
    num_steps: int
    last_step: StepSnapshot | None
    num_collisions: int = 0
    faults: str | None = None                   # the EMULATED fault model and faults applied, when on

    def by_status(self) -> dict[str, int]:
        return dict(collections.Counter(r.status for r in self.requests))

    def __repr__(self) -> str:
        from .views import session_text
        return session_text(self)

    def _repr_html_(self) -> str:
        from .views import session_html
        return session_html(self)


# ---- taking snapshots ------------------------------------------------------------------------------

def take_cache(manager) -> CacheSnapshot:
    """Copy a KVCacheManager's block states (host bookkeeping only): the cells of ``take_blocks``
    (the one per-block snapshot), with "shared" for a block more than one request holds."""
    bs = manager.block_size
    counts = {rid: range(manager.num_computed_tokens(rid)) for rid in manager.request_ids()}
    cells = [BlockCell(e.block_id, e.ref_count, e.request_ids, e.display_state, e.num_tokens)
             for e in take_blocks(manager, counts)]
    s = manager.stats
    stats = tuple((f.name, getattr(s, f.name)) for f in dataclasses.fields(s)) + (("hit_rate", s.hit_rate),)
    num_cached = manager.num_cached_blocks
    return CacheSnapshot(manager.num_blocks, bs, manager.num_used_blocks, num_cached,
                         manager.num_free_blocks - num_cached, tuple(cells), manager.enable_prefix_cache, stats)


def take_request(req, block_size: int | None = None) -> RequestSnapshot:
    """Copy a live Request (its text is decoded now). Without ``block_size``, the block size of
    the cache manager that keeps the request's block table is used, when it can be found."""
    if block_size is None:
        manager = getattr(getattr(req, "_block_table", None), "__self__", None)
        block_size = getattr(manager, "block_size", None)
    return RequestSnapshot(
        req.id, req.status, tuple(req.prompt_token_ids), tuple(req.output_token_ids), req.num_computed_tokens,
        getattr(req, "num_cached_tokens", 0), getattr(req, "num_preemptions", 0), tuple(req.block_table),
        req.finish_reason, getattr(req, "prompt_text", None), req.text, block_size)


def logits_state(logits) -> str:
    if logits is None:
        return "none"
    if getattr(logits, "_private", None) is not None:
        return "private copy"
    return "stale" if logits.is_stale else "live view"


def take_step(step, block_size: int | None = None) -> StepSnapshot:
    """Copy a StepResult (all host tensors; the device logits are described, not read)."""
    qlens = [int(q) for q in step.query_lens.tolist()]
    pos, slots = step.positions.tolist(), step.slot_mapping.tolist()
    tables = step.block_tables.tolist()
    seq_lens = step.seq_lens.tolist()
    num_active = getattr(step, "num_active", step.batch_size)
    tokens: dict[int, int] = {}
    if step.sampled_tokens is not None:
        tokens = dict(zip(step.logits_request_ids, step.sampled_tokens))
    drafts, accepted = getattr(step, "drafts", {}), getattr(step, "accepted", {})
    rows, t = [], 0
    for r, q in enumerate(qlens):
        rid, padding = int(step.request_ids[r]), r >= num_active
        mine = () if padding else tuple(drafts.get(rid, ()))
        rows.append(RowSnapshot(r, rid, padding, tuple(int(p) for p in pos[t:t + q]),
                                tuple(int(s) for s in slots[t:t + q]),
                                tuple(int(b) for b in tables[r] if b >= 0) if r < len(tables) else (),
                                int(seq_lens[r]) if r < len(seq_lens) else 0,
                                None if padding else tokens.get(rid), mine,
                                accepted.get(rid) if mine else None))
        t += q
    state = logits_state(step.logits)
    if state == "none" and getattr(step, "host_logits_copy", None) is not None:
        state = "host copy"
    bs = block_size if block_size is not None else getattr(step, "block_size", None)
    usage = getattr(step, "cache_usage", None) or {}
    return StepSnapshot(
        step.kind, step.index, step.batch_size, num_active, tuple(rows), tuple(step.logits_request_ids),
        step.token_ids is not None, state,
        tuple(step.logits.shape) if step.logits is not None else None,
        tuple((k, float(v)) for k, v in step.timings.items()),
        tuple((k, int(v)) for k, v in step.transfers.items()),
        tuple(f"request {rid}: {why}" for rid, why in getattr(step, "health", ())),
        tuple(str(p) for p in getattr(step, "slot_problems", ())), bs or None,
        tuple((k, int(v)) for k, v in usage.items()), tuple(getattr(step, "row_kinds", None) or ()),
        tuple((rid, tuple(s)) for rid, s in sorted(getattr(step, "rolled_back", {}).items())))


def take_session(sess) -> SessionSnapshot:
    """Copy everything the Session view shows."""
    mc, c = sess.model_config, sess.config
    engine = sess.state.engine
    name = sess.path.name if getattr(sess, "path", None) is not None else "model"
    model = (("layers", mc.num_hidden_layers), ("hidden", mc.hidden_size),
             ("heads", f"{mc.num_attention_heads}q/{mc.num_key_value_heads}kv"), ("head_dim", mc.head_dim),
             ("vocab", mc.vocab_size))
    settings = (("device", c.device), ("dtype", c.dtype), ("kernels", c.kernels), ("max_batch", c.max_batch),
                ("chunk_size", c.chunk_size), ("max_model_len", c.max_model_len),
                ("decode_padding", c.decode_padding), ("slot_check", c.slot_check),
                ("device_outputs", "on" if c.device_outputs else "off"))
    if c.tensor_parallel_size > 1:
        heads = mc.num_key_value_heads // c.tensor_parallel_size
        settings += (("tensor_parallel_size", f"{c.tensor_parallel_size} ({heads} KV head"
                                              f"{'s' * (heads > 1)} per rank)"),)
    last = sess.history[-1] if sess.history else None
    bs = c.block_size
    emulator = getattr(engine, "faults", None)
    faults = f"{emulator.model}, {len(emulator.applied)} applied" if emulator is not None else None
    return SessionSnapshot(
        name, model, settings, take_cache(engine.manager), tuple(take_request(r, bs) for r in sess.requests),
        sess.state.step_index, take_step(last, bs) if last is not None else None,
        getattr(engine.ledger, "num_collisions", 0), faults)


def take(obj, *, block_size: int | None = None):
    """A snapshot of a Session, Request or StepResult (whatever ``obj`` is)."""
    kinds: dict[str, Callable] = {"Session": take_session, "Request": take_request, "StepResult": take_step}
    for klass in type(obj).__mro__:
        if klass.__name__ in kinds:
            fn = kinds[klass.__name__]
            return fn(obj) if fn is take_session else fn(obj, block_size)
    raise TypeError(f"cannot snapshot a {type(obj).__name__}: pass a Session, Request or StepResult")
