"""Prefill attention through torch's ``scaled_dot_product_attention``: the cpu set's path for bf16
prefill rows on a CPU with AMX tiles that its own kernels cannot use (``cpu.amx_tiles()`` false:
a build or a process without them), where SDPA runs on the tiles.

Contract: ``paged_attention(query, key_cache, value_cache, meta, scale, rest)`` is
``reference.paged_attention`` within the bf16 tolerance; rows of ``SDPA_ROWS`` tokens or more
gather their K/V through the block table into one SDPA call each, every other row of the step
(decode rows of a mixed step, short chunks) goes to ``rest(query, block_tables, seq_lens,
query_start_loc)`` in one call. The split of the step's rows is made once per step (every layer
shares the metadata) and kept for its next layers.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata

# From this many tokens on, a bf16 prefill row on a CPU with AMX tiles that the C++ kernels cannot use
# (``amx_tiles()`` false: a build or a process without them) runs torch's SDPA (paged_attention).
SDPA_ROWS = 16
# A causal row longer than SDPA_PAD_FROM tokens is zero-padded at its end to a multiple of SDPA_PAD
# for SDPA, which is up to twice as fast on such lengths (docs/benchmarks.md); the padding is
# past every real token, so the causal mask keeps it from their outputs.
SDPA_PAD, SDPA_PAD_FROM = 16, 128

_last_split: tuple | None = None


def split_rows(meta: AttentionMetadata) -> tuple:
    """(meta, the SDPA rows [(token start, end, block table, context, mask or None)], the C++ rows
    (token index, block tables, seq_lens, query starts) or None), kept for the step's next layers."""
    global _last_split
    starts = [0, *itertools.accumulate(meta.query_lens_host)]
    long, short = [], []
    for r, n in enumerate(meta.query_lens_host):
        if n < SDPA_ROWS:
            short.append(r)
            continue
        context = meta.seq_lens_host[r]
        mask = None              # queries past a cached prefix: key j is visible to query i if j <= start + i
        if n < context:
            mask = torch.arange(context)[None, :] <= torch.arange(context - n, context)[:, None]
        long.append((starts[r], starts[r + 1], meta.block_tables[r], context, mask))
    rest = None
    if short:
        rows = torch.tensor(short)
        lens = [meta.query_lens_host[r] for r in short]
        rest = (torch.cat([torch.arange(starts[r], starts[r + 1]) for r in short]), meta.block_tables[rows],
                meta.seq_lens[rows], torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32))
    _last_split = (meta, long, rest)
    return _last_split


def sdpa_row(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
              context: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One row's attention: q [L, H, D] at positions context-L .. context-1 over the row's K/V
    0 .. context-1, gathered from its blocks -> [L, H, D]; causal when ``mask`` is None (L == context)."""
    block_size = key_cache.shape[1]
    blocks = table[:-(-context // block_size)].long()
    q = q.transpose(0, 1)[None]                                              # [1, H, L, D]
    k = key_cache[blocks].flatten(0, 1)[:context].transpose(0, 1)[None]      # [1, KV, S, D]
    v = value_cache[blocks].flatten(0, 1)[:context].transpose(0, 1)[None]
    length = q.shape[2]
    if mask is None and length > SDPA_PAD_FROM and length % SDPA_PAD:        # causal: L == S
        pad = (0, 0, 0, -length % SDPA_PAD)
        q, k, v = F.pad(q, pad), F.pad(k, pad), F.pad(v, pad)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                       enable_gqa=True)              # 4-D: the flash path (3-D takes the slow one)
    return y[0, :, :length].transpose(0, 1)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, rest: Callable) -> torch.Tensor:
    """See the module docstring."""
    split = _last_split
    if split is None or split[0] is not meta:            # once per step: every layer shares the metadata
        split = split_rows(meta)
    out = torch.empty_like(query)
    for a, b, table, context, mask in split[1]:
        out[a:b] = sdpa_row(query[a:b], key_cache, value_cache, table, context, mask, scale)
    if split[2] is not None:     # the rest (decode rows of a mixed step, short chunks) in one call
        tokens, tables, seq_lens, starts = split[2]
        out[tokens] = rest(query[tokens], tables, seq_lens, starts)
    return out
