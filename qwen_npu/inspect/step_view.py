"""Text and HTML views of a step (from a StepSnapshot) and of DeviceLogits.

A step view is one table, one line per dispatched row::

    row  request  positions  seq_len  block table        slots written        next token
    0    r3       12..15     16       [4][9][11]         [44][45][46][47]     1879

Blocks the row writes in this step are bold; slots written twice in the step get a red outline;
replicate-padding rows are red-striped. DeviceLogits are described (shape, dtype, device, live or
stale), never copied: their view moves no data across the host/device boundary.
"""
from __future__ import annotations

from . import html as h
from .grid import slot_strip_html, table_strip_html
from .snapshot import StepSnapshot

MAX_ROWS = 32


def _tokens_note(s: StepSnapshot) -> str:
    if not s.logits_request_ids:
        return "no row produced logits"
    if not s.sampled:
        n = len(s.logits_request_ids)
        return f"{n} logits row{'s' * (n != 1)}, not sampled yet"
    toks = [r.token_id for r in s.rows if r.token_id is not None]
    return f"sampled {toks}"


def _rows_note(s: StepSnapshot) -> str:
    pad = f" ({s.num_active} active, {s.batch_size - s.num_active} padding)" if s.num_active != s.batch_size else ""
    if s.kind == "mixed":
        d = sum(s.row_kind(r.row) == "decode" for r in s.rows)
        pad = f" ({d} decode, {len(s.rows) - d} prefill)"
    return f"{s.batch_size} row{'s' * (s.batch_size != 1)}{pad}, {s.num_tokens} tokens"


def _row_tag(s: StepSnapshot, r) -> str:
    """" (decode)" / " (prefill)" after a row's request in a mixed step, " (3 drafts, 1 kept)" after
    a verification row; nothing otherwise."""
    tag = f" ({s.row_kind(r.row)})" if s.kind == "mixed" else ""
    return tag + (f" ({_drafts_note(r)})" if r.drafts else "")


def _drafts_note(r) -> str:
    n = len(r.drafts)
    kept = "not sampled yet" if r.accepted is None else f"{r.accepted} kept"
    return f"{n} draft{'s' * (n != 1)} {list(r.drafts)}, {kept}"


def _rolled_back_lines(s: StepSnapshot) -> list[str]:
    return [f"request {rid}: slots {h.runs(slots)} given back (rejected drafts)" for rid, slots in s.rolled_back
            if slots]


def step_summary_text(s: StepSnapshot) -> str:
    return f"step {s.index} ({s.kind}): {_rows_note(s)}, {_tokens_note(s)}"


def step_summary_html(s: StepSnapshot) -> str:
    bad = ""
    if s.slot_problems:
        bad = h.bad_line(f"{len(s.slot_problems)} slot problem{'s' * (len(s.slot_problems) != 1)}")
    if s.health:
        bad += h.bad_line("; ".join(s.health))
    return f"<div>{h.esc(step_summary_text(s))}</div>{bad}"


def _transfers(s: StepSnapshot) -> str:
    return ", ".join(f"{k} {h.fmt_bytes(v)}" for k, v in s.transfers)


def _timings(s: StepSnapshot) -> str:
    return ", ".join(f"{k} {h.fmt_ms(v)}" for k, v in s.timings)


def step_text(s: StepSnapshot) -> str:
    head = f"StepResult(step {s.index}, {s.kind}, {_rows_note(s)}; {_tokens_note(s)})"
    rows = [(r.row, f"{r.request_id}{' (padding)' if r.padding else ''}{_row_tag(s, r)}", h.runs(r.positions),
             r.seq_len,
             h.runs(r.block_table) or "-", h.runs(r.slots), "" if r.token_id is None else r.token_id)
            for r in s.rows[:MAX_ROWS]]
    lines = [head, h.text_table(("row", "request", "positions", "seq_len", "block table", "slots", "token"),
                                rows)]
    if len(s.rows) > MAX_ROWS:
        lines.append(f"  ... {len(s.rows) - MAX_ROWS} more rows")
    lines.append(f"  logits: {s.logits_state}" + (f" {list(s.logits_shape)}" if s.logits_shape else "")
                 + f"; transfers: {_transfers(s)}")
    dup = s.duplicate_slots()
    if dup:
        lines.append("  slots written by more than one row: "
                     + "; ".join(f"{slot} (rows {', '.join(map(str, rows))})" for slot, rows in list(dup.items())[:8]))
    lines += [f"  rolled back: {line}" for line in _rolled_back_lines(s)]
    lines += [f"  problem: {p}" for p in s.slot_problems[:8]]
    lines += [f"  health: {p}" for p in s.health]
    return "\n".join(lines)


def step_html(s: StepSnapshot) -> str:
    dup = s.duplicate_slots()
    tables: dict[int, int] = {}
    for r in s.rows:
        for b in set(r.block_table):
            tables[b] = tables.get(b, 0) + 1
    shared = frozenset(b for b, n in tables.items() if n > 1)
    rows = []
    for r in s.rows[:MAX_ROWS]:
        who = h.request_chip(r.request_id) + (' <span style="color:#cf222e">padding</span>' if r.padding else "")
        if s.kind == "mixed":
            who += " " + h.muted(s.row_kind(r.row))
        if r.drafts:
            who += " " + h.muted(_drafts_note(r))
        token = h.muted("-") if r.token_id is None else h.esc(r.token_id)
        rows.append((str(r.row), who, h.esc(h.runs(r.positions) if len(r.positions) < 4
                                            else f"{r.positions[0]}..{r.positions[-1]}"),
                     str(r.seq_len), table_strip_html(r, s.block_size, shared=shared),
                     slot_strip_html(r, s.block_size, dup), token))
    body = h.table(("row", "request", "positions", "seq_len", "block table (bold: written now)",
                    "slots written", "next token"), rows)
    if len(s.rows) > MAX_ROWS:
        body += h.muted(f"... {len(s.rows) - MAX_ROWS} more rows")
    logits = s.logits_state + (f" {list(s.logits_shape)}" if s.logits_shape else "")
    body += "<div>" + h.fields([("logits", h.esc(logits)), ("transfers", h.esc(_transfers(s)))]) + "</div>"
    body += "<div>" + h.fields([("time", h.esc(_timings(s)))]) + "</div>"
    usage = dict(s.cache_usage)
    if usage:
        body += "<div>" + h.fields([("cache after the step",
                                      h.esc(", ".join(f"{v} {k}" for k, v in usage.items())))]) + "</div>"
    back = _rolled_back_lines(s)
    if back:
        body += "<div>" + h.fields([("rolled back", h.esc("; ".join(back)))]) + "</div>"
    if dup:
        body += h.bad_line(f"{len(dup)} slot{'s' * (len(dup) != 1)} written by more than one row in this step")
    if s.slot_problems:
        body += h.problem_list(s.slot_problems)
    if s.health:
        body += h.problem_list(s.health)
    owners = {r.request_id for r in s.rows}
    body += h.owner_legend(owners, shared=bool(shared), padding=any(r.padding for r in s.rows), collision=bool(dup),
                           shared_label="block in several rows' tables")
    return h.view(f"Step {s.index}: {s.kind}", body, subtitle=h.esc(f"{_rows_note(s)}; {_tokens_note(s)}"))


# ---- DeviceLogits ----------------------------------------------------------------------------------

def logits_fields(logits) -> list[tuple[str, str]]:
    """What a DeviceLogits view shows: metadata only (no device read, no transfer)."""
    from .snapshot import logits_state
    return [("step", str(logits.step_index)), ("shape", str(list(logits.shape))),
            ("dtype", str(logits.dtype).removeprefix("torch.")), ("device", str(logits.device)),
            ("state", logits_state(logits))]


def logits_html(logits) -> str:
    f = logits_fields(logits)
    state = dict(f)["state"]
    note = {"live view": "a view of the step's device output buffer; valid until a later step reuses it "
                         "(.clone() keeps it)",
            "stale": "a later step reused the buffer: .tensor raises StaleOutputError",
            "private copy": "a private device copy: later steps cannot overwrite it"}.get(state, "")
    color = h.BAD_COLOR if state == "stale" else h.MUTED
    body = (h.fields((k, h.esc(v)) for k, v in f)
            + f'<div style="color:{color}">{h.esc(note)}</div>'
            + h.muted("nothing was copied to the host to draw this; use .topk(k) or .to_host() to read values"))
    return h.view("DeviceLogits", body)
