"""A vectorised screen of one step's slot mapping: which tokens the slot checks would flag.

`screen_slot_mapping` answers, with a handful of tensor operations and no Python loop over tokens,
"which tokens would `check_step_writes` name in a problem?" It runs where the tensors live (on an
accelerator it never reads a value back to the host), so a serving engine can afford it every step.
It describes nothing: when the mask has any True, build a `StepWrites` for the step and let
`check_step_writes` say what is wrong (one set of rules, one set of messages).

Same rules as `check_step_writes`, token by token (slot -1, and any negative slot, means "no write"):

- padding: a token at or past `num_real_tokens` that writes;
- beyond the cache: slot >= num_blocks * block_size;
- outside the row's blocks / wrong slot: with j = position // block_size, the token must have
  0 <= j < blocks_per_row[row] and slot == block_tables[row, j] * block_size + position % block_size;
- duplicate: two writing tokens share a slot;
- shared block: the written block is held by more than one row (`holders`, see `count_holders`),
  and no token of this step writes it at its expected slot. A block that a token does write at its
  expected slot is being filled by this step; a serving engine may already have handed it to other
  rows of the same step as a prefix hit (vLLM registers a block's prefix hash when it allocates
  it), which is safe because every layer writes the step's K/V before its attention reads them.
  The screen sets such blocks' `holders` count to 1 in place, so a description made with the same
  `holders` (as `ref_count`) applies the same rule.
"""
from __future__ import annotations

import torch


def count_holders(block_tables: torch.Tensor, blocks_per_row: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[num_blocks] int32: how many rows hold each block in their first `blocks_per_row[row]` entries."""
    tables = block_tables.long()
    width = tables.shape[1]
    held = torch.arange(width, device=tables.device)[None, :] < blocks_per_row.long()[:, None]
    held &= (tables >= 0) & (tables < num_blocks)
    counts = torch.zeros(num_blocks, dtype=torch.int32, device=tables.device)
    return counts.scatter_add_(0, tables.clamp(0, num_blocks - 1).flatten(), held.flatten().int())


def screen_slot_mapping(slot_mapping: torch.Tensor, positions: torch.Tensor, token_rows: torch.Tensor,
                        block_tables: torch.Tensor, blocks_per_row: torch.Tensor, *, block_size: int,
                        num_blocks: int, num_real_tokens: int,
                        holders: torch.Tensor | None = None) -> torch.Tensor:
    """[tokens] bool: True for every token `check_step_writes` would name; all on `slot_mapping`'s device.

    `slot_mapping`: [tokens] (the padded tail included); `positions`, `token_rows`: at least
    `num_real_tokens` entries (the row of each real token); `block_tables`: [rows, max_blocks];
    `blocks_per_row`: [rows], how many leading table entries the row holds; `holders`: the
    `count_holders` of the live rows (updated in place, see above), or None to skip the shared-block
    check.
    """
    if block_size < 1 or num_blocks < 1:
        raise ValueError(f"block_size and num_blocks must be >= 1, got {block_size} and {num_blocks}")
    n_all, n = slot_mapping.shape[0], int(num_real_tokens)
    if not 0 <= n <= n_all or positions.shape[0] < n or token_rows.shape[0] < n:
        raise ValueError(f"num_real_tokens={n}, but slot_mapping has {n_all} entries, positions "
                         f"{positions.shape[0]} and token_rows {token_rows.shape[0]}")
    slots = slot_mapping.long()
    writes = slots >= 0
    flagged = writes.clone()
    flagged[:n] = False                                   # padding tail: any write is flagged
    s, w = slots[:n], writes[:n]
    if n:
        rows, pos = token_rows[:n].long(), positions[:n].long()
        width = block_tables.shape[1]
        j = torch.div(pos, block_size, rounding_mode="floor")
        inside = (j >= 0) & (j < blocks_per_row.long()[rows])
        entry = block_tables.reshape(-1)[rows * width + j.clamp(0, width - 1)].long()   # 1-D gather
        bad = (entry * block_size + pos.remainder(block_size) != s) | ~inside
        beyond = s >= num_blocks * block_size
        bad |= beyond
        if holders is not None:
            block = torch.div(s, block_size, rounding_mode="floor").clamp(0, num_blocks - 1)
            held = holders[block]
            fills = torch.where(w & ~bad, torch.ones_like(held), held)    # no mask indexing: no sync
            holders.scatter_reduce_(0, block, fills, reduce="amin")     # blocks this step fills: 1
            bad |= ~beyond & (holders[block] > 1)
        flagged[:n] = bad & w
    flagged |= _duplicates(slots, writes)
    return flagged


def _duplicates(slots: torch.Tensor, writes: torch.Tensor) -> torch.Tensor:
    """[tokens] bool: writing tokens whose slot another writing token also has (sort, compare neighbours)."""
    n = slots.shape[0]
    if n < 2:
        return torch.zeros_like(writes)
    unique_skip = -2 - torch.arange(n, device=slots.device)        # non-writes never match anything
    order = torch.argsort(torch.where(writes, slots, unique_skip))
    ranked = torch.where(writes, slots, unique_skip)[order]
    same = ranked[1:] == ranked[:-1]
    hit = torch.zeros(n, dtype=torch.bool, device=slots.device)
    hit[order[1:]] |= same
    hit[order[:-1]] |= same
    return hit
