"""The attention metadata a step hands to the model and its kernels.

It is an explicit argument, never a module global. Device tensors drive the kernels; the host
copies (plain tuples) let a kernel size its work without a device-to-host sync.

Example: a prefill step with two rows, request A computing prompt tokens 0..3 and request B
computing tokens 16..17 of its prompt (16 tokens of B were computed by earlier steps)::

    positions       = [0, 1, 2, 3, 16, 17]
    query_start_loc = [0, 4, 6]          # row r owns tokens query_start_loc[r]:query_start_loc[r+1]
    seq_lens        = [4, 18]            # context length after the step (last position + 1)
    block_tables    = [[7, -1], [2, 5]]  # -1 padded
    slot_mapping    = [112, 113, 114, 115, 80, 81]   # with block_size 16
"""
from __future__ import annotations

import dataclasses
import itertools

import torch


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor        # [tokens] int64, the position each token computes
    slot_mapping: torch.Tensor     # [tokens] int64, the cache slot each token's K/V is written to; -1 = skip
    block_tables: torch.Tensor     # [rows, max_blocks] int32, -1 padded
    seq_lens: torch.Tensor         # [rows] int32, context length after this step
    query_start_loc: torch.Tensor  # [rows + 1] int32, cumulative query lengths
    query_lens_host: tuple[int, ...]   # tokens per row (host copy)
    seq_lens_host: tuple[int, ...]     # context length per row (host copy)
    is_decode: bool                # every row computes exactly one token

    @classmethod
    def for_rows(cls, rows, slot_mapping, block_tables: torch.Tensor, device="cpu") -> "AttentionMetadata":
        """The metadata of a step with ``rows`` [(tokens computed before, tokens computed now)], its
        tokens' ``slot_mapping`` and the -1 padded ``block_tables``, tensors on ``device``; for
        calling the kernels by hand (the example above is ``for_rows([(0, 4), (16, 2)], ...)``)."""
        qlens, seqs = tuple(q for _, q in rows), tuple(d + q for d, q in rows)
        return cls(positions=torch.tensor([p for d, q in rows for p in range(d, d + q)], device=device),
                   slot_mapping=torch.tensor(slot_mapping, device=device), block_tables=block_tables.to(device),
                   seq_lens=torch.tensor(seqs, dtype=torch.int32, device=device),
                   query_start_loc=torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=device),
                   query_lens_host=qlens, seq_lens_host=seqs, is_decode=all(q == 1 for q in qlens))

    @property
    def num_rows(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)
