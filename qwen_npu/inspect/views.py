"""Text and HTML views of a Session and its Requests, rendered from snapshots.

Each ``*_html`` / ``*_text`` function takes a snapshot (see ``snapshot``) and returns a string;
the same snapshot always gives the same bytes. ``session_html`` is sized to fit one screen: the
model and settings, the cache (a bar, prefix-cache counters and a block grid), the requests by
status (the most relevant first, at most ``MAX_REQUEST_ROWS``), and the last step.
"""
from __future__ import annotations

from . import html as h
from .grid import block_grid_html, block_grid_text
from .snapshot import CacheSnapshot, RequestSnapshot, SessionSnapshot
from .step_view import step_summary_html, step_summary_text

MAX_REQUEST_ROWS = 8
STATUS_ORDER = ("prefilling", "decoding", "waiting", "finished", "aborted")


# ---- cache -----------------------------------------------------------------------------------------

def cache_line(c: CacheSnapshot) -> str:
    return (f"{c.num_used} used, {c.num_cached} cached, {c.num_free} free of {c.num_blocks} blocks "
            f"x {c.block_size} slots")


def prefix_line(c: CacheSnapshot) -> str:
    if not c.prefix_cache:
        return "prefix cache off"
    s = dict(c.prefix_stats)
    return (f"prefix cache: {int(s.get('queries', 0))} lookups, {int(s.get('hit_blocks', 0))} blocks hit, "
            f"{int(s.get('miss_blocks', 0))} missed, hit rate {100 * s.get('hit_rate', 0.0):.0f}% of "
            f"{int(s.get('hit_tokens', 0) + s.get('miss_tokens', 0))} eligible tokens")


def cache_html(c: CacheSnapshot) -> str:
    bar = h.stacked_bar([("used", c.num_used, "#0969da"), ("cached", c.num_cached, h.CACHED_BG)], c.num_blocks)
    return (f"<div>{bar} {h.esc(cache_line(c))}</div><div>{h.esc(prefix_line(c))}</div>"
            f'<div style="margin-top:3px">{block_grid_html(c)}</div>')


def cache_text(c: CacheSnapshot) -> str:
    return f"  {cache_line(c)}\n  {prefix_line(c)}\n{block_grid_text(c)}"


# ---- requests --------------------------------------------------------------------------------------

def _ordered(requests) -> list[RequestSnapshot]:
    rank = {s: i for i, s in enumerate(STATUS_ORDER)}
    return sorted(requests, key=lambda r: (rank.get(r.status, len(rank)), r.id))


def _out(r: RequestSnapshot) -> str:
    if r.output_text is not None:
        return repr(h.clip(r.output_text, 40, newlines=False))     # repr shows a newline once, as \n
    return h.clip(str(list(r.output_token_ids)), 40)


def requests_html(requests, *, limit: int = MAX_REQUEST_ROWS) -> str:
    """A table of requests, the running ones first; ``limit`` rows at most."""
    if not requests:
        return h.muted("no requests")
    rows = []
    ordered = _ordered(requests)
    for r in ordered[:limit]:
        table = "".join(h.cell(b, bg=h.owner_color(r.id), border="1px solid #8c959f") for b in r.block_table[:12])
        if len(r.block_table) > 12:
            table += h.muted(f" +{len(r.block_table) - 12}")
        rows.append((h.request_chip(r.id), h.status_chip(r.status), str(len(r.prompt_token_ids)),
                     str(len(r.output_token_ids)), str(r.num_computed_tokens), str(r.num_cached_tokens),
                     table or h.muted("-"), h.esc(_out(r)), h.esc(r.finish_reason or "")))
    more = h.muted(f"... {len(ordered) - limit} more") if len(ordered) > limit else ""
    return h.table(("request", "status", "prompt", "output", "computed", "cached", "blocks", "output text",
                    "finish"), rows) + more


def requests_text(requests, *, limit: int = MAX_REQUEST_ROWS) -> str:
    if not requests:
        return "  no requests"
    ordered = _ordered(requests)
    rows = [(r.id, r.status, len(r.prompt_token_ids), len(r.output_token_ids), r.num_computed_tokens,
             r.num_cached_tokens, h.runs(r.block_table) or "-", _out(r), r.finish_reason or "")
            for r in ordered[:limit]]
    text = h.text_table(("id", "status", "prompt", "output", "computed", "cached", "blocks", "output text",
                         "finish"), rows)
    return text + (f"\n  ... {len(ordered) - limit} more" if len(ordered) > limit else "")


def request_text(r: RequestSnapshot) -> str:
    return (f"Request(id={r.id}, status={r.status!r}, prompt={len(r.prompt_token_ids)} tokens, "
            f"output={len(r.output_token_ids)} tokens, computed={r.num_computed_tokens}, "
            f"cached={r.num_cached_tokens}, blocks={list(r.block_table)}, finish_reason={r.finish_reason!r})")


def request_html(r: RequestSnapshot) -> str:
    bs = r.block_size
    cells = []
    for i, b in enumerate(r.block_table):
        title = f"block_table[{i}] = block {b}"
        if bs:
            lo = i * bs
            filled = max(0, min(bs, r.num_computed_tokens - lo))
            title += f": positions {lo}..{lo + bs - 1}, {filled}/{bs} computed"
            if lo < r.num_cached_tokens:
                title += " (from the prefix cache)"
        shared = bs is not None and i * bs < r.num_cached_tokens
        cells.append(h.cell(b, bg=h.shared_bg(r.id) if shared else h.owner_color(r.id),
                            border="1px solid #1f2328" if shared else "1px solid #8c959f", title=title))
    prompt = r.prompt_text if r.prompt_text is not None else str(list(r.prompt_token_ids))
    output = r.output_text if r.output_text is not None else str(list(r.output_token_ids))
    body = (h.fields([("status", h.status_chip(r.status)), ("prompt", f"{len(r.prompt_token_ids)} tokens"),
                      ("output", f"{len(r.output_token_ids)} tokens"),
                      ("computed", str(r.num_computed_tokens)), ("cached", str(r.num_cached_tokens)),
                      ("preemptions", str(r.num_preemptions)), ("finish", h.esc(r.finish_reason or "-"))])
            + h.section("block table", "".join(cells) or h.muted("no blocks"))
            + h.section("prompt", h.esc(h.clip(prompt, 200)))
            + h.section("output", h.esc(h.clip(output, 200)) or h.muted("none yet")))
    return h.view(f"Request {r.id}", body, subtitle=h.request_chip(r.id))


# ---- session ---------------------------------------------------------------------------------------

def _status_counts(s: SessionSnapshot) -> str:
    by = s.by_status()
    return ", ".join(f"{by[k]} {k}" for k in STATUS_ORDER if k in by) or "none"


def session_text(s: SessionSnapshot) -> str:
    model = ", ".join(f"{k} {v}" for k, v in s.model)
    settings = ", ".join(f"{k}={v}" for k, v in s.settings)
    last = step_summary_text(s.last_step) if s.last_step is not None else "none yet"
    lines = [f"Session({s.model_name}: {model})", f"  {settings}", "cache:", cache_text(s.cache),
             f"requests: {_status_counts(s)}", requests_text(s.requests),
             f"steps: {s.num_steps}; last step: {last}"]
    if s.num_collisions:
        lines.append(f"slot collisions recorded: {s.num_collisions}")
    if s.faults is not None:
        lines.append(f"EMULATED faults on: {s.faults}")
    return "\n".join(lines)


def session_html(s: SessionSnapshot) -> str:
    model = h.fields((k, h.esc(v)) for k, v in s.model)
    settings = h.fields((k, h.esc(v)) for k, v in s.settings)
    last = step_summary_html(s.last_step) if s.last_step is not None else h.muted("none yet")
    collisions = h.bad_line(f"{s.num_collisions} slot collisions recorded") if s.num_collisions else ""
    if s.faults is not None:
        collisions += h.bad_line(f"EMULATED faults on: {s.faults}")
    body = (f"<div>{model}</div><div>{settings}</div>"
            + h.section("cache", cache_html(s.cache))
            + h.section(f"requests: {_status_counts(s)}", requests_html(s.requests))
            + h.section(f"steps: {s.num_steps}, last step", last) + collisions)
    return h.view(f"Session {s.model_name}", body)


def closed_session_html(sess) -> str:
    """A closed Session: its one-line repr."""
    return f"<div>{h.esc(repr(sess))}</div>"
