"""Deterministic mode: results that do not depend on batch composition or chunking.

Why a normal step is not: a CPU (or GPU) matrix product picks its blocking and reduction order
from the matrix shape, so the same token row can round differently in a batch of 1 and of 16
(about 1e-5 on fp32 logits here), and a prefill chunk boundary changes the shapes of attention.
A near-tie token can then flip.

What this runner does: every token of a step runs as its own forward of exactly one token —
shaped like a one-row decode step — in the step's token order::

    step rows   A: [a3 a4 a5]   B: [b9]          normal: one forward over 4 tokens
    here        fwd(a3) fwd(a4) fwd(a5) fwd(b9)  each: 1 token, attention over its own context

So each linear layer multiplies a single row, and each token's attention spans exactly its own
context ``0..position`` (padded to whole blocks, as a one-row decode does). Every shape a token
meets depends only on its position, never on what shares the step or where a chunk ended, so a
request's K/V, logits and tokens are bit-identical alone, in any batch and with any
``chunk_size`` (on one machine, with one kernel set and thread count). Tokens of one row run in
order, so each finds its predecessors' K/V in the cache, as in a chunked prefill.

The cost is one forward per token: prefill loses all its batching and decode loses batching
across requests (see docs for measured figures). Dispatch buffers are filled once per step, as
usual; the per-token forwards read views of them, so h2d transfers do not grow. Research hooks
(captures, interventions) see each token's forward in turn and file it under its row.
"""
from __future__ import annotations

import time

import torch

from ..kernels.metadata import AttentionMetadata
from ..model.qwen3 import Hook
from .runner import OutputBuffer
from .plan import StepPlan, buffer_set
from .runner import ModelRunner


class TokenByTokenRunner(ModelRunner):
    """A ModelRunner that computes each token of a step in its own one-token forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        device = self.model.device
        self._query_start = torch.tensor([0, 1], dtype=torch.int32, device=device)   # [2]
        self._first = torch.zeros(1, dtype=torch.int64, device=device)               # [1] logits index

    def dispatch(self, plan: StepPlan, timings: dict, transfers: dict, *,
                 hook: Hook | None = None) -> tuple[OutputBuffer, OutputBuffer]:
        t0 = time.perf_counter()
        meta = self.fill(plan, transfers)
        logits_buf, hidden_buf = self.outputs(buffer_set(plan.kind))
        pre = "" if buffer_set(plan.kind) == "decode" else "prefill."
        b, tokens = self.buffers, plan.num_tokens
        input_ids = b.view(pre + "input_ids", tokens)
        positions, slots, block_tables = meta.positions, meta.slot_mapping, meta.block_tables
        out_row = {token: i for i, token in enumerate(plan.logits_index)}
        row_of = [r for r, n in enumerate(plan.query_lens) for _ in range(n)]
        kv = list(zip(self.kv_cache.keys, self.kv_cache.values))
        self.end_phase()
        t1 = time.perf_counter()
        timings["prepare"] = timings.get("prepare", 0.0) + t1 - t0
        for j in range(tokens):
            pos, r = positions[j:j + 1], row_of[j]                       # [1]
            meta = AttentionMetadata(
                positions=pos, slot_mapping=slots[j:j + 1], block_tables=block_tables[r:r + 1],
                seq_lens=(pos + 1).to(torch.int32), query_start_loc=self._query_start,
                query_lens_host=(1,), seq_lens_host=(plan.positions[j] + 1,), is_decode=True)
            o = out_row.get(j)
            if o is None:
                self.model(input_ids[j:j + 1], meta, kv, self._first[:0], hook=hook)
            else:
                self.model(input_ids[j:j + 1], meta, kv, self._first,
                           logits_out=logits_buf.tensor[o:o + 1], hidden_out=hidden_buf.tensor[o:o + 1],
                           hook=hook)
        self.end_phase()
        timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - t1
        return logits_buf, hidden_buf
