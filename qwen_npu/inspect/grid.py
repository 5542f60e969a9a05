"""Grids of blocks and slots coloured by owner (see ``html`` for the colour key).

    block grid (the whole cache)        one cell per block, labelled with its id
    block-table strip (one step row)    the row's blocks in table order; blocks this row writes are bold
    slot strip (one step row)           the slots the row writes; runs inside a block collapse
                                        into one box "128..143" when the row writes many tokens
"""
from __future__ import annotations

from collections.abc import Sequence

from . import html as h
from .snapshot import BlockCell, CacheSnapshot, RowSnapshot

GRID_COLUMNS = 32
MAX_GRID_CELLS = 256
MAX_SLOT_CELLS = 24


def block_style(c: BlockCell) -> tuple[str, str]:
    """(background, border) of a block cell."""
    if c.state == "shared":
        return h.shared_bg(c.owners[0] if c.owners else 0), "1px solid #1f2328"
    if c.state == "used":
        return h.owner_color(c.owners[0]) if c.owners else h.CACHED_BG, "1px solid #8c959f"
    if c.state == "cached":
        return h.CACHED_BG, "1px solid #8c959f"
    return h.FREE_BG, f"1px dashed {h.FREE_BORDER}"


def block_title(c: BlockCell, block_size: int) -> str:
    who = f"requests {', '.join(map(str, c.owners))}" if c.owners else "no request"
    return (f"block {c.block_id} (slots {c.block_id * block_size}..{(c.block_id + 1) * block_size - 1}): "
            f"{c.state}, ref count {c.ref_count}, {who}, {c.tokens_held}/{block_size} tokens")


def shown_cells(cache: CacheSnapshot, max_cells: int = MAX_GRID_CELLS) -> int:
    """How many leading blocks the grid draws: all of a small cache (up to half of ``max_cells``),
    else through the last non-free block in whole rows, capped at ``max_cells``."""
    if cache.num_blocks <= max_cells // 2:
        return cache.num_blocks
    last = max((c.block_id for c in cache.cells if c.state != "free"), default=-1)
    n = -(-(last + 1) // GRID_COLUMNS) * GRID_COLUMNS
    return min(cache.num_blocks, max(n, min(GRID_COLUMNS, cache.num_blocks)), max_cells)


def block_grid_html(cache: CacheSnapshot, *, max_cells: int = MAX_GRID_CELLS) -> str:
    """The cache's blocks in id order, with a legend; long caches show their leading blocks."""
    n = shown_cells(cache, max_cells)
    rows = []
    for start in range(0, n, GRID_COLUMNS):
        cells = []
        for c in cache.cells[start:min(n, start + GRID_COLUMNS)]:
            bg, border = block_style(c)
            cells.append(h.cell(c.block_id, bg=bg, border=border, title=block_title(c, cache.block_size)))
        rows.append(f'<div style="white-space:nowrap">{"".join(cells)}</div>')
    rest = cache.cells[n:]
    note = ""
    if rest:
        counts = _count_states(rest)
        note = h.muted(f"blocks {n}..{cache.num_blocks - 1} not drawn: "
                       + ", ".join(f"{k} {v}" for k, v in counts.items()))
    owners = sorted({o for c in cache.cells[:n] for o in c.owners})
    states = {c.state for c in cache.cells[:n]}
    return ("".join(rows) + note
            + h.owner_legend(owners, shared="shared" in states, cached="cached" in states, free="free" in states))


def block_grid_text(cache: CacheSnapshot, *, max_cells: int = MAX_GRID_CELLS) -> str:
    """One character per block: '.' free, 'c' cached, 'S' shared, else the owner id's last digit."""
    n = shown_cells(cache, max_cells)
    chars = []
    for c in cache.cells[:n]:
        chars.append({"free": ".", "cached": "c", "shared": "S"}.get(c.state, str(c.owners[0] % 10)
                                                                       if c.owners else "?"))
    lines = ["".join(chars[i:i + GRID_COLUMNS]) for i in range(0, n, GRID_COLUMNS)]
    if n < cache.num_blocks:
        lines.append(f"(blocks {n}..{cache.num_blocks - 1} not drawn)")
    return "\n".join("    " + line for line in lines)


def _count_states(cells: Sequence[BlockCell]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in cells:
        out[c.state] = out.get(c.state, 0) + 1
    return out


# ---- step rows -------------------------------------------------------------------------------------

def row_style(row: RowSnapshot) -> tuple[str, str]:
    if row.padding:
        return h.PADDING_BG, "1px solid #cf222e"
    return h.owner_color(row.request_id), "1px solid #8c959f"


def table_strip_html(row: RowSnapshot, block_size: int | None, *, shared: frozenset[int] = frozenset()) -> str:
    """The row's block table; blocks it writes in this step are bold, blocks of other rows striped."""
    if not row.block_table:
        return h.muted("-")
    written = {s // block_size for s in row.slots if s >= 0} if block_size else set()
    bg, border = row_style(row)
    cells = []
    for i, b in enumerate(row.block_table):
        cbg = h.shared_bg(row.request_id) if b in shared and not row.padding else bg
        title = f"block_table[{i}] = block {b}" + (" (written in this step)" if b in written else "")
        if b in shared:
            title += "; also in another row's table"
        cells.append(h.cell(b, bg=cbg, border="2px solid #1f2328" if b in written else border, title=title,
                            bold=b in written))
    return "".join(cells)


def slot_strip_html(row: RowSnapshot, block_size: int | None, duplicates: dict[int, tuple[int, ...]]) -> str:
    """The slots the row writes, one cell each, or one box per block run when there are many."""
    bg, border = row_style(row)
    if len(row.slots) <= MAX_SLOT_CELLS:
        return "".join(_slot_cell(s, p, row, block_size, duplicates, bg, border)
                       for s, p in zip(row.slots, row.positions))
    cells = []
    for start, end, p0, p1 in _runs(row.slots, row.positions, block_size):
        dup = any(s in duplicates for s in range(start, end + 1))
        blk = f", block {start // block_size}" if block_size else ""
        cells.append(h.cell(f"{start}..{end}", bg=bg, border=h.COLLISION_BORDER if dup else border, width=60,
                            title=f"positions {p0}..{p1} -> slots {start}..{end}{blk}"))
    return "".join(cells)


def _slot_cell(slot, pos, row, block_size, duplicates, bg, border) -> str:
    if slot < 0:
        return h.cell("-1", bg=h.FREE_BG, border=f"1px dashed {h.FREE_BORDER}", title=f"position {pos}: not written")
    where = f" (block {slot // block_size}, offset {slot % block_size})" if block_size else ""
    title = f"row {row.row}, request {row.request_id}, position {pos} -> slot {slot}{where}"
    if slot in duplicates:
        title += f"; ALSO written by rows {', '.join(map(str, duplicates[slot]))} in this step"
        return h.cell(slot, bg=bg, border=h.COLLISION_BORDER, title=title, bold=True, color="#82071e")
    return h.cell(slot, bg=bg, border=border, title=title)


def _runs(slots, positions, block_size):
    """(first slot, last slot, first position, last position) of consecutive slots in one block."""
    out = []
    for s, p in zip(slots, positions):
        same_block = block_size is None or (out and out[-1][1] // block_size == s // block_size)
        if out and s == out[-1][1] + 1 and same_block and s >= 0:
            out[-1][1], out[-1][3] = s, p
        else:
            out.append([s, s, p, p])
    return [tuple(r) for r in out]
