"""Physical KV blocks: reference counts, the LRU free queue and the prefix-hash table.

Every block is in exactly one of three states::

    used     ref_count > 0                    held by one or more block tables, not in the queue
    free     ref_count == 0, no hash           in the free queue, content is garbage
    cached   ref_count == 0, hash published    in the free queue, content still reusable

Free and cached blocks are both allocatable. They wait in ONE queue; ``allocate`` takes from the
head. The queue always has this exact shape::

    head (allocated next)                                               tail (evicted last)
    | uncached freed blocks, the most recently released first | never-used blocks, by id |
    | cached blocks, the least recently released first                                    |

* ``release`` puts a block whose count reaches 0 at the HEAD if it holds no hash (it will be
  reused first, which keeps cached blocks alive longer) and at the TAIL if it is cached.
* So cached blocks are evicted least-recently-freed first, and only once no uncached block is left.
  Evicting a cached block (allocating it) removes its hash from the table.
* ``acquire`` on a cached block with ref_count 0 takes it out of the queue (a prefix-cache hit).

Hashes are chained: a block's hash covers its own token ids and its parent's hash, so equal
tokens under different prefixes never match. ``hash_block`` uses Python's ``hash`` of a tuple
of ints, which is deterministic across processes (only str/bytes hashing is salted); ``-1``
stands for "no parent" because ``hash`` never returns -1. ``lookup`` also compares the block's
own tokens and parent hash, so only a 64-bit collision in an ancestor could give a false hit.
"""
from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from ..errors import OutOfBlocksError
from .overlay import BlockOverlay, MapOverlay, QueueOverlay

__all__ = ["BlockInfo", "BlockPool", "hash_block"]

_ROOT = -1  # the parent hash of a first block; hash() never returns -1


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The chained hash of a full block: ``hash((parent_hash or -1, tuple(token_ids)))``."""
    return hash((_ROOT if parent_hash is None else parent_hash, tuple(token_ids)))


@dataclasses.dataclass(frozen=True)
class BlockInfo:
    """A snapshot of one block, copied at the time of the call."""

    block_id: int
    ref_count: int
    block_hash: int | None = None      # None unless the block's content is published
    parent_hash: int | None = None     # the hash its own hash was chained from (None: first block)
    token_ids: tuple[int, ...] = ()    # the tokens it holds, recorded when it was published

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None


class _Block:
    __slots__ = ("block_hash", "block_id", "parent_hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` slots; see the module docstring for the queue order."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._enable_prefix_cache = enable_prefix_cache
        self._adoptions = 0                   # drafts adopted so far (a draft must be of the latest state)
        self._draft_of: tuple | None = None   # a draft's (live pool, its adoptions when cloned); None: live
        self.reset()

    def reset(self) -> None:
        """Forget every reference and every hash; the queue becomes 0, 1, ..., num_blocks-1."""
        self._blocks = [_Block(i) for i in range(self._num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self._num_blocks))
        self._by_hash: dict[int, int] = {}   # block_hash -> block_id
        self._num_cached = 0                  # hashed blocks with ref_count 0
        self._adoptions += 1                  # a draft cloned before a reset is not of this state

    # ---- drafts: a private copy for planning, adopted whole on commit ---------------------------
    def clone(self) -> BlockPool:
        """An independent draft (a step's): its changes never reach this pool until ``adopt``.

        The draft reads this pool's blocks, free queue and hash table through overlays that hold
        only its own changes (``overlay.py``), so cloning and adopting cost time in proportion to
        what the step changes, not to the number of blocks."""
        new = object.__new__(BlockPool)
        new._num_blocks, new._block_size = self._num_blocks, self._block_size
        new._enable_prefix_cache = self._enable_prefix_cache
        new._blocks, new._free, new._by_hash = BlockOverlay(self._blocks), QueueOverlay(self._free), MapOverlay(self._by_hash)
        new._num_cached, new._adoptions = self._num_cached, 0
        new._draft_of = (self, self._adoptions)
        return new

    def adopt(self, draft: BlockPool) -> None:
        """Take over ``draft``'s state: its changes written into this pool's containers (a draft
        that was ``reset`` hands over its own). The draft must be this pool's latest clone and
        must not be used again. Plain assignments once the check passed."""
        if draft._draft_of != (self, self._adoptions):
            raise ValueError("adopt: the draft is not a clone of this pool's current state")
        self._blocks = _merged(draft._blocks, self._blocks)
        self._free = _merged(draft._free, self._free)
        self._by_hash = _merged(draft._by_hash, self._by_hash)
        self._num_cached = draft._num_cached
        self._adoptions += 1
        draft._draft_of = None

    def _mut(self, block_id: int) -> _Block:
        """The block to change: in a draft, its own copy, made on first change."""
        blocks = self._blocks
        block = blocks[block_id]
        if type(blocks) is BlockOverlay and block_id not in blocks.changed:
            copy = _Block(block_id)
            copy.ref_count, copy.block_hash = block.ref_count, block.block_hash
            copy.parent_hash, copy.token_ids = block.parent_hash, block.token_ids
            block = blocks[block_id] = copy
        return block

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def enable_prefix_cache(self) -> bool:
        return self._enable_prefix_cache

    @property
    def num_free(self) -> int:
        """Allocatable blocks: free ones and cached ones with ref_count 0."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a published hash and ref_count 0 (allocatable, but reusable as a prefix)."""
        return self._num_cached

    @property
    def num_used(self) -> int:
        return self._num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    # ---- reference counting --------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, each with ref_count 1.

        A cached block taken this way is evicted: its hash leaves the table. Raises
        OutOfBlocksError, allocating nothing, when fewer than ``n`` blocks are allocatable.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} free blocks but only {len(self._free)} of {self._num_blocks} "
                                   f"are free; free a request or give the KV cache more blocks")
        block_ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self._mut(block_id)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def acquire(self, block_id: int) -> None:
        """One more holder of ``block_id``: a used block, or a cached one (taken out of the queue)."""
        block = self._mut(self._get(block_id).block_id)
        if block.ref_count == 0:
            if block.block_hash is None:
                raise ValueError(f"block {block_id} is free and caches nothing; allocate blocks instead "
                                 f"of acquiring a free one")
            del self._free[block_id]
            self._num_cached -= 1
        block.ref_count += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """One holder less of each block, in the given order; at 0 it joins the free queue.

        An uncached block goes to the head, a cached one to the tail. Raises ValueError, changing
        nothing, when a block would be released more often than it is held.
        """
        block_ids = list(block_ids)
        for block_id, times in Counter(block_ids).items():
            if self._get(block_id).ref_count < times:
                raise ValueError(f"cannot release block {block_id} {times} time(s): its ref_count is "
                                 f"{self._blocks[block_id].ref_count}")
        for block_id in block_ids:
            block = self._mut(block_id)
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._num_cached += 1

    # ---- prefix hashes -------------------------------------------------------------------------
    def publish(self, block_id: int, parent_hash: int | None, token_ids: Sequence[int]) -> int:
        """Record that used block ``block_id`` holds the full block ``token_ids`` after ``parent_hash``.

        Returns the chained hash. If another block already holds that hash, the existing mapping is
        kept and this block stays uncached (it is reused first once freed). With the prefix cache
        off the hash is returned and nothing is recorded. Publishing again with the same hash does
        nothing; a block never changes its hash while it is held.
        """
        block = self._get(block_id)
        tokens = tuple(token_ids)
        if len(tokens) != self._block_size:
            raise ValueError(f"block {block_id}: only a full block can be published, got {len(tokens)} "
                             f"tokens for block_size {self._block_size}")
        block_hash = hash_block(parent_hash, tokens)
        if not self._enable_prefix_cache:
            return block_hash
        if block.ref_count == 0:
            raise ValueError(f"block {block_id} is not held by any request; only a used block can be published")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block_id} already holds hash {block.block_hash} of tokens "
                                 f"{block.token_ids}; a published block cannot change its content")
            return block_hash
        if block_hash not in self._by_hash:
            block = self._mut(block_id)
            block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, tokens
            self._by_hash[block_hash] = block_id
        return block_hash

    def lookup(self, parent_hash: int | None, token_ids: Sequence[int]) -> int | None:
        """The block caching ``token_ids`` after ``parent_hash`` (hash AND tokens equal), or None."""
        if not self._enable_prefix_cache:
            return None
        tokens = tuple(token_ids)
        block_id = self._by_hash.get(hash_block(parent_hash, tokens))
        if block_id is None:
            return None
        block = self._blocks[block_id]
        if block.token_ids != tokens or block.parent_hash != parent_hash:
            return None
        return block_id

    def _evict(self, block: _Block) -> None:
        del self._by_hash[block.block_hash]
        block.block_hash, block.parent_hash, block.token_ids = None, None, ()
        self._num_cached -= 1

    # ---- reading -------------------------------------------------------------------------------
    def _get(self, block_id: int) -> _Block:
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block {block_id} does not exist (block ids are 0..{self._num_blocks - 1})")
        return self._blocks[block_id]

    def block(self, block_id: int) -> BlockInfo:
        b = self._get(block_id)
        return BlockInfo(b.block_id, b.ref_count, b.block_hash, b.parent_hash, b.token_ids)

    def blocks(self) -> Iterator[BlockInfo]:
        """Snapshots of every block, by id."""
        return iter([self.block(i) for i in range(self._num_blocks)])

    def ref_count(self, block_id: int) -> int:
        return self._get(block_id).ref_count

    def block_hash(self, block_id: int) -> int | None:
        return self._get(block_id).block_hash

    def free_queue(self) -> list[int]:
        """Allocatable block ids, head (allocated next) first."""
        return list(self._free)

    def check(self) -> list[str]:
        """The pool's own invariant problems, as sentences; empty when all is well."""
        problems = []
        used = sum(1 for b in self._blocks if b.ref_count > 0)
        if used + len(self._free) != self._num_blocks:
            problems.append(f"{len(self._free)} free + {used} used blocks != {self._num_blocks} blocks in all")
        for b in self._blocks:
            if b.ref_count < 0:
                problems.append(f"block {b.block_id} has a negative ref_count {b.ref_count}")
            if b.block_id in self._free and b.ref_count != 0:
                problems.append(f"block {b.block_id} is in the free queue but has ref_count {b.ref_count}")
            if b.block_id not in self._free and b.ref_count == 0:
                problems.append(f"block {b.block_id} has ref_count 0 but is not in the free queue (leaked)")
            if b.block_hash is not None:
                if self._by_hash.get(b.block_hash) != b.block_id:
                    problems.append(f"block {b.block_id} holds hash {b.block_hash}, which the hash table "
                                    f"maps to {self._by_hash.get(b.block_hash)}")
                if hash_block(b.parent_hash, b.token_ids) != b.block_hash or len(b.token_ids) != self._block_size:
                    problems.append(f"block {b.block_id}: hash {b.block_hash} does not match its parent hash "
                                    f"and its {len(b.token_ids)} tokens")
        for block_hash, block_id in self._by_hash.items():
            if self._blocks[block_id].block_hash != block_hash:
                problems.append(f"the hash table maps {block_hash} to block {block_id}, which holds "
                                f"hash {self._blocks[block_id].block_hash}")
        cached = sum(1 for b in self._blocks if b.block_hash is not None and b.ref_count == 0)
        if cached != self._num_cached:
            problems.append(f"num_cached says {self._num_cached} but {cached} cached blocks have ref_count 0")
        if not self._enable_prefix_cache and self._by_hash:
            problems.append(f"the prefix cache is off but {len(self._by_hash)} blocks hold a hash")
        return problems

    def __repr__(self) -> str:
        return (f"BlockPool(num_blocks={self._num_blocks}, block_size={self._block_size}, "
                f"free={self.num_free}, cached={self._num_cached}, used={self.num_used})")


def _merged(draft_container, live_container):
    """The live container with a draft's changes written in, or the draft's own container when it
    replaced the live one (a reset draft)."""
    if isinstance(draft_container, (BlockOverlay, QueueOverlay, MapOverlay)) and draft_container.base is live_container:
        return draft_container.merged_into(live_container)
    return draft_container
