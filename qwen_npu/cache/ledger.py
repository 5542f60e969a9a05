"""Who wrote which KV slot, and when.

The ledger records every token a step actually wrote, after the step ran:

    slot 2051 ── last:    SlotWrite(request_id=12, position=515, step=7)
                 history: (request 4 @ 3 step 1, ..., request 12 @ 515 step 7)   # at most `history`

Invariants and boundaries:

- Only slots that were written are stored (a dict keyed by slot); a step costs O(tokens it wrote).
- Slot -1 (and any negative slot) means "do not write" and is skipped.
- Freeing a block does NOT erase anything, and there is deliberately no `forget`: the cache slot
  still physically holds the last K/V written there until someone overwrites it, and the ledger
  describes the cache, not ownership. Whether a recorded write is still *live* (its request still
  holds that slot) is the caller's question — see `check_step_writes(..., is_live=...)`.
- A draft that verification rejected stays the slot's last write, marked by `roll_back` with
  the step that gave it back (`SlotWrite.rolled_back_in`), until the slot is written again.
- If one `record` call writes a slot more than once (two rows of one step on one slot), that is a
  collision: it is remembered in `collisions` (the most recent `max_collisions`), and the write of
  the later row is kept as `last` (the order the rows were given; on a device the winner of
  parallel writes is undefined). Duplicates across separate `record` calls are not collisions.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotWrite:
    """One token's K/V written into a slot: request `request_id`, token `position`, at step `step`.
    `rolled_back_in`: the step whose sample rejected it, when the write was a draft given back
    (the slot still holds its K/V, which no request reads)."""

    request_id: int
    position: int
    step: int
    rolled_back_in: int | None = None

    def describe(self) -> str:
        """"request 3 at position 17 (step 5)", with ", a rejected draft rolled back in step 5"."""
        back = f", a rejected draft rolled back in step {self.rolled_back_in}" if self.rolled_back_in is not None else ""
        return f"request {self.request_id} at position {self.position} (step {self.step}{back})"


@dataclass(frozen=True)
class SlotCollision:
    """One step wrote `slot` more than once; one entry per write, in row order."""

    step: int
    slot: int
    request_ids: tuple[int, ...]
    positions: tuple[int, ...]
    rows: tuple[int, ...] | None = None
    kinds: tuple[str, ...] | None = None     # per write: its row's kind, "decode" | "prefill"

    def __str__(self) -> str:
        who = ", ".join(f"request {r} @ {p}" for r, p in zip(self.request_ids, self.positions))
        rows = f" (rows {', '.join(map(str, self.rows))})" if self.rows is not None else ""
        if self.kinds is not None and len(set(self.kinds)) > 1:     # a mixed step's decode and prefill rows
            rows += f" ({', '.join(self.kinds)})"
        return f"step {self.step}: slot {self.slot} written {len(self.positions)} times{rows}: {who}"


@dataclass(frozen=True)
class LedgerWrites:
    """The writes of one step, prepared by `SlotLedger.prepare` and recorded by `apply`."""
    step: int
    entries: list            # (slot, (request_id, position, step)) in token order
    collisions: list         # SlotCollision


class SlotLedger:
    """Last write and a bounded write history for every slot of a cache with `num_slots` slots."""

    def __init__(self, num_slots: int, history: int = 8, max_collisions: int = 1000):
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.num_slots = num_slots
        self.history_len = history
        self._writes: dict[int, deque[tuple[int, int, int]]] = {}  # slot -> (request_id, position, step)
        self._collisions: deque[SlotCollision] = deque(maxlen=max_collisions)
        self._rolled_back: dict[int, int] = {}   # slot -> the step that rejected its last write (a draft)
        self.num_collisions = 0  # all collisions ever recorded, also those dropped from `collisions`
        self.last_step: int | None = None

    def record(self, step: int, slots: Sequence[int], request_ids: Sequence[int],
               positions: Sequence[int], rows: Sequence[int] | None = None,
               kinds: Sequence[str] | None = None) -> list[SlotCollision]:
        """Record the tokens one step wrote, one entry per token in row order.

        `rows` (optional, one per token) names the batch row of each token for collision records.
        Returns the collisions found in this call (also kept in `collisions`).
        """
        writes = self.prepare(step, slots, request_ids, positions, rows, kinds)
        self.apply(writes)
        return writes.collisions

    def prepare(self, step: int, slots: Sequence[int], request_ids: Sequence[int],
                positions: Sequence[int], rows: Sequence[int] | None = None,
                kinds: Sequence[str] | None = None) -> LedgerWrites:
        """What `record` would do, computed without changing the ledger (a step's commit phase
        prepares first and then `apply`s, which cannot fail). Raises ValueError on bad input.
        `kinds` (optional, one per token): the kind of the token's row, "decode" or "prefill"
        (a mixed step has both), kept in collision records."""
        n = len(slots)
        if (len(request_ids) != n or len(positions) != n or (rows is not None and len(rows) != n)
                or (kinds is not None and len(kinds) != n)):
            lens = (n, len(request_ids), len(positions), None if rows is None else len(rows),
                    None if kinds is None else len(kinds))
            raise ValueError(f"step {step}: slots, request_ids, positions, rows, kinds differ in length: {lens}")
        seen: dict[int, int] = {}
        dups: dict[int, list[int]] = {}
        entries = []
        for i in range(n):
            slot = int(slots[i])
            if slot < 0:
                continue
            if slot >= self.num_slots:
                raise ValueError(f"step {step}: token {i} wrote slot {slot}, beyond the cache "
                                 f"({self.num_slots} slots)")
            if slot in seen:
                dups.setdefault(slot, [seen[slot]]).append(i)
            else:
                seen[slot] = i
            entries.append((slot, (int(request_ids[i]), int(positions[i]), step)))
        found = [SlotCollision(step, slot, tuple(int(request_ids[i]) for i in idx),
                               tuple(int(positions[i]) for i in idx),
                               None if rows is None else tuple(int(rows[i]) for i in idx),
                               None if kinds is None else tuple(str(kinds[i]) for i in idx))
                 for slot, idx in dups.items()]
        return LedgerWrites(step, entries, found)

    def apply(self, writes: LedgerWrites) -> None:
        """Record prepared writes: appends and assignments only."""
        store, history, back = self._writes, self.history_len, self._rolled_back
        for slot, entry in writes.entries:
            back.pop(slot, None)
            q = store.get(slot)
            if q is None:
                q = store[slot] = deque(maxlen=history)
            q.append(entry)
        self.last_step = writes.step
        self._collisions.extend(writes.collisions)
        self.num_collisions += len(writes.collisions)

    def roll_back(self, slots: Sequence[int], step: int) -> None:
        """Mark the last writes of ``slots`` (drafts that step ``step`` rejected) as given back:
        assignments only."""
        for slot in slots:
            if slot in self._writes:
                self._rolled_back[slot] = step

    def rolled_back(self) -> dict[int, int]:
        """slot -> the step that rejected its last write, for every slot whose last write is a
        rejected draft (a copy)."""
        return dict(self._rolled_back)

    def last(self, slot: int) -> SlotWrite | None:
        entry = self._writes.get(slot)
        return SlotWrite(*entry[-1], self._rolled_back.get(slot)) if entry else None

    def last_raw(self, slot: int) -> tuple[int, int, int] | None:
        """`last` as a plain (request_id, position, step) tuple: the per-token fast path for checks."""
        entry = self._writes.get(slot)
        return entry[-1] if entry else None

    def history(self, slot: int) -> tuple[SlotWrite, ...]:
        """The last `history` writes of `slot`, oldest first (the last one marked if rolled back)."""
        writes = [SlotWrite(*w) for w in self._writes.get(slot, ())]
        if writes and slot in self._rolled_back:
            writes[-1] = SlotWrite(*self._writes[slot][-1], self._rolled_back[slot])
        return tuple(writes)

    @property
    def collisions(self) -> list[SlotCollision]:
        """The most recent collisions, oldest first (a copy)."""
        return list(self._collisions)

    def written_slots(self) -> list[int]:
        """Every slot written at least once since the last reset, in ascending order."""
        return sorted(self._writes)

    def __len__(self) -> int:
        return len(self._writes)

    def __contains__(self, slot: object) -> bool:
        return slot in self._writes

    def reset(self) -> None:
        """Forget everything (the cache was cleared, e.g. `Session.reset()`)."""
        self._writes.clear()
        self._rolled_back.clear()
        self._collisions.clear()
        self.num_collisions = 0
        self.last_step = None

    def __repr__(self) -> str:
        return (f"SlotLedger({len(self._writes)} of {self.num_slots} slots written, "
                f"{self.num_collisions} collisions, last step {self.last_step})")
