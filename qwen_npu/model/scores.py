"""Attention scores before softmax, read from the paged cache: the "attn.scores" hook point.

The kernels fuse softmax away, so the scores exist only when a hook asks for them. For each row
of the step (tokens ``query_start_loc[r]:query_start_loc[r+1]``, context ``seq_lens[r]``)::

    scores[t, h, j] = q[t, h] . k[j, h // group] * scale     j <= position of token t
                    = -inf                                   j past it, or past the row's context

keys ``j`` run over 0..the step's longest context - 1, read through the row's block table
(position p -> block table[p // block_size], offset p % block_size). float32, [tokens, heads, keys].
Costs one gather of the row's keys and one batched matmul; never runs without a hook.
``per_token=True`` (a batch-invariant Session's): one product per token over exactly its own
positions ``0..p``, so a token's scores do not depend on its chunk or its batch.
"""
from __future__ import annotations

import torch

from ..kernels.metadata import AttentionMetadata


def attention_scores(q: torch.Tensor, key_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, per_token: bool = False) -> torch.Tensor:
    """q [tokens, heads, hd] (after RoPE), key_cache [blocks, block_size, kv_heads, hd] with this
    step's keys written -> scores [tokens, heads, max context] float32 (see module docstring)."""
    tokens, heads, _ = q.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    width = meta.max_seq_len
    out = torch.full((tokens, heads, width), float("-inf"), dtype=torch.float32, device=q.device)
    start = 0
    for row, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        if q_len == 0:
            continue
        blocks = meta.block_tables[row, :-(-ctx // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:ctx].float()                    # [ctx, kv_heads, hd]
        k = k.repeat_interleave(group, dim=1)                                 # [ctx, heads, hd]
        qs = q[start:start + q_len].float()                                   # [q_len, heads, hd]
        if per_token:
            for i in range(q_len):
                seen = ctx - q_len + i + 1                                    # positions 0..p
                out[start + i, :, :seen] = torch.einsum("qhd,khd->qhk", qs[i:i + 1], k[:seen])[0] * scale
            start += q_len
            continue
        s = torch.einsum("qhd,khd->qhk", qs, k) * scale                       # [q_len, heads, ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        future = torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None]  # [q_len, ctx]
        out[start:start + q_len, :, :ctx] = s.masked_fill(future[:, None, :], float("-inf"))
        start += q_len
    return out
