"""Check every step a serving engine is about to run with qwen_npu's slot checks; warn, count or raise.

An engine adapter turns one step into a `StepInputs` (tensors where the engine keeps them, host ints
for the row boundaries) and calls `StepGuard.check` just before the forward. The guard screens the
step with `screen_slot_mapping` (a few tensor operations, no read-back on an accelerator); only when
the screen flags a token does it build a `StepWrites` and ask `check_step_writes` for the problems,
so the rules and the messages are those of the Session's own checks.

On an accelerator the screen's verdict is copied back without waiting; the guard looks at it on the
next `check` (or `flush`) and, if it flags, describes that step then: the report comes one step late
and says so. On the CPU it is judged at once.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from ..cache.slot_check import SlotProblem, StepWrites, check_step_writes, format_problems
from ..cache.slot_screen import count_holders, screen_slot_mapping
from ..errors import SlotCollisionError

MODES = ("warn", "count", "raise")
MAX_PENDING = 4          # accelerator verdicts in flight before the guard waits for the oldest
log = logging.getLogger("qwen_npu.guard")


@dataclass
class StepInputs:
    """One step as the kernels will see it. Rows are the step's requests, in batch order."""

    request_ids: list[str]                 # [rows]
    query_start_loc: np.ndarray            # [rows + 1] host ints: row r owns tokens qsl[r]..qsl[r+1]-1
    slot_mapping: torch.Tensor             # [tokens incl. padded tail]
    positions: torch.Tensor                # [>= real tokens]
    block_tables: torch.Tensor             # [>= rows, max_blocks]
    blocks_per_row: np.ndarray             # [>= rows] host ints: leading table entries the row holds
    block_size: int
    num_blocks: int                        # blocks in the cache (slots = num_blocks * block_size)


@dataclass
class StepReport:
    """The problems of one step: `step`, `request_ids` of its rows, `problems` (SlotProblem)."""

    step: int
    request_ids: tuple[str, ...]
    problems: tuple[SlotProblem, ...]
    late: bool = False

    def to_json(self) -> dict:
        return {"step": self.step, "late": self.late, "request_ids": list(self.request_ids),
                "problems": [{"check": p.check, "slot": p.slot, "block": p.block, "offset": p.offset,
                              "rows": list(p.rows), "request_ids": [str(r) for r in p.request_ids],
                              "positions": list(p.positions), "message": p.message}
                             for p in self.problems]}


@dataclass
class _Pending:
    step: int
    flag: torch.Tensor          # pinned host bool, filled when `event` completes
    event: object
    snapshot: tuple


@dataclass
class StepGuard:
    """`mode`: "warn" (log each problem), "count" (count only) or "raise" (SlotCollisionError).

    `log_path`: also append one JSON line per step with problems. `counts`: problems per check;
    `steps_checked`; `seconds` (host time in `check`); `reports`: the last `keep` StepReports.
    """

    mode: str = "warn"
    log_path: str | None = None
    keep: int = 100
    steps_checked: int = 0
    seconds: float = 0.0               # host time spent in `check` (screening and reporting)
    counts: Counter = field(default_factory=Counter)
    reports: list[StepReport] = field(default_factory=list)
    _pending: list[_Pending] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"guard mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    def check(self, step: StepInputs) -> None:
        """Screen one step before its forward; report it now (host tensors) or on a later call."""
        t0 = time.perf_counter()
        try:
            with self._lock:
                self._check(step)
        finally:
            self.seconds += time.perf_counter() - t0

    def _check(self, step: StepInputs) -> None:
        self._drain(wait=False)
        index = self.steps_checked
        self.steps_checked += 1
        n = int(step.query_start_loc[-1])
        rows = len(step.request_ids)
        dev = step.slot_mapping.device
        held = np.ascontiguousarray(step.blocks_per_row[:rows], dtype=np.int64)
        width = max(1, int(held.max())) if rows else 1          # only the columns some row holds
        bpr = _to(held, dev)
        tok_rows = _to(np.repeat(np.arange(rows), np.diff(step.query_start_loc[:rows + 1])), dev)
        tables = step.block_tables[:rows, :width]
        holders = count_holders(tables, bpr, step.num_blocks)
        mask = screen_slot_mapping(step.slot_mapping, step.positions, tok_rows, tables, bpr,
                                   block_size=step.block_size, num_blocks=step.num_blocks,
                                   num_real_tokens=n, holders=holders)
        snapshot = (step, n, holders)
        if dev.type == "cpu":
            if bool(mask.any()):
                self._report(index, snapshot, late=False)
            return
        # accelerator: keep what the description needs, read the verdict back without waiting
        snapshot = (_frozen(step, tables), n, holders)
        flag = torch.empty((), dtype=torch.bool, pin_memory=True)
        flag.copy_(mask.any(), non_blocking=True)
        event = getattr(torch, dev.type).Event()
        event.record()
        self._pending.append(_Pending(index, flag, event, snapshot))
        if len(self._pending) > MAX_PENDING:
            self._drain(wait=True, only_oldest=True)

    def flush(self) -> None:
        """Wait for and report every verdict still in flight (call at shutdown)."""
        with self._lock:
            self._drain(wait=True)

    def summary(self) -> str:
        if not self.counts:
            return f"slot guard: {self.steps_checked} steps checked in {self.seconds:.2f} s, no problems"
        parts = ", ".join(f"{c} {k}" for k, c in sorted(self.counts.items()))
        return f"slot guard: {self.steps_checked} steps checked in {self.seconds:.2f} s, problems: {parts}"

    # ------------------------------------------------------------------------------ internals

    def _drain(self, wait: bool, only_oldest: bool = False) -> None:
        while self._pending:
            p = self._pending[0]
            if not wait and not p.event.query():
                return
            p.event.synchronize()
            self._pending.pop(0)
            if bool(p.flag):
                self._report(p.step, p.snapshot, late=True)
            if only_oldest:
                return

    def _report(self, index: int, snapshot: tuple, late: bool) -> None:
        step, n, holders = snapshot
        problems = describe(index, step, n, holders)
        if not problems:
            return
        report = StepReport(index, tuple(step.request_ids), tuple(problems), late)
        self.reports = (self.reports + [report])[-self.keep:]
        self.counts.update(p.check for p in problems)
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(report.to_json()) + "\n")
        text = format_problems(problems)
        if late:
            text += "\n(found when the next step was checked: the device verdict is read back without waiting)"
        if self.mode == "warn":
            log.warning("%s", text)
        elif self.mode == "raise":
            err = SlotCollisionError(text)
            err.problems = tuple(problems)
            raise err


def describe(index: int, step: StepInputs, n: int, holders: torch.Tensor) -> list[SlotProblem]:
    """The problems of one step, from `check_step_writes` (host copies; the padded tail is one row)."""
    qsl = [int(x) for x in step.query_start_loc]
    rows = len(step.request_ids)
    slots = step.slot_mapping.cpu().tolist()
    pos = step.positions.cpu().tolist()
    pos += [0] * (len(slots) - len(pos))
    tables = step.block_tables[:rows].cpu().tolist()
    bpr = [int(b) for b in step.blocks_per_row[:rows]]
    row_tables = [t[:b] for t, b in zip(tables, bpr)]
    ids = [str(r) for r in step.request_ids]
    row_pos = [pos[qsl[r]:qsl[r + 1]] for r in range(rows)]
    row_slots = [slots[qsl[r]:qsl[r + 1]] for r in range(rows)]
    if len(slots) > n:                                   # the padded tail, as one padding row
        ids.append("padding-tail")
        row_pos.append(pos[n:len(slots)])
        row_slots.append(slots[n:])
        row_tables.append([])
    kind = "prefill" if any(len(r) > 1 for r in row_slots[:rows]) else "decode"
    counts = holders.cpu().tolist()
    writes = StepWrites(index, kind, len(ids), rows, ids, row_pos, row_slots, row_tables)
    return check_step_writes(writes, block_size=step.block_size, num_blocks=step.num_blocks,
                             ref_count=lambda b: counts[b] if 0 <= b < len(counts) else 0)


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`; to an accelerator through pinned memory, so the copy never waits."""
    t = torch.from_numpy(array)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def _frozen(step: StepInputs, tables: torch.Tensor) -> StepInputs:
    """A copy the engine cannot overwrite before the verdict is read (device clones, host copies);
    ``tables``: the block-table columns some row holds (all the description reads)."""
    rows = len(step.request_ids)
    return StepInputs(list(step.request_ids), np.array(step.query_start_loc[:rows + 1]),
                      step.slot_mapping.clone(), step.positions[:step.slot_mapping.shape[0]].clone(),
                      tables.clone(), np.array(step.blocks_per_row[:rows]),
                      step.block_size, step.num_blocks)
