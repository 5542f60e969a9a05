"""Text and HTML of the inspect records ``sess.blocks`` (``BlocksSnapshot``), ``inspect_slot``
(``SlotDetail``) and ``topk`` (``TopK``). The records' ``__repr__`` and ``_repr_html_`` import these
functions when called; each gives the same string for the same record."""
from __future__ import annotations

from . import html as h
from .blocks import FREE, BlockEntry, BlocksSnapshot
from .slot_detail import SlotDetail
from .topk import TopK

# ---- sess.blocks ---------------------------------------------------------------------------------

def blocks_text(self: BlocksSnapshot) -> str:
    shown, more = self._shown()
    lines = [f"Blocks({self.summary()})"]
    if shown:
        lines.append(h.text_table(("block", "state", "ref", "requests", "hash", "tokens"),
                                  [_cells(e) for e in shown]))
    if more:
        lines.append(f"  ... {more} more used or cached blocks")
    free = [e.block_id for e in self.entries if e.state == FREE]
    if free:
        lines.append(f"  free: {h.clip(h.runs(free), 100)}")
    return "\n".join(lines)


def blocks_html(self: BlocksSnapshot) -> str:
    shown, more = self._shown()
    rows = [[h.esc(c) for c in _cells(e)] for e in shown]
    body = h.table(("block", "state", "ref", "requests", "hash", "tokens"), rows) if rows else ""
    if more:
        body += f"<div>{h.muted(f'... {more} more used or cached blocks')}</div>"
    free = [e.block_id for e in self.entries if e.state == FREE]
    if free:
        body += f"<div>{h.muted('free: ' + h.clip(h.runs(free), 100))}</div>"
    return h.view("Blocks", body, subtitle=h.esc(self.summary()))


def _cells(e: BlockEntry) -> tuple[str, ...]:
    reqs = ",".join(map(str, e.request_ids)) or "-"
    toks = ", ".join(map(str, e.token_ids[:8])) + (", ..." if e.num_tokens > 8 else "")
    return (str(e.block_id), e.state, str(e.ref_count), reqs, short_hash(e.block_hash), f"[{toks}]")


def short_hash(block_hash: int | None) -> str:
    """The low 32 bits of a prefix hash in hex (``-`` for none): enough to tell blocks apart."""
    return "-" if block_hash is None else f"{block_hash & 0xFFFFFFFF:08x}"


# ---- inspect_slot --------------------------------------------------------------------------------

def _state(d: SlotDetail) -> str:
    if d.ref_count > 1:
        return f"shared (ref count {d.ref_count})"
    if d.ref_count == 1:
        return "used"
    return "cached (ref count 0, reusable prefix)" if d.cached else "free"


def slot_detail_text(d: SlotDetail) -> str:
    held = ", ".join(f"request {r} position {p}" for r, p in d.holders) or "nobody"
    hist = "; ".join(f"request {r} position {p} at step {s}" for r, p, s in d.history) or "never written"
    norms = ", ".join(f"L{i} {k:.3f}/{v:.3f}" for i, (k, v) in enumerate(zip(d.k_norms, d.v_norms)))
    return (f"Slot {d.slot} (block {d.block}, offset {d.offset}): {_state(d)}\n  held by: {held}\n"
            f"  writes: {hist}\n  |K|/|V| by layer: {norms}")


def slot_detail_html(d: SlotDetail) -> str:
    held = " ".join(f"{h.request_chip(r)} position {p}" for r, p in d.holders) or h.muted("nobody")
    rows = [(h.request_chip(r), str(p), str(s)) for r, p, s in d.history]
    hist = h.table(("request", "position", "step"), rows) if rows else h.muted("never written")
    norms = h.table(["layer"] + [str(i) for i in range(len(d.k_norms))],
                    [["|K|"] + [f"{x:.3f}" for x in d.k_norms], ["|V|"] + [f"{x:.3f}" for x in d.v_norms]])
    body = (h.fields([("block", str(d.block)), ("offset", str(d.offset)), ("state", h.esc(_state(d)))])
            + h.section("held by", held) + h.section("write history (oldest first)", hist)
            + h.section("K/V norms", norms))
    return h.view(f"Slot {d.slot}", body)


# ---- topk ----------------------------------------------------------------------------------------

def fmt_prob(p: float) -> str:
    """0.4215 -> "0.4215", 6.6e-06 -> "6.6e-06": four significant digits at most."""
    return f"{p:.4g}"


def _label(t: TopK, r: int, j: int) -> str:
    tok = t.token_ids[r][j]
    return f"{tok} {t.texts[r][j]!r}" if t.texts is not None else str(tok)


def topk_text(t: TopK) -> str:
    lines = [f"top-{len(t.token_ids[0]) if t.token_ids else 0} next tokens of step {t.step}"]
    for r, rid in enumerate(t.request_ids):
        lines.append(f"  request {rid}: " + ", ".join(f"{_label(t, r, j)} {fmt_prob(p)}"
                                                      for j, p in enumerate(t.probs[r])))
    return "\n".join(lines)


def topk_html(t: TopK) -> str:
    rows = []
    for r, rid in enumerate(t.request_ids):
        bars = []
        top = max(t.probs[r], default=0.0) or 1.0
        for j, p in enumerate(t.probs[r]):
            w = max(1, round(80 * p / top))          # bars relative to the row's most likely token
            bars.append(f'<div style="white-space:nowrap"><span style="display:inline-block;width:{w}px;height:9px;'
                        f'background:{h.owner_color(rid)};border:1px solid #8c959f;vertical-align:middle"></span>'
                        f" {fmt_prob(p)} {h.esc(_label(t, r, j))}</div>")
        rows.append((h.request_chip(rid), "".join(bars)))
    body = h.table(("request", "next token: probability, id, text"), rows) if rows else h.muted("no rows")
    return h.view(f"Top-{len(t.token_ids[0]) if t.token_ids else 0} next tokens", body,
                  subtitle=h.esc(f"step {t.step}"))
