"""Batch-invariant kernels: a token's bits depend on its own row, never on what shares the step.

An ordinary step is not batch invariant. A matrix product picks its blocking and its reduction
order from the matrix shape (torch's float32 product on this project's CPUs rounds a row one
way when it is alone and another in a batch of 5 or more), and attention over a prefill chunk
sums a token's context in tiles whose bounds depend on where the chunk began. A near-tie token
can then flip when the batch around a request changes.

``BatchInvariant(kernels)`` is a kernel set (the contract of README.md) whose every output
element is reduced in an order fixed by the model's shapes and the token's own position:

    products        every row of x is multiplied the same way, whatever the number of rows:
                      the cpu set: C++ dot products along k with one fixed tree of sums per
                      output (csrc/linear.cpp with ``panel_rows=0``, csrc/linear_bf16.cpp);
                      other sets: torch's product on tiles of exactly ``ROW_TILE`` rows
                      (zero-padded), so that every call has one shape
    paged_attention a token's sums run over its own context in fixed chunks from position 0,
                      whatever else shares its tile, chunk or step, and a decode token takes
                      the same path as a prefill one, so the decode, prefill, chunked and mixed
                      paths of one position meet one computation: the cpu set's C++ tile loop
                      for every token (``invariant=True``); in pure torch, one call per token
                      over its own blocks
    norms, RoPE,    per row already (the set's own functions)
      SiLU, K/V writes

So a request's K/V, logits and tokens are bit-identical alone, in any batch, with any
``chunk_size``, mixed steps or not, prefix-cached or recomputed after a preemption. Only on one
machine, one kernel set, one dtype, one thread count (and one tensor-parallel size): none of
those is held fixed. The cpu
set keeps its own functions; every other set (npu, cuda) takes the reference set's, pure torch
on the set's device, because their fused ops promise no invariance. ``deterministic=True``
makes a Session use this form of its set.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from . import cpu, reference
from .memo import LastResult
from .metadata import AttentionMetadata

ROW_TILE = 16       # rows per product call in the pure-torch form


class BatchInvariant:
    """The batch-invariant form of the kernel set ``base`` (a module of ``get_kernels``).

    ``NAME`` is the base set's; it has no ``prepare_weight``, so a model holds plain matrices
    (a set's reordered weights, such as the cpu set's oneDNN form, multiply rows by shape)."""

    def __init__(self, base: ModuleType):
        own = base is cpu
        self.base = base
        self.NAME = base.NAME
        funcs = base if own else reference
        self.write_kv, self.rms_norm, self.add_rms_norm, self.rope = (
            funcs.write_kv, funcs.rms_norm, funcs.add_rms_norm, funcs.rope)
        self.linear = cpu_linear if own else tiled_linear
        self.paged_attention = cpu_attention if own else reference_attention
        if own:
            self.qk_norm_rope, self.silu_mul, self.greedy_health = (
                cpu.qk_norm_rope, cpu.silu_mul, cpu.greedy_health)

    def __repr__(self) -> str:
        return f"BatchInvariant({self.NAME!r})"


def tiled_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` computed ``ROW_TILE`` rows per call, the last tile zero-padded, so
    that every call has the shape [ROW_TILE, K] and a row's bits do not depend on the others."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    out = torch.empty(m, weight.shape[0], dtype=x.dtype, device=x.device)
    for start in range(0, m, ROW_TILE):
        tile = rows[start:start + ROW_TILE]
        n = tile.shape[0]
        if n < ROW_TILE:
            tile = torch.cat((tile, tile.new_zeros(ROW_TILE - n, k)))
        out[start:start + n] = F.linear(tile, weight)[:n]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def cpu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The cpu set's product with one reduction order per output for every number of rows:
    bf16 dot products on a CPU with AVX512-BF16 (bf16 x and weights), fp32 dot products
    along k otherwise (csrc/linear.cpp)."""
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and cpu.bf16_dot():
        return cpu.ops().linear_bf16(x, weight)
    return cpu.ops().linear(x, weight, 0)        # panel_rows 0: dot products for every M


_TOKEN_ROWS = LastResult()     # once per step: every layer shares the metadata


def _token_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Each token of the step as a row of its own: (its row's block table [T, max_blocks], its
    context length [T], its position on the host)."""
    rows, positions = [], []
    for r, (n, context) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        rows += [r] * n
        positions += range(context - n, context)
    index = torch.tensor(rows, dtype=torch.long, device=meta.block_tables.device)
    return meta.block_tables.index_select(0, index), (meta.positions + 1).to(torch.int32), positions


def cpu_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """As ``cpu.paged_attention``, every token (decode ones too) through the C++ tile loop, whose
    sums for a query row are its own: a token's bits do not depend on the tile it shares."""
    return cpu.ops().paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, float(scale), cpu.bf16_dot(), True)


def reference_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """As ``reference.paged_attention``; each token in its own call over its own blocks (its
    context padded to whole blocks and masked), so its shapes depend only on its position. One
    call per token, not one per group of equal shapes: torch's batched products round a batch
    element by the batch's size."""
    tables, seq_lens, positions = _TOKEN_ROWS.get(meta, (meta.positions, meta.block_tables), (),
                                                    lambda: _token_rows(meta))
    block_size = key_cache.shape[1]
    out = torch.empty_like(query)
    for t, position in enumerate(positions):
        blocks = position // block_size + 1
        out[t:t + 1] = reference.attend_context(query[t:t + 1], key_cache, value_cache,
                                                tables[t:t + 1, :blocks], seq_lens[t:t + 1], scale)
    return out
