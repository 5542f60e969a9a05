"""Per-layer K and V tensors of the paged cache, and sizing from a memory budget.

    key(layer), value(layer): [num_blocks, block_size, num_kv_heads, head_dim]
    slot s lives at [s // block_size, s % block_size]
"""
from __future__ import annotations

import torch


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """K and V of one block across every layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


class KVCache:
    """The cache tensors; bookkeeping (who owns which block) lives in ``KVCacheManager``."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.keys, self.values))

    def rows(self, layers, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [layers, slots, num_kv_heads, head_dim] of ``slots`` in ``layers``, on the cache's device."""
        index = torch.tensor(list(slots), dtype=torch.int64).to(self.keys[0].device)
        k = torch.stack([self.keys[i].flatten(0, 1).index_select(0, index) for i in layers])
        v = torch.stack([self.values[i].flatten(0, 1).index_select(0, index) for i in layers])
        return k, v

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (copy-on-write)."""
        for t in self.keys + self.values:
            t[dst].copy_(t[src])

    def zero_(self) -> None:
        for t in self.keys + self.values:
            t.zero_()
