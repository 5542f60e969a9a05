"""What the npu kernel set derives from one step's AttentionMetadata, once per step.

Every layer of a forward gets the same metadata object, so what the fused attention ops take
besides it is built at the first layer and reused by the others: ``step_inputs(meta, block_size)``
keeps the last result, keyed on the object's identity through a weak reference (a new step's
metadata is a new object, so a result never outlives its step).

    meta.block_tables  [[7, 2, -1, -1],        step_inputs(...).block_table   [[7, 2],
    (engine buffers)    [5, -1, -1, -1]]       (block size 4, seq lens 7, 3)   [5, 0]]

The fused ops do not validate block ids (the caller must guarantee them), so the table they get
holds only real blocks: the engine's ``-1`` padding becomes block 0, a valid block whose
positions lie past that row's length and are never read (the lengths mask them). Columns past
the longest row's last block are dropped. The engine's own buffers keep their ``-1``.
"""
from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch

from .metadata import AttentionMetadata

PAD_BLOCK = 0     # the block id that pads a row's table for the fused ops (masked by the lengths)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    block_table: torch.Tensor      # [rows, blocks of the longest row] int32, padded with PAD_BLOCK
    context_lens: torch.Tensor     # [rows] int32 on the host (the ATB decode op reads it there)
    query_ends: list[int]          # cumulative query lengths (TND actual_seq_lengths)
    seq_lens: list[int]            # per-row context lengths (paged actual_seq_lengths_kv)
    all_fresh: bool                # every row computes its whole context: nothing cached before


_last: tuple[weakref.ref, int, StepInputs] | None = None


def step_inputs(meta: AttentionMetadata, block_size: int) -> StepInputs:
    """The fused ops' inputs for ``meta`` (built on the first call for this object, then reused).

    No host sync: sizes come from the host copies. Raises ValueError when ``meta.block_tables``
    has fewer columns than its longest row needs."""
    global _last
    if _last is not None and _last[0]() is meta and _last[1] == block_size:
        return _last[2]
    inputs = _build(meta, block_size)
    _last = (weakref.ref(meta), block_size, inputs)
    return inputs


def _build(meta: AttentionMetadata, block_size: int) -> StepInputs:
    rows = meta.num_rows
    width = max(1, -(-meta.max_seq_len // block_size))
    tables = meta.block_tables
    if tables.shape[1] < width:
        raise ValueError(f"npu kernels: block_tables has {tables.shape[1]} columns, but a row of "
                         f"{meta.max_seq_len} tokens needs {width} blocks of {block_size}")
    table = tables[:rows, :width].to(torch.int32).clamp(min=PAD_BLOCK)          # [rows, width]
    fresh = rows > 0 and all(0 < q == s for q, s in zip(meta.query_lens_host, meta.seq_lens_host))
    return StepInputs(block_table=table,
                      context_lens=torch.tensor(meta.seq_lens_host, dtype=torch.int32),
                      query_ends=list(itertools.accumulate(meta.query_lens_host)),
                      seq_lens=list(meta.seq_lens_host), all_fresh=fresh)
