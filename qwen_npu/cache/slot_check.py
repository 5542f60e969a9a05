"""Find KV slot collisions and bad writes in one step's slot mapping, before it is dispatched.

    slot = block_table[row][pos // block_size] * block_size + pos % block_size
    e.g. block_size 16, block_table [7, 128], pos 19  ->  128 * 16 + 3 = slot 2051 (block 128, offset 3)

Two front doors share one core (`_find`), which walks the tokens once with dicts and sets and formats
text only for the slots it flags:

- `check_slot_mapping(...)`: a pure function for anybody's dispatch (lists or tensors) -> `SlotReport`.
- `check_step_writes(StepWrites, ...)`: the Session's pre-dispatch check; it also knows ref counts
  (copy-on-write) and the `SlotLedger` (overwriting another request's live token) -> [SlotProblem].

Slot -1 means "do not write" and is never a problem. Rows at and past the active count are padding
and must carry -1 only. One problem per (check, slot), naming every row involved.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby

from ..errors import SlotCollisionError, warn
from .ledger import SlotLedger

# a step's kind; a mixed step has decode and prefill rows, a verify step decode rows with drafts
KINDS = ("prefill", "decode", "mixed", "verify")
CHECKS = ("duplicate", "padding_write", "beyond_cache", "outside_blocks", "wrong_slot", "shared_block",
          "live_overwrite")  # also the order problems are reported in


class SlotCollisionWarning(UserWarning):
    """`slot_check="warn"`: a step writes a KV slot it must not write."""


@dataclass(frozen=True)
class SlotProblem:
    """One bad write: `check` (one of CHECKS) at `slot` = block * block_size + offset."""

    check: str
    slot: int
    block: int
    offset: int
    rows: tuple[int, ...]
    request_ids: tuple[int, ...]
    message: str
    positions: tuple[int, ...] = ()

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class StepWrites:
    """What one step is about to write, row by row (rows >= num_active are padding)."""

    step: int
    kind: str                          # "prefill" | "decode" | "mixed" | "verify"
    num_dispatched: int                # rows launched
    num_active: int                    # real rows; padding rows carry the request id they copied
    row_request_ids: list[int]         # [rows]
    row_positions: list[list[int]]     # [rows][tokens of the row]
    row_slots: list[list[int]]         # [rows][tokens of the row]
    row_block_tables: list[list[int]]  # [rows][blocks], may be -1 padded
    # [rows] "decode" | "prefill"; () = every row of the step's kind (a "mixed" step must say)
    row_kinds: Sequence[str] = ()
    # [rows] drafts a decode row verifies (it writes 1 + that many tokens); () = none anywhere
    row_drafts: Sequence[int] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"step {self.step}: kind must be one of {', '.join(map(repr, KINDS))}, "
                             f"got {self.kind!r}")
        n, at = self.num_dispatched, f"step {self.step}"
        if self.row_kinds or self.kind == "mixed":
            if len(self.row_kinds) != n:
                raise ValueError(f"{at}: row_kinds has {len(self.row_kinds)} rows, expected {n} "
                                 f"(a mixed step names each row's kind)")
            own = "decode" if self.kind == "verify" else self.kind
            bad = [(r, k) for r, k in enumerate(self.row_kinds) if k not in ("decode", "prefill")
                   or (self.kind != "mixed" and k != own)]
            if bad:
                raise ValueError(f"{at} ({self.kind}): row {bad[0][0]} has kind {bad[0][1]!r}")
        if self.row_drafts and len(self.row_drafts) != n:
            raise ValueError(f"{at}: row_drafts has {len(self.row_drafts)} rows, expected {n}")
        for r, k in enumerate(self.row_kinds):
            want = 1 + (self.row_drafts[r] if self.row_drafts else 0)
            if k == "decode" and len(self.row_slots[r]) != want:
                drafts = f" (its last token and {want - 1} drafts)" if want > 1 else ""
                raise ValueError(f"{at}: row {r} is a decode row{drafts} but writes {len(self.row_slots[r])} "
                                 f"tokens")
        if not 0 <= self.num_active <= n:
            raise ValueError(f"{at}: num_active={self.num_active} not in 0..{n}")
        for name in ("row_request_ids", "row_positions", "row_slots", "row_block_tables"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{at}: {name} has {len(getattr(self, name))} rows, expected {n}")
        for r, (ps, ss) in enumerate(zip(self.row_positions, self.row_slots)):
            if len(ps) != len(ss):
                raise ValueError(f"{at}: row {r} has {len(ps)} positions but {len(ss)} slots")

    def token_writes(self) -> tuple[list[int], list[int], list[int]]:
        """(slot, position, row) of every token, in row order: the rows read token by token (a
        step's plan has these lists already and hands them out as they are)."""
        slots = [s for row in self.row_slots for s in row]
        pos = [p for row in self.row_positions for p in row]
        return slots, pos, [r for r, row in enumerate(self.row_slots) for _ in row]


class ProblemReport:
    """What a check found, as ``.items`` (each with a ``.message``): ``.ok`` when there is none,
    ``.problems`` the sentences. The slot check of a step and ``sess.check()`` both report so."""

    items: tuple

    @property
    def ok(self) -> bool:
        return not self.items

    @property
    def problems(self) -> tuple[str, ...]:
        return tuple(p.message for p in self.items)


@dataclass(frozen=True)
class SlotReport(ProblemReport):
    """Result of `check_slot_mapping`: `.ok`, `.problems` (sentences), `.items` (SlotProblem)."""

    items: tuple[SlotProblem, ...]
    num_tokens: int
    num_rows: int
    num_active: int

    def _summary(self) -> str:
        return f"{self.num_tokens} tokens in {self.num_rows} rows ({self.num_active} active)"

    def __repr__(self) -> str:
        if self.ok:
            return f"SlotReport: ok ({self._summary()})"
        n = len(self.items)
        lines = [f"SlotReport: {n} problem{'s' * (n != 1)} ({self._summary()})"]
        return "\n".join(lines + [f"  - {m}" for m in self.problems])

    def _repr_html_(self) -> str:
        from ..inspect.report_views import slot_report_html
        return slot_report_html(self)


def check_slot_mapping(slot_mapping, block_tables, block_size: int, *, positions=None, seq_lens=None,
                       num_blocks: int | None = None, active_rows: int | None = None,
                       query_lens=None) -> SlotReport:
    """Check one step's dispatch: lists or tensors, no model or Session needed.

    `slot_mapping`: [tokens]; `block_tables`: [rows, max_blocks] (-1 padded). Tokens belong to rows by
    `query_lens` ([rows], tokens per row), or one token per row when omitted (then tokens must equal
    rows). `positions` ([tokens]) or `seq_lens` ([rows], context length including the row's last
    token; positions then run seq_len - query_len .. seq_len - 1) enable the expected-slot check;
    `positions` wins when both are given. `num_blocks` enables the beyond-the-cache check.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    slots, tables = _ints(slot_mapping), _tables(block_tables)
    n, num_rows = len(slots), len(tables)
    if query_lens is not None:
        qls = _ints(query_lens)
        if len(qls) != num_rows or sum(qls) != n:
            raise ValueError(f"query_lens has {len(qls)} rows summing to {sum(qls)} tokens, but block_tables "
                             f"has {num_rows} rows and slot_mapping {n} tokens")
    elif n == num_rows:
        qls = [1] * n
    else:
        raise ValueError(f"slot_mapping has {n} tokens but block_tables has {num_rows} rows; pass "
                         f"query_lens (tokens per row) when rows compute more than one token")
    tok_rows = [r for r, q in enumerate(qls) for _ in range(q)]
    pos = None
    if positions is not None:
        pos = _ints(positions)
        if len(pos) != n:
            raise ValueError(f"positions has {len(pos)} entries but slot_mapping has {n} tokens")
    elif seq_lens is not None:
        sl = _ints(seq_lens)
        if len(sl) != num_rows:
            raise ValueError(f"seq_lens has {len(sl)} entries but block_tables has {num_rows} rows")
        pos = [p for s, q in zip(sl, qls) for p in range(s - q, s)]
    active = num_rows if active_rows is None else int(active_rows)
    if not 0 <= active <= num_rows:
        raise ValueError(f"active_rows={active_rows} not in 0..{num_rows}")
    items = _find(lambda: "", slots, tok_rows, pos, tables, active, block_size, num_blocks)
    return SlotReport(tuple(items), n, num_rows, active)


def check_step_writes(writes: StepWrites, *, block_size: int, num_blocks: int | None,
                      ref_count: Callable[[int], int] | None = None, ledger: SlotLedger | None = None,
                      is_live: Callable[[int, int, int], bool] | None = None) -> list[SlotProblem]:
    """All problems of one step about to run, most serious first; [] when the step is safe.

    `ref_count(block)` > 1 marks a shared prefix block (never written). With `ledger` and
    `is_live(request_id, position, slot)` (does that token still hold that slot?), overwriting a live token
    of another request is a problem; the ledger alone only adds "last written by" to messages.
    """
    w = writes
    slots, pos, tok_rows = w.token_writes()

    def header() -> str:                      # made only when a problem is found
        kind, n = w.kind, w.num_dispatched
        if w.kind == "mixed":
            d = w.row_kinds[:w.num_active].count("decode")
            kind = f"mixed: {d} decode, {w.num_active - d} prefill"
        elif w.kind == "verify":
            kind = f"verify: {sum(getattr(w, 'row_drafts', ()))} drafts"
        return f"step {w.step} ({kind}, {n} row{'s' * (n != 1)} dispatched, {w.num_active} active): "
    return _find(header, slots, tok_rows, pos, w.row_block_tables, w.num_active, block_size, num_blocks,
                 w.row_request_ids, ref_count, ledger, is_live,
                 row_kinds=w.row_kinds if w.kind == "mixed" else None)


def format_problems(problems: Sequence[SlotProblem]) -> str:
    """One problem per line, in the order given (most serious first)."""
    return "\n".join(p.message for p in problems)


def raise_or_warn(problems: Sequence[SlotProblem], mode: str) -> None:
    """Apply `slot_check`: "raise" -> SlotCollisionError, "warn" -> SlotCollisionWarning (pointed at
    the first frame outside qwen_npu, ``errors.warn``), "off" -> nothing."""
    if mode not in ("raise", "warn", "off"):
        raise ValueError(f"slot_check must be 'raise', 'warn' or 'off', got {mode!r}")
    if not problems or mode == "off":
        return
    if mode == "warn":
        return warn(format_problems(problems), SlotCollisionWarning)
    err = SlotCollisionError(format_problems(problems))
    err.problems = tuple(problems)
    raise err


# ---------------------------------------------------------------------------------------------- core

def _find(header, slots, tok_rows, tok_pos, tables, num_active, bs, num_blocks, row_req=None,
          ref_count=None, ledger=None, is_live=None, row_kinds=None) -> list[SlotProblem]:
    """Walk the tokens once; collect token indices per (check, slot); describe only what was flagged.
    ``header()`` gives the text that starts every problem's message (called only when one is found)."""
    hits: dict[tuple[str, int], list[int]] = {}
    seen: dict[int, int] = {}
    limit = None if num_blocks is None else num_blocks * bs
    row_sets: dict[int, set[int]] = {}
    refs: dict[int, int] = {}
    live = ledger is not None and is_live is not None and row_req is not None
    for i, s in enumerate(slots):
        if s < 0:
            continue
        r = tok_rows[i]
        if s in seen:
            hits.setdefault(("duplicate", s), [seen[s]]).append(i)
        else:
            seen[s] = i
        if r >= num_active:
            hits.setdefault(("padding_write", s), []).append(i)
        if limit is not None and s >= limit:
            hits.setdefault(("beyond_cache", s), []).append(i)
            continue
        b = s // bs
        table = tables[r]
        good = False
        if tok_pos is not None:
            p = tok_pos[i]
            j = p // bs
            good = 0 <= j < len(table) and table[j] >= 0 and table[j] * bs + p % bs == s
        if not good:
            if r not in row_sets:
                row_sets[r] = set(table)
            if b not in row_sets[r]:
                hits.setdefault(("outside_blocks", s), []).append(i)
            elif tok_pos is not None:
                hits.setdefault(("wrong_slot", s), []).append(i)
        if ref_count is not None:
            c = refs.get(b)
            if c is None:
                c = refs[b] = ref_count(b)
            if c > 1:
                hits.setdefault(("shared_block", s), []).append(i)
        if live:
            last = ledger.last_raw(s)  # (request_id, position, step)
            if last is not None and last[0] != row_req[r] and is_live(last[0], last[1], s):
                hits.setdefault(("live_overwrite", s), []).append(i)
    if not hits:
        return []
    order = {c: k for k, c in enumerate(CHECKS)}
    keys = sorted(hits, key=lambda k: (order[k[0]], hits[k][0]))
    ctx = (header(), tok_rows, tok_pos, tables, num_active, bs, num_blocks, row_req, refs, ledger, row_kinds)
    return [_describe(check, s, hits[(check, s)], ctx) for check, s in keys]


def _describe(check, slot, idx, ctx) -> SlotProblem:
    header, tok_rows, tok_pos, tables, num_active, bs, num_blocks, row_req, refs, ledger, row_kinds = ctx
    block, offset = divmod(slot, bs)
    limit = None if num_blocks is None else num_blocks * bs
    rows = tuple(sorted({tok_rows[i] for i in idx}))
    reqs = tuple(dict.fromkeys(row_req[r] for r in rows)) if row_req is not None else ()
    pos = tuple(tok_pos[i] for i in idx) if tok_pos is not None else ()
    many = len(rows) > 1
    who = f"row{'s' * many} {ranges_text(rows)}"
    if reqs:
        who += f" (request{'s' * (len(reqs) > 1)} {', '.join(map(str, reqs))})"
    if row_kinds:                     # a mixed step: say which rows decode and which prefill
        who += " [" + ", ".join(f"{row_kinds[r]} row {r}" for r in rows) + "]"
    s = "" if many else "s"
    where = f"slot {slot} (block {block}, offset {offset})"
    last = ledger.last(slot) if ledger is not None else None
    if check == "duplicate":
        if many:
            text = f"{who} {'both' if len(rows) == 2 else 'all'} write {where}"
        else:
            text = f"{who} writes {where} {len(idx)} times" + (
                f" (positions {ranges_text(pos)})" if pos else "")
    elif check == "padding_write":
        text = (f"{who} {'are' if many else 'is'} padding (only {num_active} active) but write{s} {where}; "
                f"padding rows must carry slot -1")
    elif check == "beyond_cache":
        text = f"{who} write{s} {where}, beyond the cache ({num_blocks} blocks x {bs} = {limit} slots)"
    elif check == "outside_blocks":
        their = "their" if many else "its"
        text = f"{who} write{s} {where}, outside {their} blocks {_blocks(tables[rows[0]])}"
        if pos:
            text += f"; position {pos[0]} {_expected(tables[tok_rows[idx[0]]], pos[0], bs)}"
    elif check == "wrong_slot":
        text = f"{who}, position {pos[0]}: {_expected(tables[tok_rows[idx[0]]], pos[0], bs)}, got {where}"
    elif check == "shared_block":
        text = (f"{who} write{s} {where}, but block {block} is shared (ref count {refs[block]}); "
                f"copy-on-write: give the token a private block first")
    else:  # live_overwrite
        text = (f"{who} overwrite{s} {where}, which still holds request {last.request_id} at position "
                f"{last.position} (written in step {last.step})")
    if last is not None and check != "live_overwrite":
        text += f", last written by request {last.request_id} at position {last.position}"
        if last.rolled_back_in is not None:
            text += f" (a rejected draft, rolled back in step {last.rolled_back_in})"
    return SlotProblem(check, slot, block, offset, rows, reqs, header + text, pos)


def _expected(table, p, bs) -> str:
    j = p // bs
    if not (0 <= j < len(table) and table[j] >= 0):
        return f"has no block in the row's table (needs block_table[{j}], table has {_blocks(table)})"
    e = table[j] * bs + p % bs
    return f"expected slot {e} (block {table[j]}, offset {p % bs}) = block_table[{j}] * {bs} + {p % bs}"


def ranges_text(values) -> str:
    """(0, 3, 4, 5, 6) -> "0, 3..6": runs of three or more consecutive ints become a..b."""
    parts: list[str] = []
    for _, group in groupby(enumerate(sorted(set(values))), lambda t: t[1] - t[0]):
        run = [v for _, v in group]
        parts += [f"{run[0]}..{run[-1]}"] if len(run) >= 3 else [str(v) for v in run]
    return ", ".join(parts)


def _blocks(table) -> str:
    b = [x for x in table if x >= 0]
    if len(b) <= 8:
        return "[" + ", ".join(map(str, b)) + "]"
    return f"[{b[0]}, {b[1]}, {b[2]}, ..., {b[-2]}, {b[-1]}] ({len(b)} blocks)"


def _ints(x) -> list[int]:
    x = x.tolist() if hasattr(x, "tolist") else x
    if x and isinstance(x[0], (list, tuple)):
        raise ValueError("expected a flat sequence of ints, got a nested one")
    return [int(v) for v in x]


def _tables(x) -> list[list[int]]:
    x = x.tolist() if hasattr(x, "tolist") else x
    return [[int(v) for v in row] for row in x]
