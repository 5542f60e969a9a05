"""Block tables and slot mappings: the ONE place that turns token positions into KV cache slots.

A request's K/V lives in fixed-size blocks scattered over the cache; its *block table* lists
those blocks in position order. Position ``pos`` of a request lives at::

    index  = pos // block_size          which entry of the block table
    offset = pos %  block_size          where inside that block
    slot   = block_table[index] * block_size + offset

Worked example, ``block_size = 4``, ``block_table = [7, 2, 9]``::

    position   0  1  2  3 |  4  5  6  7 |  8  9 10 11
    index      0          |  1          |  2
    block      7          |  2          |  9
    slot      28 29 30 31 |  8  9 10 11 | 36 37 38 39

    slot_mapping([7, 2, 9], start=3, end=7, block_size=4) == [31, 8, 9, 10]
    slot_mapping([7, 2, 9], start=9, end=10, block_size=4) == [37]      # one decode token

In the dispatched tensors a block table is padded with ``-1`` ("no block") and a slot of ``-1``
means "do not write"; see ``pad_block_tables``.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["blocks_needed", "pad_block_tables", "slot_mapping"]

NO_BLOCK = -1


def slot_mapping(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of positions ``start .. end-1`` of the request whose blocks are ``block_table``.

    Raises ValueError when a position has no block (the table is too short, or holds -1 there),
    when ``start > end`` or ``start < 0``, or when ``block_size < 1``.
    """
    if end - start == 1 and start >= 0 and block_size > 0:  # decode: one token per row
        index, offset = divmod(start, block_size)
        if index < len(block_table):
            block = block_table[index]
            if block >= 0:
                return [block * block_size + offset]
        _raise_no_block(block_table, start, block_size)
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if start < 0 or end < start:
        raise ValueError(f"positions {start}..{end - 1} are not a valid range (need 0 <= start <= end)")
    if end > start and (end - 1) // block_size >= len(block_table):
        _raise_no_block(block_table, max(start, len(block_table) * block_size), block_size)
    slots: list[int] = []
    pos = start
    while pos < end:
        index = pos // block_size
        block = block_table[index]
        if block < 0:
            _raise_no_block(block_table, pos, block_size)
        stop = min(end, (index + 1) * block_size)
        shift = (block - index) * block_size  # slot = pos + shift inside this block
        slots.extend(range(pos + shift, stop + shift))
        pos = stop
    return slots


def _raise_no_block(block_table: Sequence[int], pos: int, block_size: int) -> None:
    index = pos // block_size
    if index < len(block_table):
        raise ValueError(f"position {pos} maps to block-table index {index}, which holds "
                         f"{block_table[index]} (no block); allocate blocks before computing slots")
    covered = len(block_table) * block_size
    raise ValueError(f"position {pos} has no block: the block table {list(block_table)} covers "
                     f"positions 0..{covered - 1} (block_size {block_size}); allocate more blocks first")


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    if num_tokens < 0 or block_size < 1:
        raise ValueError(f"need num_tokens >= 0 and block_size >= 1, got {num_tokens} and {block_size}")
    return -(-num_tokens // block_size)


def pad_block_tables(tables: Sequence[Sequence[int]], width: int) -> list[list[int]]:
    """Copies of ``tables``, each padded with -1 to ``width`` entries (rows of the dispatch tensor).

    ``pad_block_tables([[7, 2], [5]], 3) == [[7, 2, -1], [5, -1, -1]]``. Raises ValueError when a
    table is longer than ``width``.
    """
    rows = []
    for row, table in enumerate(tables):
        if len(table) > width:
            raise ValueError(f"row {row}: block table has {len(table)} blocks, more than the width {width}")
        rows.append([*table, *([NO_BLOCK] * (width - len(table)))])
    return rows
