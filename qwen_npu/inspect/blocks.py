"""``sess.blocks``: a frozen snapshot of every physical KV block, its holders and its prefix hash.

Each block is in one of the block pool's three states::

    used     ref_count > 0                   held by the block tables of ``request_ids``
    cached   ref_count 0, prefix hash known  allocatable, but a new request with the same prefix
                                             reuses it (evicted least-recently-freed first)
    free     ref_count 0, no hash            allocatable, its content is garbage

``token_ids`` are the tokens whose K/V the block holds: the published tokens of a hashed block,
else the computed tokens of its holder at the positions the block covers (``()`` for a block
allocated for a step that has not run yet, and for a free block). With ``block_size`` 4::

    request 3: tokens [11 12 13 14 | 15 16], 6 computed, block table [7, 2]
    block 7  used  ref 1  requests (3,)  hash 0x5a1c..  tokens (11, 12, 13, 14)
    block 2  used  ref 1  requests (3,)  hash -         tokens (15, 16)

The snapshot is copied when taken; later steps never change it.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator, Mapping

from ..cache.manager import PrefixCacheStats

FREE, USED, CACHED = "free", "used", "cached"
MAX_ROWS = 64          # block rows a repr shows; the rest are summarised


@dataclasses.dataclass(frozen=True)
class BlockEntry:
    """One physical block at the time of the snapshot."""

    block_id: int
    state: str                        # "free" | "used" | "cached"
    ref_count: int
    request_ids: tuple[int, ...]      # requests whose block table holds it, ascending
    block_hash: int | None            # the chained prefix hash (None: not published)
    parent_hash: int | None           # the hash it was chained from (None: first block, or unpublished)
    token_ids: tuple[int, ...]        # tokens whose K/V it holds

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_shared(self) -> bool:
        return self.ref_count > 1

    @property
    def display_state(self) -> str:
        """``state``, or "shared" when more than one request holds the block (the grid's colour)."""
        return "shared" if self.ref_count > 1 or len(self.request_ids) > 1 else self.state


@dataclasses.dataclass(frozen=True)
class BlocksSnapshot:
    """Every block by id, with the prefix-cache counters; index it by block id."""

    block_size: int
    prefix_cache: bool
    entries: tuple[BlockEntry, ...]
    stats: PrefixCacheStats           # the counters at the time of the snapshot (frozen)
    step: int                         # the session's step counter when taken
    free_queue: tuple[int, ...] = ()  # allocatable blocks (free, then cached ones), the next taken first

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[BlockEntry]:
        return iter(self.entries)

    def __getitem__(self, block_id: int) -> BlockEntry:
        return self.entries[block_id]

    def with_state(self, state: str) -> tuple[BlockEntry, ...]:
        """The blocks in ``state`` ("free" | "used" | "cached"), by id."""
        if state not in (FREE, USED, CACHED):
            raise ValueError(f"state must be 'free', 'used' or 'cached', not {state!r}")
        return tuple(e for e in self.entries if e.state == state)

    def of_request(self, request_id: int) -> tuple[BlockEntry, ...]:
        """The blocks a request holds (in block-id order, not table order)."""
        return tuple(e for e in self.entries if request_id in e.request_ids)

    def counts(self) -> dict[str, int]:
        """{"used": n, "cached": n, "free": n}."""
        c = collections.Counter(e.state for e in self.entries)
        return {USED: c[USED], CACHED: c[CACHED], FREE: c[FREE]}

    def summary(self) -> str:
        c = self.counts()
        shared = sum(1 for e in self.entries if e.is_shared)
        s = self.stats
        prefix = (f"prefix cache: {s.hit_blocks} blocks hit ({s.hit_tokens} tokens), {s.miss_blocks} missed "
                  f"({s.miss_tokens} tokens), {s.queries} lookups" if self.prefix_cache else "prefix cache off")
        return (f"{len(self.entries)} blocks x {self.block_size} slots at step {self.step}: {c[USED]} used "
                f"({shared} shared), {c[CACHED]} cached, {c[FREE]} free; {prefix}")

    def _shown(self) -> tuple[list[BlockEntry], int]:
        """The non-free blocks (at most MAX_ROWS) and how many were left out."""
        busy = [e for e in self.entries if e.state != FREE]
        return busy[:MAX_ROWS], max(0, len(busy) - MAX_ROWS)

    def __repr__(self) -> str:
        from .record_views import blocks_text
        return blocks_text(self)

    def _repr_html_(self) -> str:
        from .record_views import blocks_html
        return blocks_html(self)


def take_blocks(manager, token_ids: Mapping[int, list[int]], step: int = 0) -> BlocksSnapshot:
    """Snapshot ``manager``'s blocks; ``token_ids`` maps each request id that holds blocks to its tokens."""
    bs = manager.block_size
    holders: dict[int, list[int]] = collections.defaultdict(list)
    held: dict[int, tuple[int, ...]] = {}
    for rid in manager.request_ids():
        computed = manager.num_computed_tokens(rid)
        tokens = token_ids.get(rid, ())
        for index, block_id in enumerate(manager.block_table(rid)):
            holders[block_id].append(rid)
            if block_id not in held or not held[block_id]:
                held[block_id] = tuple(tokens[index * bs:min((index + 1) * bs, computed)])
    entries = []
    for info in manager.pool.blocks():
        b = info.block_id
        if info.ref_count > 0:
            state = USED
        elif info.block_hash is not None:
            state = CACHED
        else:
            state = FREE
        tokens = info.token_ids if info.block_hash is not None else held.get(b, ())
        entries.append(BlockEntry(b, state, info.ref_count, tuple(sorted(holders.get(b, ()))),
                                  info.block_hash, info.parent_hash, tuple(tokens)))
    return BlocksSnapshot(bs, manager.enable_prefix_cache, tuple(entries), manager.stats, step,
                          tuple(manager.pool.free_queue()))


def take_session_blocks(sess) -> BlocksSnapshot:
    """``take_blocks`` for a Session (its manager, its requests' tokens, its step counter)."""
    st = sess.state
    tokens = {r.id: r.all_token_ids for r in sess.requests if st.manager.has(r.id)}
    return take_blocks(st.manager, tokens, st.step_index)
