"""What the npu kernel set derives from one step's AttentionMetadata, once per step.

Every layer of a forward gets the same metadata object, so what the fused attention ops take
besides it is built at the first layer and reused by the others: ``step_inputs(meta, block_size,
device)`` keeps the last result through ``kernels/memo.py``'s ``LastResult``, reused only for the
very same object whose tensors (block_tables, seq_lens, query_start_loc, positions) have not been
changed in place since, with the same block size and device; anything else builds anew.

    meta.block_tables  [[7, 2, -1, -1],        step_inputs(...).block_table   [[7, 2],
    (engine buffers)    [5, -1, -1, -1]]       (block size 4, seq lens 7, 3)   [5, 0]]

The fused ops do not validate block ids (the caller must guarantee them), so the table they get
holds only real blocks: the engine's ``-1`` padding becomes block 0, a valid block whose
positions lie past that row's length and are never read (the lengths mask them). Columns past
the longest row's last block are dropped. The engine's own buffers keep their ``-1``.

For a batch of only fresh prompts (FIA unpaged reads the step's K/V in token order),
``fresh_slots`` is the cache slot of each token's position read through that table, as the
reference reads a context (``table[row, p // block_size] * block_size + p % block_size``), so a
token whose K/V was not written (slot -1) reads its position's slot like the reference, never
another token's.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from .memo import LastResult
from .metadata import AttentionMetadata

PAD_BLOCK = 0     # the block id that pads a row's table for the fused ops (masked by the lengths)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    block_table: torch.Tensor      # [rows, blocks of the longest row] int32, padded with PAD_BLOCK
    context_lens: torch.Tensor     # [rows] int32 on the host (the ATB decode op reads it there)
    query_ends: list[int]          # cumulative query lengths (TND actual_seq_lengths)
    seq_lens: list[int]            # per-row context lengths (paged actual_seq_lengths_kv)
    all_fresh: bool                # every row computes its whole context: nothing cached before
    fresh_slots: torch.Tensor | None   # [tokens] int64, each token's slot by the table (all_fresh only)


_last = LastResult()


def step_inputs(meta: AttentionMetadata, block_size: int, device: torch.device) -> StepInputs:
    """The fused ops' inputs for ``meta`` on ``device`` (built on the first call for this object,
    then reused while nothing changed).

    No host sync: sizes come from the host copies. Raises ValueError when ``meta.block_tables``
    has fewer columns than its longest row needs."""
    tensors = (meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.positions)
    return _last.get(meta, tensors, (block_size, torch.device(device)),
                     lambda: _build(meta, block_size, torch.device(device)))


def _build(meta: AttentionMetadata, block_size: int, device: torch.device) -> StepInputs:
    rows = meta.num_rows
    width = max(1, -(-meta.max_seq_len // block_size))
    tables = meta.block_tables
    if tables.shape[1] < width:
        raise ValueError(f"npu kernels: block_tables has {tables.shape[1]} columns, but a row of "
                         f"{meta.max_seq_len} tokens needs {width} blocks of {block_size}")
    table = tables[:rows, :width].to(device=device, dtype=torch.int32).clamp(min=PAD_BLOCK)   # [rows, width]
    fresh = rows > 0 and all(0 < q == s for q, s in zip(meta.query_lens_host, meta.seq_lens_host))
    return StepInputs(block_table=table,
                      context_lens=torch.tensor(meta.seq_lens_host, dtype=torch.int32),
                      query_ends=list(itertools.accumulate(meta.query_lens_host)),
                      seq_lens=list(meta.seq_lens_host), all_fresh=fresh,
                      fresh_slots=_slots_by_table(meta, table, block_size) if fresh else None)


def _slots_by_table(meta: AttentionMetadata, table: torch.Tensor, block_size: int) -> torch.Tensor:
    """[tokens] int64: the slot of each token's position through its row's (padded) table."""
    device = table.device
    ends = meta.query_start_loc[1:].to(device)                                   # [rows]
    tokens = torch.arange(meta.num_tokens, device=device)
    row = torch.searchsorted(ends, tokens.to(ends.dtype), right=True)            # [tokens]
    pos = meta.positions.to(device).long()                                       # [tokens]
    return table.long()[row, pos // block_size] * block_size + pos % block_size
