"""A step's draft of the block pool: its changes held beside the live containers, not a copy.

A step plans on a clone of the block pool (``BlockPool.clone``) and the live pool adopts it only
when the step commits. Copying the pool's blocks, free queue and hash table for every step costs
time in proportion to the number of blocks (an OrderedDict of 33,000 blocks takes 1.4 ms to copy),
while a step changes a few of them. So a draft reads the live containers through these overlays,
which keep only what the step changed:

    BlockOverlay  the blocks: the live list, and the draft's own copy of each block it changed
    QueueOverlay  the free queue: keys added at the head, the live queue less the keys taken out,
                  keys added at the tail (the pool only ever inserts at either end)
    MapOverlay    the hash table: entries added, live entries removed

Reading through an overlay gives what the changed container would hold. ``merged_into(live)``
writes the changes into the live container in place (dict and list assignments, in time
proportional to the changes) and returns it: the draft's commit. The live container must not
change while an overlay over it is in use (a pool has at most one draft at a time; the pool
checks this when adopting).
"""
from __future__ import annotations

from collections import OrderedDict
from itertools import chain


class BlockOverlay:
    """A list of blocks as a draft sees it: ``base[i]`` unless the draft put its own at ``i``."""

    __slots__ = ("base", "changed")

    def __init__(self, base):
        self.base = base
        self.changed: dict = {}

    def __getitem__(self, i: int):
        block = self.changed.get(i)
        return self.base[i] if block is None else block

    def __setitem__(self, i: int, block) -> None:
        self.changed[i] = block

    def __len__(self) -> int:
        return len(self.base)

    def __iter__(self):
        return (self[i] for i in range(len(self.base)))

    def merged_into(self, live):
        for i, block in self.changed.items():
            live[i] = block
        return live


class QueueOverlay:
    """An ordered set of keys (the free queue, head first) as a draft sees it: ``head``, then
    ``base`` without ``removed``, then ``tail``. Supports what the pool does to its queue: take
    the head, delete any key, append at the tail, move a key to the head."""

    __slots__ = ("base", "head", "removed", "tail", "_cursor")

    def __init__(self, base: OrderedDict):
        self.base = base
        self.head: OrderedDict = OrderedDict()    # keys put before everything, in queue order
        self.removed: set = set()                 # keys of base taken out
        self.tail: OrderedDict = OrderedDict()    # keys put after everything, in queue order
        self._cursor = iter(base)                 # base keys before it are all in ``removed``

    def __len__(self) -> int:
        return len(self.head) + len(self.base) - len(self.removed) + len(self.tail)

    def __contains__(self, key) -> bool:
        return key in self.head or key in self.tail or (key in self.base and key not in self.removed)

    def __iter__(self):
        return chain(self.head, (k for k in self.base if k not in self.removed), self.tail)

    def popitem(self, last: bool = True):
        """Take the head (``last=False``, the only end the pool takes from)."""
        if last:
            raise NotImplementedError("a draft's free queue is only taken from its head")
        if self.head:
            return self.head.popitem(last=False)
        for key in self._cursor:
            if key not in self.removed:
                self.removed.add(key)
                return key, None
        if self.tail:
            return self.tail.popitem(last=False)
        raise KeyError("popitem(): the queue is empty")

    def __delitem__(self, key) -> None:
        if key in self.head:
            del self.head[key]
        elif key in self.tail:
            del self.tail[key]
        elif key in self.base and key not in self.removed:
            self.removed.add(key)
        else:
            raise KeyError(key)

    def __setitem__(self, key, value) -> None:
        """Append ``key`` at the tail (the pool appends only keys the queue does not hold)."""
        if key in self:
            raise KeyError(f"{key} is in the queue already")
        self.tail[key] = value

    def move_to_end(self, key, last: bool = True) -> None:
        """Move ``key`` to the head (``last=False``, the only move the pool makes)."""
        if last:
            raise NotImplementedError("a draft's free queue only moves keys to its head")
        del self[key]
        self.head[key] = None
        self.head.move_to_end(key, last=False)

    def merged_into(self, live: OrderedDict) -> OrderedDict:
        for key in self.removed:
            del live[key]
        for key in self.tail:
            live[key] = None
        for key in reversed(self.head):
            live[key] = None
            live.move_to_end(key, last=False)
        return live


class MapOverlay:
    """A dict as a draft sees it: ``added``, and ``base`` without ``removed``."""

    __slots__ = ("base", "added", "removed")

    def __init__(self, base: dict):
        self.base = base
        self.added: dict = {}
        self.removed: set = set()                 # keys of base deleted (one may be added again)

    def __contains__(self, key) -> bool:
        return key in self.added or (key in self.base and key not in self.removed)

    def get(self, key, default=None):
        if key in self.added:
            return self.added[key]
        if key in self.removed:
            return default
        return self.base.get(key, default)

    def __setitem__(self, key, value) -> None:
        self.added[key] = value

    def __delitem__(self, key) -> None:
        if key not in self:
            raise KeyError(key)
        self.added.pop(key, None)
        if key in self.base:
            self.removed.add(key)

    def items(self):
        kept = ((k, v) for k, v in self.base.items() if k not in self.removed and k not in self.added)
        return chain(kept, self.added.items())

    def __len__(self) -> int:
        return sum(1 for _ in self.items())

    def merged_into(self, live: dict) -> dict:
        for key in self.removed:
            del live[key]
        live.update(self.added)
        return live
