"""The cuda kernel set: pure torch, batched over rows, written for a CUDA GPU; runs on any device.

The reference set says what the answer is; this set computes the same answer the way a GPU
wants it: a fixed number of kernels per layer whatever the number of rows, no Python loop over
rows, no score tensor of a whole prefill chunk, nothing that waits for the device.

    write_kv         one gather and one ``index_copy_`` per cache; slot -1 re-writes a donor
    paged_attention  rows computing one token (decode rows, also inside prefill and mixed steps):
                     split-KV tiles, two ``bmm`` per layer over every row at once
                     rows computing a chunk: ``scaled_dot_product_attention`` over their gathered
                     K/V with an additive varlen causal mask, one call per size bucket
    rms_norm, add_rms_norm, rope    the reference's own functions

Per-step index tensors (which slot each tile position reads, each row's mask) depend only on
the metadata, which every layer shares: they are built once per step (``memo.py``) on the
device, sized from the ``*_host`` tuples, so nothing crosses to the host and nothing is
copied from it.

Gathering: a row's positions are read through its block table with one ``index_select`` per
cache for the whole step. A position that pads a tile or a bucket reads the row's own position
0 (always in its context and visible to every token of the row), so no gathered value ever
comes from outside the row's context. On the one-token path masked scores are replaced by -inf.
On the chunk path ``scaled_dot_product_attention`` adds its -inf mask, so a non-finite K or V at a
position of the row's own context reaches the chunk's queries before that position too (the
reference keeps them finite); the stream health check reports the row either way.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import reference
from .memo import LastResult
from .metadata import AttentionMetadata

NAME = "cuda"
TILE = 256                      # positions per split-KV tile of a one-token row
rms_norm, add_rms_norm, rope = reference.rms_norm, reference.add_rms_norm, reference.rope

_writes, _plans = LastResult(), LastResult()


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` [tokens, kv_heads, head_dim] into the caches by slot, in place.

    Slot -1 without a host sync, in three kernels per cache: the source rows are the step's
    tokens plus one more row, the cache's current slot 0. A kept token writes itself; a skipped
    token re-writes the first kept token's slot with that token's K/V, or slot 0 with the value
    it already holds when no token is kept (``_redirect``, built once per slot mapping). The
    scatter then leaves the caches exactly as if the skipped tokens were absent.
    """
    if slot_mapping.shape[0] == 0:
        return
    target, source = _writes.get(slot_mapping, (slot_mapping,), (), lambda: _redirect(slot_mapping))
    for x, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.view(-1, *cache.shape[2:])                                # [slots, kv_heads, hd]
        rows = torch.cat((x.to(flat.dtype), flat[:1])).index_select(0, source)  # [tokens, kv_heads, hd]
        flat.index_copy_(0, target, rows)


def _redirect(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(target slot, source row) per token; source row ``tokens`` is the cache's slot 0::

        slots [5, -1, 9, -1]  ->  targets [5, 5, 9, 5]   sources [0, 0, 2, 0]
        slots [-1, -1]        ->  targets [0, 0]         sources [2, 2]
    """
    slots = slot_mapping.long()
    n = slots.shape[0]
    keep = slots >= 0
    token = torch.arange(n, device=slots.device)
    first = torch.where(keep, token, n).amin(0, keepdim=True)                # [1], n when none kept
    source = torch.where(keep, token, first)
    target = torch.cat((slots, slots.new_zeros(1))).index_select(0, source)
    return target, source


@dataclasses.dataclass(frozen=True)
class OneTokenRows:
    """Rows computing one token, cut into tiles of ``width`` positions (the last one padded)."""
    tokens: torch.Tensor       # [rows] the token each row computes
    tile_row: torch.Tensor     # [tiles] which of these rows a tile belongs to
    tile_token: torch.Tensor   # [tiles] that row's token
    slots: torch.Tensor        # [tiles * kv_heads * width] the (slot, kv head) row each position reads
    masked: torch.Tensor       # [tiles, 1, 1, width] True where a position pads the tile
    rows: int
    tiles: int
    width: int


@dataclasses.dataclass(frozen=True)
class ChunkRows:
    """Rows computing several tokens, padded to ``q_len`` queries and ``ctx`` positions."""
    query_index: torch.Tensor  # [rows * q_len] the token each padded query reads
    slots: torch.Tensor        # [rows * ctx] the slot each padded position reads
    mask: torch.Tensor         # [rows, 1, q_len, ctx] 0 where visible, -inf elsewhere
    out_index: torch.Tensor    # [tokens] each real token's place in the padded output
    tokens: torch.Tensor       # [tokens] those tokens, in the step's order
    rows: int
    q_len: int
    ctx: int


@dataclasses.dataclass(frozen=True)
class Plan:
    one_token: OneTokenRows | None
    chunks: tuple[ChunkRows, ...]
    every_row_one_token: bool      # the one-token rows are the step's rows, in token order


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of each token over its row's cached context (the contract of kernels/README.md).

    query [tokens, heads, head_dim] -> out [tokens, heads, head_dim]. Softmax in float32: the
    one-token path computes it itself; ``scaled_dot_product_attention`` does in its fused
    kernels (the CPU's flash kernel; on CUDA memory-efficient or cuDNN are expected, since the
    mask rules out flash) and in its math fallback.
    """
    block_size, kv = key_cache.shape[1:3]
    extra = (block_size, kv, query.dtype, query.device)
    tensors = (meta.block_tables, meta.seq_lens, meta.query_start_loc)
    plan = _plans.get(meta, tensors, extra, lambda: _plan(meta, block_size, kv, query.dtype))
    if plan.every_row_one_token and plan.one_token is not None:
        return _one_token(query, key_cache, value_cache, plan.one_token, scale)
    out = torch.empty_like(query)
    if plan.one_token is not None:
        out.index_copy_(0, plan.one_token.tokens, _one_token(query, key_cache, value_cache, plan.one_token, scale))
    for chunk in plan.chunks:
        out.index_copy_(0, chunk.tokens, _chunk(query, key_cache, value_cache, chunk, scale))
    return out


def _one_token(query, key_cache, value_cache, p: OneTokenRows, scale):
    """Split-KV attention: every tile of every row in two batched products, merged per row."""
    kv, d = key_cache.shape[2:]
    heads = query.shape[1]
    g = heads // kv
    k = key_cache.view(-1, d).index_select(0, p.slots).view(p.tiles * kv, p.width, d)
    v = value_cache.view(-1, d).index_select(0, p.slots).view(p.tiles * kv, p.width, d)
    q = query.index_select(0, p.tile_token).view(p.tiles * kv, g, d)
    s = torch.bmm(q, k.transpose(1, 2)).float().mul_(scale)
    s = s.view(p.tiles, kv, g, p.width).masked_fill_(p.masked, float("-inf"))
    probs = torch.softmax(s, dim=-1)                         # per tile, float32
    o = torch.bmm(probs.to(v.dtype).view(p.tiles * kv, g, p.width), v)      # [tiles * kv, g, d]
    if p.tiles == p.rows:                                    # one tile per row: nothing to merge
        return o.view(p.rows, heads, d).to(query.dtype)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)           # [tiles, kv, g, 1]
    row_max = lse.new_full((p.rows, kv, g, 1), float("-inf")).scatter_reduce_(
        0, p.tile_row.view(-1, 1, 1, 1).expand_as(lse), lse, "amax")
    w = torch.exp(lse - row_max.index_select(0, p.tile_row))
    num = lse.new_zeros(p.rows, kv, g, d).index_add_(0, p.tile_row, o.view(p.tiles, kv, g, d).float() * w)
    den = lse.new_zeros(p.rows, kv, g, 1).index_add_(0, p.tile_row, w)
    return (num / den).to(query.dtype).view(p.rows, heads, d)


def _chunk(query, key_cache, value_cache, c: ChunkRows, scale):
    kv, d = key_cache.shape[2:]
    heads = query.shape[1]
    q = query.index_select(0, c.query_index).view(c.rows, c.q_len, heads, d).transpose(1, 2)
    k = key_cache.view(-1, kv, d).index_select(0, c.slots).view(c.rows, c.ctx, kv, d).transpose(1, 2)
    v = value_cache.view(-1, kv, d).index_select(0, c.slots).view(c.rows, c.ctx, kv, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=c.mask, scale=scale, enable_gqa=heads != kv)
    return o.transpose(1, 2).reshape(c.rows * c.q_len, heads, d).index_select(0, c.out_index)


def _bits(x: int) -> int:
    return int(x).bit_length()


def _plan(meta: AttentionMetadata, block_size: int, kv: int, dtype: torch.dtype) -> Plan:
    """The step's index tensors, on the metadata's device, sized from its host tuples.

    Rows are grouped by a key computed the same way on the host and on the device: 0 for a row
    computing nothing, 1 for a one-token row, else its bucket (bit lengths of ``query_len - 1``
    and ``seq_len - 1``, so a bucket pads each row less than twofold). A stable sort of the
    device keys puts each group's rows in a slice whose bounds the host keys give.
    """
    qlens, ctxs = meta.query_lens_host, meta.seq_lens_host
    dev = meta.block_tables.device
    if all(q == 1 for q in qlens):
        rows = torch.arange(len(qlens), device=dev)
        one = _one_token_rows(meta, rows, rows, list(ctxs), block_size, kv) if qlens else None
        return Plan(one, (), True)
    width = max(_bits(max(qlens)), _bits(max(ctxs))) + 1
    host_keys = [0 if q == 0 else 1 if q == 1 else 2 + _bits(q - 1) * width + _bits(c - 1)
                 for q, c in zip(qlens, ctxs)]
    q_dev = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
    c_dev = meta.seq_lens.long()
    powers = 2 ** torch.arange(width, device=dev)

    def bits(x):                                   # bit length of x >= 0, on the device
        return (x[:, None] >= powers).sum(-1)
    keys = torch.where(q_dev <= 1, q_dev, 2 + bits(q_dev - 1) * width + bits(c_dev - 1))
    order = torch.sort(keys, stable=True).indices
    host_order = sorted(range(len(qlens)), key=host_keys.__getitem__)
    one, chunks, at = None, [], 0
    while at < len(host_order):
        key = host_keys[host_order[at]]
        end = at
        while end < len(host_order) and host_keys[host_order[end]] == key:
            end += 1
        rows, members = order[at:end], host_order[at:end]
        if key == 1:
            starts = meta.query_start_loc.index_select(0, rows).long()
            one = _one_token_rows(meta, rows, starts, [ctxs[r] for r in members], block_size, kv)
        elif key > 1:
            chunks.append(_chunk_rows(meta, rows, [qlens[r] for r in members],
                                      [ctxs[r] for r in members], block_size, dtype))
        at = end
    return Plan(one, tuple(chunks), False)


def _slots_of(meta, rows, pos, block_size):
    """The slot of position ``pos`` [rows, n] of each of ``rows`` [rows]."""
    blocks = meta.block_tables[rows[:, None], pos // block_size].long()
    return blocks * block_size + pos % block_size


def _one_token_rows(meta, rows, tokens, ctxs: list[int], block_size: int, kv: int) -> OneTokenRows:
    width = min(TILE, max(ctxs))
    counts = [-(-c // width) for c in ctxs]
    n, tiles = len(ctxs), sum(counts)
    dev = rows.device
    ctx = meta.seq_lens.index_select(0, rows).long()
    per_row = (ctx + width - 1) // width
    tile_row = torch.repeat_interleave(torch.arange(n, device=dev), per_row, output_size=tiles)
    first = torch.cumsum(per_row, 0) - per_row
    pos = ((torch.arange(tiles, device=dev) - first[tile_row]) * width)[:, None] + torch.arange(width, device=dev)
    inside = pos < ctx[tile_row][:, None]
    pos = pos * inside                                         # a padding position reads position 0
    slots = _slots_of(meta, rows[tile_row], pos, block_size)                 # [tiles, width]
    slots = (slots[:, None, :] * kv + torch.arange(kv, device=dev)[:, None]).view(-1)   # [tiles, kv, width]
    return OneTokenRows(tokens=tokens, tile_row=tile_row, tile_token=tokens[tile_row], slots=slots,
                        masked=~inside.view(tiles, 1, 1, width), rows=n, tiles=tiles, width=width)


def _chunk_rows(meta, rows, qlens: list[int], ctxs: list[int], block_size: int, dtype) -> ChunkRows:
    n, q_len, ctx_len, real = len(qlens), max(qlens), max(ctxs), sum(qlens)
    dev = rows.device
    q = (meta.query_start_loc.index_select(0, rows + 1) - meta.query_start_loc.index_select(0, rows)).long()
    start = meta.query_start_loc.index_select(0, rows).long()
    ctx = meta.seq_lens.index_select(0, rows).long()
    i = torch.minimum(torch.arange(q_len, device=dev), q[:, None] - 1)     # a padding query repeats the last
    j = torch.arange(ctx_len, device=dev)
    visible = j <= ((ctx - q)[:, None] + i)[:, :, None]                     # [rows, q_len, ctx]
    mask = torch.zeros(visible.shape, dtype=dtype, device=dev).masked_fill_(~visible, float("-inf"))
    pos = j * (j < ctx[:, None])                                            # a padding position reads 0
    row_of = torch.repeat_interleave(torch.arange(n, device=dev), q, output_size=real)
    k = torch.arange(real, device=dev) - (torch.cumsum(q, 0) - q)[row_of]
    return ChunkRows(query_index=(start[:, None] + i).view(-1), slots=_slots_of(meta, rows, pos, block_size).view(-1),
                     mask=mask[:, None], out_index=row_of * q_len + k, tokens=start[row_of] + k,
                     rows=n, q_len=q_len, ctx=ctx_len)
