"""HTML views of the KV view, SlotInfo and the check / audit reports, in the common frame.

Each function reads only the object's own (already copied) fields, except ``kv_html``, which
takes a snapshot of the cache's block states (host bookkeeping only) to draw the block grid.
No device tensor is read; the same object gives the same bytes.
"""
from __future__ import annotations

import html

from ..cache.slot_check import ranges_text
from . import html as h

SHOWN = 20


def kv_html(kv) -> str:
    """``sess.kv``: the cache tensors' shape and size, what was written, and the block grid."""
    from .grid import block_grid_html
    from .snapshot import take_cache
    engine = kv._engine
    k = engine.kv_cache.keys[0]
    ledger = engine.ledger
    nbytes = engine.kv_cache.nbytes
    fields = [("layers", str(kv.num_layers)), ("blocks", str(kv.num_blocks)), ("block_size", str(kv.block_size)),
              ("slots", str(kv.num_slots)), ("per layer", h.esc(f"K and V {list(k.shape)}")),
              ("dtype", h.esc(str(k.dtype).removeprefix("torch."))), ("device", h.esc(k.device)),
              ("size", h.esc(h.fmt_bytes(nbytes)))]
    body = (f"<div>{h.fields(fields)}</div>"
            f"<div>{h.fields([('slots written', str(len(ledger))), ('collisions recorded', str(ledger.num_collisions))])}"
            f"</div>" + h.section("blocks", block_grid_html(take_cache(engine.manager)))
            + h.muted("kv.slot(s): one slot's writes and holders; kv.read(request, position, layer): "
                      "one token's K and V"))
    return h.view("KV cache", body, subtitle=h.esc("[num_blocks, block_size, num_kv_heads, head_dim] per layer"))


def slot_info_html(info) -> str:
    """``sess.kv.slot(s)``: the last write, the holders, the history, collisions and faults."""
    if info.request_id is None:
        last = h.muted("never written")
    else:
        last = (f"{h.request_chip(info.request_id)} position {info.position}, step {info.written_at_step}")
    held = " ".join(f"{h.request_chip(r)} position {p}" for r, p in info.held_by) or h.muted(
        "nobody (not a live token)")
    rows = [(str(w.step), h.request_chip(w.request_id), str(w.position)) for w in info.history]
    body = (h.fields([("block", str(info.block)), ("offset", str(info.offset)), ("last write", last)])
            + h.section("held by", held)
            + h.section("write history (oldest first)",
                        h.table(("step", "request", "position"), rows) if rows else h.muted("none")))
    bad = [str(c) for c in info.collisions] + list(info.faults)
    if bad:
        body += h.section("collisions and faults", h.problem_list(bad))
    title = f"Slot {info.slot}" + (" (collided)" if info.collisions else "")
    return h.view(title, body)


def check_html(report) -> str:
    """``sess.check()``: ok, or the problems by section."""
    summary = report._summary()
    if report.ok:
        return h.view("Check", h.ok_line(f"ok ({summary})"))
    n = len(report.items)
    body = h.bad_line(f"{n} problem{'s' * (n != 1)} ({summary})")
    for name in _sections(report):
        msgs = report.section(name)
        if msgs:
            body += h.section(f"{name} ({len(msgs)})", h.problem_list(list(msgs), limit=SHOWN))
    return h.view("Check", body)


def _sections(report):
    seen = []
    for p in report.items:
        if p.section not in seen:
            seen.append(p.section)
    return seen


def audit_html(report) -> str:
    """``sess.audit(request)``: per layer max |cached - recomputed| against the tolerance."""
    rows = []
    for layer in report.layers:
        mark = (f'<span style="color:{h.OK_COLOR}">ok</span>' if layer.ok
                else f'<span style="color:{h.BAD_COLOR};font-weight:bold">BAD</span>')
        rows.append((str(layer.layer), h.esc(f"{layer.key_max_diff:.3g}"), h.esc(f"{layer.key_tol:.2g}"),
                     h.esc(f"{layer.value_max_diff:.3g}"), h.esc(f"{layer.value_tol:.2g}"), mark))
    table = h.table(("layer", "max |dK|", "tol", "max |dV|", "tol", ""), rows)
    head = (h.ok_line(f"request {report.request_id}: the cached K/V of {report.num_tokens} tokens match a dense "
                      f"recomputation")
            if report.ok else
            h.bad_line(f"request {report.request_id}: {len(report.mismatches)} mismatches in {report.num_tokens} tokens"))
    body = head + table
    if report.mismatches:
        body += h.problem_list([str(m) for m in report.mismatches], limit=SHOWN)
    return h.view("Audit", body, subtitle=h.esc(f"request {report.request_id}, {report.dtype}"))


def slot_report_html(report) -> str:
    """``SlotReport`` (the slot check of one dispatch) as a table; deterministic: no ids, no scripts."""
    if report.ok:
        ok = f"&#10003; slot mapping ok ({report._summary()})"
        return f'<div style="color:#1a7f37;font-weight:bold">{ok}</div>'
    cells = "".join(f"<th style='text-align:left;padding:2px 6px'>{h}</th>" for h in
                    ("check", "rows", "requests", "slot", "block", "offset", "problem"))
    body = "".join(
        "<tr>" + "".join(f"<td style='padding:2px 6px;text-align:left;vertical-align:top'>"
                         f"{html.escape(str(v))}</td>" for v in (
            p.check, ranges_text(p.rows), ", ".join(map(str, p.request_ids)) or "-", p.slot, p.block,
            p.offset, p.message)) + "</tr>" for p in report.items)
    n = len(report.items)
    return (f'<div style="font-family:ui-monospace,monospace;font-size:12px"><div style="color:#cf222e;'
            f'font-weight:bold">&#10007; {n} slot problem{"s" * (n != 1)} ({report._summary()})</div>'
            f'<table><thead><tr>{cells}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>")


def memory_report_html(report) -> str:
    """``sess.memory()`` as a two-column table."""
    cell = "<td style='text-align:left;padding:2px 6px'>{}</td>"
    body = "".join(f"<tr>{cell.format(html.escape(k.strip()))}{cell.format(html.escape(v))}</tr>"
                   for k, v in report.rows())
    return f"<div><b>memory ({html.escape(report.device)})</b><table>{body}</table></div>"
