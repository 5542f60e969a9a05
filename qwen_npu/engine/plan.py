"""A step's plan, the one record of what a step dispatches, and the StepResult that reads it.

Rows, positions, slots, block tables and lengths are held here once. Everything else reads them
from the plan: the slot checks (a plan is a ``StepWrites`` by its ``row_*`` views and
``token_writes``), the ledger (``token_*`` views), the runner's kernel metadata, ``StepResult``
and through it snapshots and dumps. The step checks a plan before the runner copies it into the
dispatch buffers, so a step that would corrupt the cache is refused while nothing has been written.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from ..cache.block_table import pad_block_tables, slot_mapping
from ..cache.slot_check import KINDS
from .request import DECODING, Request

# A step's kind (KINDS): every row decodes one token ("decode"), every row computes a prefill
# chunk ("prefill"), decode rows and prefill chunks share one forward ("mixed", ``mixed_steps=True``),
# or every row decodes and some verify drafts ("verify", ``speculative=``; engine/speculative.py).


def buffer_set(kind: str) -> str:
    """The dispatch/output buffer set a step of ``kind`` uses: a mixed or verify step has rows of
    many tokens, so it runs through the prefill set (and the kernels' varlen prefill path)."""
    return "decode" if kind == "decode" else "prefill"


class PlanRow(NamedTuple):
    """One row of a plan (immutable: a plan records what ran)."""
    request: Request
    start: int            # first position computed by this row
    end: int              # one past the last position
    needs_logits: bool    # the row reaches the end of the request's known tokens
    padding: bool = False  # a replicate-padding row (copies row 0)
    kind: str = "prefill"  # "decode": the row's request was decoding; "prefill": a prompt chunk
    drafts: tuple[int, ...] = ()   # a decode row's drafts: it computes its last token, then these


@dataclasses.dataclass
class StepPlan:
    kind: str
    index: int
    rows: list[PlanRow]
    num_active: int
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_index: list[int]      # token indices whose logits are computed
    logits_rows: list[int]       # the rows they belong to (active rows only are exposed)

    @functools.cached_property
    def _request_ids(self) -> tuple[int, ...]:
        return tuple(r.request.id for r in self.rows)     # once: the rows never change after planning

    @property
    def request_ids(self) -> list[int]:
        """One per dispatched row (a new list)."""
        return list(self._request_ids)

    @property
    def row_kinds(self) -> list[str]:
        """Per row: "decode" or "prefill" (a mixed step has both)."""
        return [r.kind for r in self.rows]

    @property
    def row_drafts(self) -> list[int]:
        """Per row: how many drafts it verifies (0 but for a decode row of a speculative step)."""
        return [len(r.drafts) for r in self.rows]

    @functools.cached_property
    def num_drafts(self) -> int:
        return sum(len(r.drafts) for r in self.rows)

    # ---- the plan read as the slot checks' StepWrites (cache/slot_check.py) ----------------
    @property
    def step(self) -> int:
        return self.index

    @property
    def num_dispatched(self) -> int:
        return len(self.rows)

    @property
    def row_request_ids(self) -> list[int]:
        return self.request_ids

    @property
    def row_positions(self) -> list[list[int]]:
        return [self.positions[a:b] for _, a, b in self.row_slices()]

    @property
    def row_slots(self) -> list[list[int]]:
        return [self.slot_mapping[a:b] for _, a, b in self.row_slices()]

    @property
    def row_block_tables(self) -> list[list[int]]:
        return self.block_tables

    def token_writes(self) -> tuple[list[int], list[int], list[int]]:
        """(slot, position, row) of every token, in token order: the plan's own lists."""
        return self.slot_mapping, self.positions, self.token_rows

    # ---- the plan read token by token (the ledger) ------------------------------------------
    @functools.cached_property
    def token_rows(self) -> list[int]:
        """The row of each token (computed once: ``query_lens`` never changes after planning)."""
        return [i for i, n in enumerate(self.query_lens) for _ in range(n)]

    @property
    def token_request_ids(self) -> list[int]:
        ids = self._request_ids
        return [ids[r] for r in self.token_rows]

    @property
    def token_kinds(self) -> list[str]:
        return [self.rows[r].kind for r in self.token_rows]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def row_slices(self):
        """(row, token start, token end) per row."""
        t = 0
        for i, n in enumerate(self.query_lens):
            yield i, t, t + n
            t += n

    def rolled_back(self, accepted: dict[int, int]) -> dict[int, list[int]]:
        """Request id -> the slots of the drafts its row wrote past the ``accepted[id]`` kept ones."""
        out = {}
        for row, a, b in self.row_slices():
            r = self.rows[row]
            if row < self.num_active and r.drafts and r.request.id in accepted:
                out[r.request.id] = self.slot_mapping[b - len(r.drafts) + accepted[r.request.id]:b]
        return out


def build_plan(kind: str, index: int, rows: list[tuple[Request, int]], tables: dict[int, list[int]],
               block_size: int, *, pad_to: int | None = None) -> StepPlan:
    """Plan ``rows`` = [(request, tokens to compute)], each starting at its ``num_computed_tokens``.

    A decode row of more than one token verifies its request's ``draft_token_ids`` (exactly
    ``tokens - 1`` of them): it computes the last token and the drafts, with logits at each.

    ``pad_to`` (decode only) reproduces the old fixed-batch runner: rows ``len(rows)..pad_to``
    copy row 0's token, position, block table and slot, and every row is dispatched.
    """
    if kind not in KINDS:
        raise ValueError(f"step kind must be one of {KINDS}, got {kind!r}")
    plan_rows: list[PlanRow] = []
    ids, pos, slots, qlens, slens, btabs, lidx, lrows = [], [], [], [], [], [], [], []
    for req, n in rows:
        start = req.num_computed_tokens
        end = start + n
        table = tables[req.id]
        decoding = kind in ("decode", "verify") or (kind == "mixed" and req.status == DECODING)
        drafts = tuple(req.draft_token_ids) if decoding and n > 1 else ()
        if len(drafts) != (n - 1 if decoding else 0):
            raise ValueError(f"request {req.id}: a decode row of {n} tokens verifies {n - 1} drafts, "
                             f"but it holds {len(drafts)}")
        row = PlanRow(req, start, end, needs_logits=end - len(drafts) == req.num_tokens,
                      kind="decode" if decoding else "prefill", drafts=drafts)
        plan_rows.append(row)
        if n == 1:                                        # a decode row: its last token
            ids.append(req.token(start))
            pos.append(start)
        else:
            ids += [req.token(start), *drafts] if drafts else req.token_ids[start:end]
            pos += range(start, end)
        slots += slot_mapping(table, start, end, block_size)
        if row.needs_logits:
            first = len(ids) - 1 - len(drafts)           # a verification row has logits at every token
            lidx += range(first, len(ids))
            lrows += [len(plan_rows) - 1] * (1 + len(drafts))
        qlens.append(n)
        slens.append(end)
        btabs.append(table)
    num_active = len(plan_rows)
    if pad_to is not None and plan_rows:
        first = plan_rows[0]
        for _ in range(num_active, pad_to):
            plan_rows.append(first._replace(padding=True))
            ids.append(ids[0])
            pos.append(pos[0])
            slots.append(slots[0])
            qlens.append(1)
            slens.append(slens[0])
            btabs.append(btabs[0])
            lidx.append(len(ids) - 1)     # the old runner computed logits for every row
    return StepPlan(kind, index, plan_rows, num_active, ids, pos, slots, qlens, slens, btabs, lidx, lrows)


@dataclasses.dataclass(eq=False)
class StepResult:
    """One step: what was dispatched, its device logits and, once sampled, its tokens.

    What was dispatched is read from the step's plan, the one record of it:
    ``input_ids``, ``positions``, ``slot_mapping``, ``query_lens``, ``seq_lens`` and
    ``block_tables`` are host tensors made from the plan when first read, ``token_ids`` from
    ``sampled_tokens``. Every tensor a step hands out is its own: ``hidden`` is a view made for
    this step (never the one the forward wrote through), ``host_logits`` an empty tensor of its
    own while the logits stay on the device, so changing one in place changes no other step."""

    plan: StepPlan                  # the plan that ran
    logits: object                  # engine/runner.DeviceLogits, or None when no row gets logits
    host_logits_copy: torch.Tensor | None   # the logits copied to the host (device_outputs=False), else None
    max_blocks: int                 # the width ``block_tables`` is padded to (-1)
    hidden_rows: tuple | None = None            # (output buffer, rows): where ``hidden`` is read
    sampled_tokens: list | None = None          # after sampling: one token id per logits row
    timings: dict = dataclasses.field(default_factory=dict)
    transfers: dict = dataclasses.field(default_factory=lambda: {"h2d": 0, "d2h": 0})
    health: list = dataclasses.field(default_factory=list)   # rows whose logits look broken
    slot_problems: list = dataclasses.field(default_factory=list)
    block_size: int | None = None                # the cache's block size (slot = block * block_size + offset)
    # blocks {"used", "cached", "free"} after the run
    cache_usage: dict = dataclasses.field(default_factory=dict)
    # per active row: its request's num_preemptions when the step ran (a change between two steps of a
    # request means it was preempted in between and restarted with a new block table)
    row_preemptions: list = dataclasses.field(default_factory=list)
    # after sampling a verify step: request id -> how many of its drafts were kept (the rest rolled back)
    accepted: dict = dataclasses.field(default_factory=dict)
    _tensors: dict = dataclasses.field(default_factory=dict, repr=False)

    kind = property(lambda self: self.plan.kind,
                    doc='"prefill" | "decode" | "mixed" (both kinds of row) | "verify" (decode rows with drafts)')
    index = property(lambda self: self.plan.index, doc="the session's step counter")
    request_ids = property(lambda self: self.plan.request_ids,
                           doc="one per dispatched row (padding rows repeat the copied id)")
    batch_size = property(lambda self: len(self.plan.rows), doc="rows dispatched")
    num_active = property(lambda self: self.plan.num_active,
                          doc="rows that belong to a real request (< batch_size only when padded)")
    row_kinds = property(lambda self: self.plan.row_kinds,
                         doc='per dispatched row: "decode" or "prefill" (a mixed step has both)')

    @property
    def logits_request_ids(self) -> list[int]:
        """The request of each logits row, in order (a verification row has one per token)."""
        return [self.plan.rows[r].request.id for r in self.plan.logits_rows]

    @property
    def drafts(self) -> dict[int, tuple[int, ...]]:
        """Request id -> the drafts its row verifies (rows with drafts only)."""
        return {r.request.id: r.drafts for r in self.plan.rows[:self.plan.num_active] if r.drafts}

    @property
    def rolled_back(self) -> dict[int, list[int]]:
        """After sampling: request id -> the slots of its rejected drafts, given back ({} before)."""
        return self.plan.rolled_back(self.accepted)

    def _tensor(self, name: str, make) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            t = self._tensors[name] = make()
        return t

    @property
    def host_logits(self) -> torch.Tensor:
        """The logits on the host when the Session copies them (``device_outputs=False``); else an
        empty tensor."""
        if self.host_logits_copy is not None:
            return self.host_logits_copy
        return self._tensor("host_logits", lambda: torch.empty(0))

    @property
    def hidden(self) -> torch.Tensor | None:
        """Device view [rows_out, hidden] of the final hidden states of the logits rows (None when
        no row gets logits, and once the Session is closed)."""
        if self.hidden_rows is None:
            return None
        buffer, rows = self.hidden_rows
        return self._tensor("hidden", lambda: buffer.tensor[:rows])

    def forget_device(self) -> None:
        """Drop every reference to device memory but the logits handle's (a closing Session's:
        plain assignments)."""
        self.hidden_rows = None
        self._tensors.pop("hidden", None)

    @property
    def token_ids(self) -> torch.Tensor | None:
        """After sampling: [rows_out] int64 on the host, one per logits row (None before)."""
        if self.sampled_tokens is None:
            return None
        return self._tensor("token_ids", lambda: torch.tensor(self.sampled_tokens, dtype=torch.int64))

    input_ids = property(lambda self: self._tensor("input_ids", lambda: torch.tensor(self.plan.input_ids)),
                         doc="[tokens]")
    positions = property(lambda self: self._tensor("positions", lambda: torch.tensor(self.plan.positions)),
                         doc="[tokens]")
    slot_mapping = property(lambda self: self._tensor("slot_mapping", lambda: torch.tensor(self.plan.slot_mapping)),
                            doc="[tokens]")
    query_lens = property(lambda self: self._tensor("query_lens", lambda: torch.tensor(self.plan.query_lens)),
                          doc="[rows]")
    seq_lens = property(lambda self: self._tensor("seq_lens", lambda: torch.tensor(self.plan.seq_lens)),
                        doc="[rows]")
    block_tables = property(lambda self: self._tensor("block_tables", self._padded_tables),
                            doc="[rows, max_blocks] int32, -1 padded")

    def _padded_tables(self) -> torch.Tensor:
        tables = self.plan.block_tables
        out = torch.full((len(tables), self.max_blocks), -1, dtype=torch.int32)
        used = max(map(len, tables), default=0)
        if used:
            out[:, :used] = torch.tensor(pad_block_tables(tables, used), dtype=torch.int32)
        return out

    @property
    def sampled(self) -> bool:
        return self.sampled_tokens is not None or not self.plan.logits_rows

    def to_dict(self, *, logits_topk: int = 0) -> dict:
        """What the step dispatched (and sampled) as plain JSON types; see docs/dump-format.md."""
        from ..dump import step_to_dict
        return step_to_dict(self, logits_topk=logits_topk)

    def __repr__(self) -> str:
        from ..inspect.snapshot import take_step
        return repr(take_step(self))

    def _repr_html_(self) -> str:
        from ..inspect.snapshot import take_step
        return take_step(self)._repr_html_()
