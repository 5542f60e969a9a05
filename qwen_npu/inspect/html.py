"""Self-contained HTML and text building blocks for the notebook views.

Every view is built from these pieces so that they all look alike and stay deterministic:

* inline styles only — no ``<style>`` blocks, no scripts, no CDN, no element ids;
* the same input gives the same bytes (colours come from a fixed palette indexed by request id);
* every function takes plain values (numbers, strings, tuples) and returns a string.

Owner colours, used by every grid and table::

    request id r  ->  PALETTE[r % len(PALETTE)]
    free          ->  white cell, dashed grey border
    cached        ->  grey cell (ref count 0, prefix hash published: reusable)
    shared        ->  owner colour striped with white, dark border (ref count > 1)
    padding       ->  red stripes (a replicate-padding row)
    collision     ->  thick red outline (a slot written twice in one step)
"""
from __future__ import annotations

import html as _html
from collections.abc import Iterable, Sequence

PALETTE = ("#8ecae6", "#ffb703", "#90be6d", "#f4a3b4", "#b8a1e3", "#f9844a",
           "#4cc9a0", "#e9c46a", "#a3b9d9", "#d4a373", "#c7e9b0", "#ffd6a5")
FREE_BG, FREE_BORDER = "#ffffff", "#c8ccd0"
CACHED_BG = "#d0d7de"
PADDING_BG = "repeating-linear-gradient(45deg,#ffb8b0 0 3px,#fff5f4 3px 6px)"
COLLISION_BORDER = "2px solid #cf222e"
OK_COLOR, BAD_COLOR, MUTED = "#1a7f37", "#cf222e", "#57606a"
FONT = "font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;line-height:1.4"

STATUS_COLORS = {"waiting": "#9a6700", "prefilling": "#0969da", "decoding": "#1a7f37",
                 "finished": "#57606a", "aborted": "#cf222e"}


def esc(value) -> str:
    return _html.escape(str(value), quote=True)


def owner_color(request_id: int) -> str:
    return PALETTE[int(request_id) % len(PALETTE)]


def shared_bg(request_id: int) -> str:
    c = owner_color(request_id)
    return f"repeating-linear-gradient(45deg,{c} 0 4px,#ffffff 4px 6px)"


def cell(label, *, bg: str = FREE_BG, border: str = f"1px solid {FREE_BORDER}", title: str = "",
         width: int = 22, color: str = "#1f2328", bold: bool = False) -> str:
    """One small square (or a wider box for a run) in a grid, with a hover title."""
    weight = ";font-weight:bold" if bold else ""
    t = f' title="{esc(title)}"' if title else ""
    return (f'<span{t} style="display:inline-block;box-sizing:border-box;min-width:{width}px;height:18px;'
            f"padding:0 2px;margin:1px;background:{bg};border:{border};border-radius:2px;color:{color};"
            f'font-size:10px;line-height:16px;text-align:center;vertical-align:middle{weight}">{esc(label)}</span>')


def chip(text, color: str) -> str:
    """A rounded label, e.g. a request id in its owner colour or a status."""
    return (f'<span style="display:inline-block;padding:0 5px;border-radius:8px;background:{color};'
            f'color:#1f2328;font-size:11px">{esc(text)}</span>')


def status_chip(status: str) -> str:
    c = STATUS_COLORS.get(status, MUTED)
    return (f'<span style="display:inline-block;padding:0 5px;border-radius:8px;border:1px solid {c};'
            f'color:{c};font-size:11px">{esc(status)}</span>')


def request_chip(request_id) -> str:
    if request_id is None:
        return f'<span style="color:{MUTED}">-</span>'
    return chip(f"r{request_id}", owner_color(request_id))


def legend(items: Iterable[tuple[str, str, str]]) -> str:
    """items: (label, background, border) -> one line of swatches."""
    parts = [f'<span style="margin-right:10px;white-space:nowrap">'
             f'{cell("", bg=bg, border=border, width=14)} {esc(label)}</span>' for label, bg, border in items]
    return f'<div style="margin-top:4px;color:{MUTED}">{" ".join(parts)}</div>'


def owner_legend(request_ids: Iterable[int], *, shared=False, cached=False, free=False, padding=False,
                 collision=False, max_requests: int = 12, shared_label: str = "shared (ref count > 1)") -> str:
    ids = sorted(set(request_ids))
    items = [(f"r{r}", owner_color(r), "1px solid #8c959f") for r in ids[:max_requests]]
    if len(ids) > max_requests:
        items.append((f"... {len(ids) - max_requests} more requests", FREE_BG, "1px solid #ffffff"))
    if shared:
        items.append((shared_label, shared_bg(ids[0] if ids else 0), "1px solid #1f2328"))
    if cached:
        items.append(("cached (reusable prefix)", CACHED_BG, "1px solid #8c959f"))
    if free:
        items.append(("free", FREE_BG, f"1px dashed {FREE_BORDER}"))
    if padding:
        items.append(("padding row", PADDING_BG, "1px solid #cf222e"))
    if collision:
        items.append(("slot written twice", FREE_BG, COLLISION_BORDER))
    return legend(items)


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, raw: bool = True) -> str:
    """A compact table; cells are HTML when ``raw`` (the caller escaped them), else escaped here."""
    th = "".join(f'<th style="text-align:left;padding:1px 8px 1px 0;border-bottom:1px solid #d0d7de;'
                 f'color:{MUTED};font-weight:normal">{esc(h)}</th>' for h in headers)
    body = []
    for row in rows:
        tds = "".join(f'<td style="text-align:left;padding:1px 8px 1px 0;vertical-align:middle">'
                      f'{c if raw else esc(c)}</td>' for c in row)
        body.append(f"<tr>{tds}</tr>")
    return (f'<table style="border-collapse:collapse;margin:2px 0;{FONT}"><thead><tr>{th}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>')


def fields(pairs: Iterable[tuple[str, str]]) -> str:
    """``name value`` pairs on one wrapped line; values are HTML."""
    return " ".join(f'<span style="margin-right:8px;white-space:nowrap"><span style="color:{MUTED}">'
                    f"{esc(k)}</span> {v}</span>" for k, v in pairs)


def stacked_bar(parts: Sequence[tuple[str, int, str]], total: int, *, width: int = 320) -> str:
    """A horizontal bar split into (label, count, css background) parts out of ``total``."""
    segs = []
    for label, n, bg in parts:
        if n <= 0 or total <= 0:
            continue
        w = max(1, round(width * n / total))
        segs.append(f'<span title="{esc(label)}: {n}" style="display:inline-block;height:12px;width:{w}px;'
                    f'background:{bg}"></span>')
    return (f'<span style="display:inline-block;width:{width}px;height:12px;border:1px solid #8c959f;'
            f'vertical-align:middle;background:#ffffff;overflow:hidden;white-space:nowrap;line-height:0">'
            f'{"".join(segs)}</span>')


def view(title: str, body: str, *, subtitle: str = "") -> str:
    """The frame around every view: a bold title line, then the body."""
    sub = f' <span style="color:{MUTED};font-weight:normal">{subtitle}</span>' if subtitle else ""
    return (f'<div style="{FONT};color:#1f2328;border-left:3px solid #0969da;padding:2px 8px;margin:2px 0">'
            f'<div style="font-weight:bold;margin-bottom:2px">{esc(title)}{sub}</div>{body}</div>')


def section(title: str, body: str) -> str:
    return (f'<div style="margin-top:6px"><div style="color:{MUTED};font-size:11px;text-transform:uppercase;'
            f'letter-spacing:0.04em">{esc(title)}</div>{body}</div>')


def ok_line(text: str) -> str:
    return f'<div style="color:{OK_COLOR};font-weight:bold">&#10003; {esc(text)}</div>'


def bad_line(text: str) -> str:
    return f'<div style="color:{BAD_COLOR};font-weight:bold">&#10007; {esc(text)}</div>'


def problem_list(problems: Sequence[str], *, limit: int = 12) -> str:
    items = "".join(f'<li style="color:{BAD_COLOR}">{esc(p)}</li>' for p in problems[:limit])
    more = f'<li style="color:{MUTED}">... {len(problems) - limit} more</li>' if len(problems) > limit else ""
    return f'<ul style="margin:2px 0 2px 16px;padding:0">{items}{more}</ul>'


def muted(text: str) -> str:
    return f'<span style="color:{MUTED}">{esc(text)}</span>'


# ---- text ------------------------------------------------------------------------------------------

def text_table(headers: Sequence[str], rows: Iterable[Sequence[object]], *, indent: str = "  ") -> str:
    """Left-aligned columns padded to their widest cell."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def runs(values: Iterable[int]) -> str:
    """[3, 4, 5, 6, 9, -1] -> "3..6, 9, -1": runs of three or more consecutive ints in order."""
    vals = list(values)
    out: list[str] = []
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{vals[i]}..{vals[j]}")
        else:
            out.extend(str(v) for v in vals[i:j + 1])
        i = j + 1
    return ", ".join(out)


def pre(text: str) -> str:
    """Preformatted text (a text view shown as is in a notebook)."""
    return f"<pre style='font-size:12px'>{esc(text)}</pre>"


def clip(text: str | None, n: int = 60, *, newlines: bool = True) -> str:
    """``text`` cut to ``n`` characters ("..." ending a cut); with ``newlines``, each newline
    shown as the two characters backslash-n, so that the text stays on one line."""
    if text is None:
        return ""
    if newlines:
        text = text.replace("\n", "\\n")
    return text if len(text) <= n else text[:n - 3] + "..."


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def fmt_ms(seconds: float) -> str:
    """Milliseconds as ``1.234 ms`` (the notebooks' sanitize file masks this pattern)."""
    return f"{seconds * 1e3:.3f} ms"
