"""A prompt's K/V computed again from its tokens, densely: one prefill row over a scratch cache.

What ``sess.audit`` compares the paged cache with (``inspect/audit.py``); with tensor parallelism
every rank runs it on its shard in lockstep (``parallel/worker.py``).
"""
from __future__ import annotations

import torch

from ..cache.kv_cache import KVCache
from ..kernels.metadata import AttentionMetadata


def recompute_kv(model, token_ids: list[int], block_size: int) -> KVCache:
    """The K/V of ``token_ids`` from one prefill row over a scratch cache whose blocks are
    ``0, 1, 2, ...`` in order, so position p lives in slot p."""
    c, device = model.config, model.device
    n = len(token_ids)
    nb = -(-n // block_size)
    scratch = KVCache(c.num_hidden_layers, nb, block_size, c.num_key_value_heads, c.head_dim, model.dtype, device)
    pos = torch.arange(n, dtype=torch.int64).to(device)                          # [n]
    meta = AttentionMetadata(
        positions=pos, slot_mapping=pos,
        block_tables=torch.arange(nb, dtype=torch.int32).to(device)[None],       # [1, nb]
        seq_lens=torch.tensor([n], dtype=torch.int32).to(device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32).to(device),
        query_lens_host=(n,), seq_lens_host=(n,), is_decode=False)
    with torch.no_grad():
        model(torch.tensor(token_ids, dtype=torch.int64).to(device), meta, scratch.layers(),
              torch.tensor([n - 1], dtype=torch.int64).to(device))
    return scratch
