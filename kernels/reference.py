"""Pure-torch reference kernels: the truth every faster kernel is tested against.

They run on any torch device (cpu, cuda, npu) and make no host syncs: every size comes from the
host copies in ``AttentionMetadata``. One layer's cache::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block * block_size + offset            (slot -1: "do not write")

    block_tables[row] = [7, 2, -1]  block_size 4  ->  the row's context, position by position:
        pos:   0  1  2  3 | 4  5  6  7
        slot: 28 29 30 31 | 8  9 10 11
"""
from __future__ import annotations

import torch

from .metadata import AttentionMetadata

NAME = "reference"


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` [tokens, kv_heads, head_dim] into the caches by slot, in place.

    A negative slot is never written. Two tokens with one slot in a single call is undefined
    (the slot checks refuse such a step before dispatch).
    """
    if slot_mapping.shape[0] == 0:
        return
    slots, key, value = redirect_skipped_slots(key, value, key_cache, value_cache, slot_mapping)
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value)


def redirect_skipped_slots(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Make a "skip slot -1" write expressible as a plain scatter, without a host sync.

    Returns (slots [tokens] int64, key, value) in the caches' dtype, where every token whose slot
    is negative re-writes a donor instead: the first kept token (same slot, same value) or, when
    no token is kept, slot 0 with the contents it already holds. Scattering the result leaves the
    caches exactly as if the skipped tokens had been dropped (dropping them would need their
    count on the host)::

        slots [5, -1, 9, -1]  ->  [5, 5, 9, 5]    values [a, x, b, y] -> [a, a, b, a]
        slots [-1, -1]        ->  [0, 0]          values -> [cache[0], cache[0]]
    """
    flat_k = key_cache.view(-1, *key_cache.shape[2:])      # [num_slots, kv_heads, head_dim]
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    slots = slot_mapping.long()                            # [tokens]
    keep = slots >= 0
    first = keep.to(torch.int32).argmax().view(1)         # [1] first kept token (0 when none)
    any_keep = keep.any().view(1)                          # [1]
    donor_slot = torch.where(any_keep, slots.index_select(0, first), torch.zeros_like(first))
    idx = torch.where(keep, slots, donor_slot)             # [tokens], all >= 0
    row_keep = keep[:, None, None]
    out = []
    for src, flat in ((key, flat_k), (value, flat_v)):
        donor = torch.where(any_keep[:, None, None], src.index_select(0, first).to(flat.dtype),
                            flat.index_select(0, donor_slot))       # [1, kv_heads, head_dim]
        out.append(torch.where(row_keep, src.to(flat.dtype), donor))
    return idx, out[0], out[1]


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of each token over its row's cached context, read through the block table.

    query: [tokens, num_heads, head_dim] -> out: [tokens, num_heads, head_dim].
    A row's tokens are the last ``query_len`` positions of its ``seq_len`` context; token i of
    the row attends to context positions ``<= seq_len - query_len + i`` (causal). The K/V of
    the step's own tokens must already be written to the cache. Grouped-query attention: head h
    reads KV head ``h // (num_heads // num_kv_heads)``.
    """
    if meta.is_decode:
        return _decode(query, key_cache, value_cache, meta, scale)
    out = torch.empty_like(query)
    block_size = key_cache.shape[1]
    start = 0
    for row, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        if q_len == 0:
            continue
        n_blocks = -(-ctx // block_size)
        blocks = meta.block_tables[row, :n_blocks].long()
        k = key_cache[blocks].flatten(0, 1)[:ctx]           # [ctx, kv_heads, head_dim]
        v = value_cache[blocks].flatten(0, 1)[:ctx]
        q = query[start:start + q_len]                        # [q_len, heads, head_dim]
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        mask = torch.arange(ctx, device=query.device)[None, :] <= q_pos[:, None]   # [q_len, ctx]
        out[start:start + q_len] = _attend(q[None], k[None], v[None], mask[None], scale)[0]
        start += q_len
    return out


def _decode(query, key_cache, value_cache, meta, scale):
    n_blocks = -(-max(meta.seq_lens_host, default=0) // key_cache.shape[1])
    tables = meta.block_tables[:, :n_blocks]
    return attend_context(query, key_cache, value_cache, tables, meta.seq_lens, scale)


def attend_context(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row over its whole context: query [rows, heads, head_dim], tables [rows,
    blocks] (-1 padded), seq_lens [rows] -> [rows, heads, head_dim]. Every row spans all of
    ``tables``' blocks, the positions from its ``seq_len`` on masked."""
    blocks = tables.clamp(min=0).long()                    # [rows, blocks]
    k = key_cache[blocks].flatten(1, 2)                    # [rows, blocks*block_size, kv_heads, hd]
    v = value_cache[blocks].flatten(1, 2)
    ctx = torch.arange(k.shape[1], device=query.device)
    mask = ctx[None, None, :] < seq_lens[:, None, None]                   # [rows, 1, ctx]
    # Positions past a row's context (its last block's tail, and the -1 padding clamped to
    # block 0) may hold anything, NaN included: a masked score is -inf, but 0 * NaN is NaN, so
    # zero those V entries too. A row then never depends on slots outside its context.
    v = torch.where(mask[:, 0, :, None, None], v, torch.zeros((), dtype=v.dtype, device=v.device))
    return _attend(query[:, None], k, v, mask, scale)[:, 0]


def _attend(q, k, v, mask, scale):
    """q [B, L, H, D], k/v [B, S, KV, D], mask [B, L, S] (True = attend) -> [B, L, H, D]."""
    b, l, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    qg = q.reshape(b, l, kv, g, d)
    scores = torch.einsum("blkgd,bskd->bkgls", qg, k).float() * scale      # [B, KV, G, L, S]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.einsum("bkgls,bskd->blkgd", probs, v)                       # [B, L, KV, G, D]
    return out.reshape(b, l, h, d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 (as Hugging Face Qwen3 does)."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, rotate-halves style. q [T, H, D], k [T, KV, D], cos/sin [T, D]."""
    cos = cos[:, None].to(q.dtype)
    sin = sin[:, None].to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def health_codes(logits: torch.Tensor) -> torch.Tensor:
    """Per row: 0 healthy, 1 non-finite, 2 all zero, 3 all equal (int64, on the device)."""
    hi, lo = logits.amax(dim=-1), logits.amin(dim=-1)                   # [rows]
    if logits.is_cpu:
        # torch's CPU max/min propagate NaN, so a row holds a NaN or an inf exactly when its max or
        # min is not finite: two passes over the logits instead of four
        nonfinite = ~(torch.isfinite(hi) & torch.isfinite(lo))
    else:
        nonfinite = ~torch.isfinite(logits).all(dim=-1)
    equal = hi == lo
    zero = equal & (hi == 0)
    code = torch.where(zero, 2, torch.where(equal, 3, 0))
    return torch.where(nonfinite, 1, code).to(torch.int64)


def greedy_health(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``logits.argmax(-1)``, ``health_codes(logits)``) of logits [rows, vocab]: greedy sampling's
    token and the stream-health code of every row, on the logits' device."""
    return logits.argmax(dim=-1), health_codes(logits)


def greedy_word(ids: torch.Tensor, codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The word per row that a sampled step copies to the host: the token id with the row's health
    code in its upper 32 bits, ``id | code << 32`` (int64; into ``out`` when given)."""
    return torch.bitwise_or(ids, codes.to(torch.int64) << 32, out=out)


def pack_greedy(ids: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> None:
    """The forward's greedy output: ``out`` [2, rows] int64 gets the token ids in ``out[0]`` and
    their ``greedy_word`` in ``out[1]`` (each a contiguous row, copied to the host as it lies)."""
    out[0].copy_(ids)
    greedy_word(ids, codes, out[1])
