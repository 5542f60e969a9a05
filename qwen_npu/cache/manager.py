"""Per-request block tables on top of a BlockPool: prefix matching, growth, commit, free, fork.

Invariants (``check`` reports any breach as a sentence):

* A block table is append-only while its request holds it; ``free`` drops it whole.
* A request never writes into a block it shares. Shared blocks are full and lie before the first
  position the request still computes (``num_computed``)::

      block_size 4, num_computed 9, table [5, 2, 7, 3]
      position  0 1 2 3 | 4 5 6 7 | 8 9 . . | . . . .
      block     5       | 2       | 7       | 3
                shareable (full, computed)  | private: written by this request's next steps

* A block's hash is published by ``commit`` only after the step that filled it has run, so a
  block is never matchable before its K/V exist.
* A request marked ``keep_private`` (its K/V were computed under an edit) publishes nothing from
  then on, and its forks inherit the mark: edited K/V never reach a request that was not edited.
  ``match_prefix(..., limit=n)`` takes at most ``n`` leading tokens from the cache (research
  hooks ask for it), so positions an edit or a capture covers are recomputed.

The lifecycle of a request: ``match_prefix`` once on admission (acquires cached blocks), then
``allocate`` for the tokens of each step, ``commit`` after each step, ``free`` at the end. If
``allocate`` fails on admission, ``free`` the request to hand the matched blocks back before
admitting it again.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..errors import InvalidRequestError, OutOfBlocksError
from .block_pool import BlockPool
from .block_table import blocks_needed as _blocks_for

__all__ = ["KVCacheManager", "PrefixCacheStats"]


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache counters since construction or ``reset``; counted only with the cache on.

    * ``queries``: ``match_prefix`` calls.
    * eligible blocks of a prompt of n tokens: its first ``(n - 1) // block_size`` full blocks
      (the block holding the last token is always computed, never shared).
    * ``hit_blocks`` / ``hit_tokens``: eligible blocks found in the cache, and their tokens.
    * ``miss_blocks`` / ``miss_tokens``: eligible blocks not found (they are computed), and their
      tokens (``miss_blocks * block_size``). Tokens past the eligible blocks are counted in neither.
    """

    queries: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """hit_tokens / eligible tokens; 0.0 before any eligible token."""
        eligible = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / eligible if eligible else 0.0


@dataclasses.dataclass
class _RequestBlocks:
    table: list[int]
    num_computed: int = 0            # tokens whose K/V are in the table's blocks
    num_hashed: int = 0              # leading blocks whose chained hash is known (matched or published)
    last_hash: int | None = None     # the hash of block num_hashed - 1 (None: no block yet)
    private: str | None = None       # why its blocks are no longer published (None: they are)


class KVCacheManager:
    """Block tables of requests (int ids) over ``num_blocks`` blocks of ``block_size`` slots."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        self._pool = BlockPool(num_blocks, block_size, enable_prefix_cache)
        self._block_size = block_size
        self._requests: dict[int, _RequestBlocks] = {}
        self._stats = PrefixCacheStats()

    def reset(self) -> None:
        """Forget every request, every cached prefix and the statistics."""
        self._pool.reset()
        self._requests.clear()
        self._stats = PrefixCacheStats()

    # ---- drafts: plan on a private copy, adopt it whole on commit -----------------------------
    def clone(self) -> KVCacheManager:
        """An independent copy of every table, ref count, queue position, hash and statistic.

        A step plans and books on a clone; the live manager changes only when the step commits
        with ``adopt`` (plain assignments), so a step that fails before then changes nothing."""
        new = object.__new__(KVCacheManager)
        new._pool = self._pool.clone()
        new._block_size = self._block_size
        new._requests = {rid: _RequestBlocks(list(s.table), s.num_computed, s.num_hashed, s.last_hash,
                                             s.private)
                         for rid, s in self._requests.items()}
        new._stats = self._stats
        return new

    def adopt(self, draft: KVCacheManager) -> None:
        """Take over ``draft``'s state; cannot fail (the draft must not be used again)."""
        self._pool.adopt(draft._pool)
        self._requests = draft._requests
        self._stats = draft._stats

    def committed_blocks(self, writes: dict[int, int]) -> list[int]:
        """Of ``writes`` (block -> the request a step writes it for), the blocks whose K/V this
        (live) manager still points to: cached prefix blocks, and blocks other requests hold.
        A step that fails must give those back as they were (``engine.transaction.KVGuard``)."""
        out = []
        for block_id, rid in writes.items():
            if not 0 <= block_id < self.num_blocks:
                continue
            block = self._pool._blocks[block_id]
            if block.block_hash is not None and block.ref_count == 0:
                out.append(block_id)
            elif block.ref_count > 0:
                own = self._requests.get(rid)
                if own is None or block_id not in own.table or block.ref_count > 1:
                    out.append(block_id)
        return out

    # ---- reading -------------------------------------------------------------------------------
    @property
    def pool(self) -> BlockPool:
        """The block pool, for inspection (``block``, ``blocks``, ``free_queue``); do not mutate it."""
        return self._pool

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def enable_prefix_cache(self) -> bool:
        return self._pool.enable_prefix_cache

    @property
    def num_free_blocks(self) -> int:
        """Allocatable blocks (free and cached ones)."""
        return self._pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self._pool.num_used

    @property
    def num_cached_blocks(self) -> int:
        return self._pool.num_cached

    @property
    def stats(self) -> PrefixCacheStats:
        return self._stats

    def has(self, request_id: int) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[int]:
        return list(self._requests)

    def block_table(self, request_id: int) -> list[int]:
        state = self._requests.get(request_id)
        return list(state.table) if state is not None else []

    def num_computed_tokens(self, request_id: int) -> int:
        """Tokens of the request whose K/V are in its blocks (matched, or the last ``commit``)."""
        state = self._requests.get(request_id)
        return state.num_computed if state is not None else 0

    def owners(self, block_id: int) -> list[int]:
        """Ids of the requests whose block table holds ``block_id``, ascending."""
        return sorted(rid for rid, state in self._requests.items() if block_id in state.table)

    def _state(self, request_id: int, action: str) -> _RequestBlocks:
        state = self._requests.get(request_id)
        if state is None:
            raise InvalidRequestError(f"cannot {action} request {request_id}: it holds no blocks")
        return state

    # ---- the lifecycle -------------------------------------------------------------------------
    def match_prefix(self, request_id: int, token_ids: Sequence[int], limit: int | None = None) -> int:
        """Acquire the cached leading full blocks of ``token_ids``; returns the cached token count.

        Looks at most ``(len(token_ids) - 1) // block_size`` blocks, so the last token is always
        computed and its block is private; ``limit`` caps the tokens taken (whole blocks below
        it: research hooks that must see positions recomputed). Creates the request's (possibly
        empty) block table.
        """
        if request_id in self._requests:
            raise InvalidRequestError(f"request {request_id} already has the block table "
                                      f"{self._requests[request_id].table}; match_prefix runs once, on "
                                      f"admission (free the request before admitting it again)")
        state = self._requests[request_id] = _RequestBlocks([])
        if not self._pool.enable_prefix_cache:
            return 0
        size = self._block_size
        eligible = max(0, (len(token_ids) - 1) // size)
        for block_id in self._cached_blocks(token_ids)[:None if limit is None else limit // size]:
            self._pool.acquire(block_id)
            state.table.append(block_id)
        hits = len(state.table)
        parent = self._pool.block_hash(state.table[-1]) if hits else None
        state.num_computed, state.num_hashed, state.last_hash = hits * size, hits, parent
        s = self._stats
        self._stats = PrefixCacheStats(s.queries + 1, s.hit_blocks + hits, s.miss_blocks + eligible - hits,
                                       s.hit_tokens + hits * size, s.miss_tokens + (eligible - hits) * size)
        return hits * size

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens ``match_prefix`` would find cached now; changes nothing."""
        if not self._pool.enable_prefix_cache:
            return 0
        return len(self._cached_blocks(token_ids)) * self._block_size

    def _cached_blocks(self, token_ids: Sequence[int]) -> list[int]:
        """The published blocks holding the leading full blocks of ``token_ids`` (the last token's
        block never counts), in order, up to the first block not cached."""
        size = self._block_size
        found, parent = [], None
        for i in range(max(0, (len(token_ids) - 1) // size)):
            block_id = self._pool.lookup(parent, token_ids[i * size:(i + 1) * size])
            if block_id is None:
                break
            found.append(block_id)
            parent = self._pool.block_hash(block_id)
        return found

    def blocks_needed(self, request_id: int, num_tokens: int) -> int:
        """New blocks the request needs so its table covers ``num_tokens`` tokens."""
        state = self._requests.get(request_id)
        return max(0, _blocks_for(num_tokens, self._block_size) - (len(state.table) if state else 0))

    def allocate(self, request_id: int, num_tokens: int) -> bool:
        """Append blocks so the table covers ``num_tokens`` (creating the table of a new request).

        Returns False, changing nothing, when too few blocks are allocatable.
        """
        state = self._requests.get(request_id)
        if state is not None and 0 <= num_tokens <= len(state.table) * self._block_size:
            return True                  # most decode steps: the last block has room
        have = len(state.table) if state is not None else 0
        n = max(0, _blocks_for(num_tokens, self._block_size) - have)
        if not self._pool.can_allocate(n):
            return False
        if state is None:
            state = self._requests[request_id] = _RequestBlocks([])
        state.table.extend(self._pool.allocate(n))
        return True

    def commit(self, request_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """After a step: the first ``num_computed`` of ``token_ids`` have K/V; publish their full blocks."""
        state = self._state(request_id, "commit")
        if not state.num_computed <= num_computed <= len(token_ids):
            raise InvalidRequestError(f"request {request_id}: num_computed {num_computed} must lie between "
                                      f"the {state.num_computed} tokens already computed and the "
                                      f"{len(token_ids)} tokens given")
        if num_computed > len(state.table) * self._block_size:
            raise InvalidRequestError(f"request {request_id}: {num_computed} computed tokens need more than "
                                      f"the {len(state.table)} blocks of its table; allocate first")
        state.num_computed = num_computed
        if not self._pool.enable_prefix_cache or state.private is not None:
            return
        size, parent = self._block_size, state.last_hash
        full = num_computed // size
        for i in range(state.num_hashed, full):
            parent = self._pool.publish(state.table[i], parent, token_ids[i * size:(i + 1) * size])
        if full > state.num_hashed:
            state.num_hashed, state.last_hash = full, parent

    def keep_private(self, request_id: int, why: str) -> None:
        """From now on publish none of the request's blocks (``why``: a sentence for errors and views)."""
        state = self._state(request_id, "keep private")
        if state.private is None:
            state.private = why

    def private_reason(self, request_id: int) -> str | None:
        """Why the request's blocks are not published, or None."""
        state = self._requests.get(request_id)
        return state.private if state is not None else None

    def free(self, request_id: int) -> None:
        """Release the request's blocks tail first (its tail is evicted before its head); no-op if unknown."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._pool.release(reversed(state.table))

    def truncate(self, request_id: int, num_blocks: int) -> None:
        """Release the table's blocks past its first ``num_blocks``, tail first (undo an ``allocate``).

        Refuses, changing nothing, to drop a block that holds computed tokens.
        """
        state = self._state(request_id, "truncate")
        if _blocks_for(state.num_computed, self._block_size) > num_blocks:
            raise InvalidRequestError(f"cannot truncate request {request_id} to {num_blocks} blocks: its "
                                      f"{state.num_computed} computed tokens need more")
        tail = state.table[num_blocks:]
        del state.table[num_blocks:]
        self._pool.release(reversed(tail))

    def fork(self, parent_id: int, child_id: int) -> list[tuple[int, int]]:
        """Give ``child_id`` the parent's computed K/V; returns the (src, dst) block copies to perform.

        The child shares the parent's full computed blocks. If the parent's computed tokens end
        inside a block, the child gets a fresh block and the caller copies ``src`` into ``dst``
        (copy-on-write at fork time). Raises OutOfBlocksError, changing nothing, if no block is free.
        """
        parent = self._state(parent_id, "fork")
        if child_id in self._requests:
            raise InvalidRequestError(f"cannot fork request {parent_id} into {child_id}: request {child_id} "
                                      f"already holds blocks {self._requests[child_id].table}")
        full, partial = divmod(parent.num_computed, self._block_size)
        copies = []
        if partial:
            if not self._pool.can_allocate(1):
                raise OutOfBlocksError(f"cannot fork request {parent_id} into {child_id}: its block "
                                       f"{parent.table[full]} holds {partial} of {self._block_size} tokens "
                                       f"and must be copied, but no block is free")
            copies = [(parent.table[full], self._pool.allocate(1)[0])]
        for block_id in parent.table[:full]:
            self._pool.acquire(block_id)
        self._requests[child_id] = _RequestBlocks(parent.table[:full] + [dst for _, dst in copies],
                                                  parent.num_computed, parent.num_hashed, parent.last_hash,
                                                  parent.private)
        return copies

    # ---- invariants ----------------------------------------------------------------------------
    def check(self) -> list[str]:
        """Invariant problems as readable sentences; empty when all is well.

        Checks the pool (free + used = total, no block both free-queued and referenced, hash table
        consistent), that each block's ref_count equals the number of tables holding it, that the
        cached blocks along a table chain their hashes, and that no block a request may still write
        (past its computed tokens) is shared or cached.
        """
        problems = self._pool.check()
        holders: dict[int, list[int]] = {}
        for rid, state in self._requests.items():
            for index, block_id in enumerate(state.table):
                if not 0 <= block_id < self.num_blocks:
                    problems.append(f"request {rid}: block-table index {index} holds {block_id}, "
                                    f"not a block id")
                    continue
                if block_id in holders and holders[block_id][-1] == rid:
                    problems.append(f"request {rid} holds block {block_id} twice in its block table")
                holders.setdefault(block_id, []).append(rid)
            if _blocks_for(state.num_computed, self._block_size) > len(state.table):
                problems.append(f"request {rid} has computed {state.num_computed} tokens but its table has "
                                f"only {len(state.table)} blocks")
        for block_id in range(self.num_blocks):
            ref_count, held_by = self._pool.ref_count(block_id), holders.get(block_id, [])
            if ref_count != len(held_by):
                problems.append(f"block {block_id} has ref_count {ref_count} but {len(held_by)} block tables "
                                f"hold it (requests {held_by})")
        for rid, state in self._requests.items():
            previous = None                                    # the hash chain along the table
            for index, block_id in enumerate(state.table):
                info = self._pool.block(block_id) if 0 <= block_id < self.num_blocks else None
                if info is not None and info.is_cached and info.parent_hash != previous and (
                        index == 0 or previous is not None):
                    before = "it is the first block" if index == 0 else f"the block before it holds {previous}"
                    problems.append(f"request {rid}: block {block_id} (table index {index}) is cached after "
                                    f"parent hash {info.parent_hash}, but {before}")
                previous = info.block_hash if info is not None else None
            first = state.num_computed // self._block_size   # first block this request may still write
            for index in range(first, len(state.table)):
                block_id = state.table[index]
                if len(holders.get(block_id, ())) > 1:
                    problems.append(f"request {rid} may write block {block_id} (table index {index}, past "
                                    f"its {state.num_computed} computed tokens) but requests "
                                    f"{holders[block_id]} share it")
                elif 0 <= block_id < self.num_blocks and self._pool.block_hash(block_id) is not None:
                    problems.append(f"request {rid} may write block {block_id} (table index {index}) but "
                                    f"the block is published in the prefix cache")
        return problems

    def __repr__(self) -> str:
        return (f"KVCacheManager(num_blocks={self.num_blocks}, block_size={self._block_size}, "
                f"requests={len(self._requests)}, free={self.num_free_blocks}, "
                f"cached={self.num_cached_blocks}, used={self.num_used_blocks})")
