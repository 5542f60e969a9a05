"""Turn a StepPlan into dispatch-buffer views and run the model on them.

Only the first ``n`` rows of every capacity buffer are written and dispatched (runtime batch);
the model's outputs land in cached device buffers, so nothing but what the plan needs moves.

Timings: ``prepare`` and ``forward`` are host wall-clock time. On an asynchronous device (NPU,
CUDA) the forward returns once its kernels are queued, so its time would land in the next phase
that waits for the device (``sample``'s token-id copy). With ``sync_timings`` on, each of the two
phases ends at a device synchronisation, so every phase holds its own time; that costs the
overlap of host work with queued device work, two synchronisations per step (a no-op on the CPU).
"""
from __future__ import annotations

import time

import torch

from ..cache.block_table import pad_block_tables
from ..cache.kv_cache import KVCache
from ..device import synchronize
from ..kernels.metadata import AttentionMetadata
from ..model.qwen3 import Hook, Qwen3Model
from .buffers import DispatchBuffers, OutputBuffer
from .plan import StepPlan, buffer_set


class ModelRunner:
    def __init__(self, model: Qwen3Model, kv_cache: KVCache, buffers: DispatchBuffers, *,
                 sync_timings: bool = False):
        self.model = model
        self.kv_cache = kv_cache
        self.buffers = buffers
        self.sync_timings = sync_timings

    def end_phase(self) -> None:
        """Wait for the device's queued work when timings must hold per phase (see the module doc)."""
        if self.sync_timings:
            synchronize(self.model.device)

    def dispatch(self, plan: StepPlan, timings: dict, transfers: dict, *,
                 hook: Hook | None = None) -> tuple[OutputBuffer, OutputBuffer, int]:
        """Run the plan; returns (logits buffer, hidden buffer, rows written to them)."""
        t0 = time.perf_counter()
        meta = self.fill(plan, transfers)
        logits_buf, hidden_buf = self.outputs(buffer_set(plan.kind))
        pre = "" if buffer_set(plan.kind) == "decode" else "prefill."
        b, out_rows = self.buffers, len(plan.logits_index)
        self.end_phase()
        t1 = time.perf_counter()
        timings["prepare"] = timings.get("prepare", 0.0) + t1 - t0
        with torch.no_grad():
            self.model(b.view(pre + "input_ids", plan.num_tokens), meta, self.kv_cache.layers(),
                       b.view(pre + "logits_index", out_rows),
                       logits_out=logits_buf.tensor[:out_rows], hidden_out=hidden_buf.tensor[:out_rows],
                       hook=hook)
            self.end_phase()
        timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - t1
        return logits_buf, hidden_buf, out_rows

    def fill(self, plan: StepPlan, transfers: dict) -> AttentionMetadata:
        """Copy the plan into rows [0, n) of its buffer set; returns metadata over views [:n]."""
        b = self.buffers
        pre = "" if buffer_set(plan.kind) == "decode" else "prefill."
        rows, tokens = len(plan.rows), plan.num_tokens
        width = max(len(t) for t in plan.block_tables) or 1
        tables = torch.tensor(pad_block_tables(plan.block_tables, width), dtype=torch.int32)  # [rows, width]
        qsl = [0]
        for n in plan.query_lens:
            qsl.append(qsl[-1] + n)
        h2d = b.fill(pre + "input_ids", torch.tensor(plan.input_ids, dtype=torch.int64))
        h2d += b.fill(pre + "positions", torch.tensor(plan.positions, dtype=torch.int64))
        h2d += b.fill(pre + "slot_mapping", torch.tensor(plan.slot_mapping, dtype=torch.int64))
        h2d += b.fill(pre + "seq_lens", torch.tensor(plan.seq_lens, dtype=torch.int32))
        h2d += b.fill(pre + "block_tables", tables)
        h2d += b.fill(pre + "query_start_loc", torch.tensor(qsl, dtype=torch.int32))
        h2d += b.fill(pre + "logits_index", torch.tensor(plan.logits_index, dtype=torch.int64))
        transfers["h2d"] += h2d
        return AttentionMetadata(
            positions=b.view(pre + "positions", tokens),
            slot_mapping=b.view(pre + "slot_mapping", tokens),
            block_tables=b.view(pre + "block_tables", rows),
            seq_lens=b.view(pre + "seq_lens", rows),
            query_start_loc=b.view(pre + "query_start_loc", rows + 1),
            query_lens_host=tuple(plan.query_lens),
            seq_lens_host=tuple(plan.seq_lens),
            is_decode=plan.kind == "decode",
        )

    def outputs(self, kind: str) -> tuple[OutputBuffer, OutputBuffer]:
        """The (logits, hidden) output buffers a new step of ``kind`` writes: the spare pair, whose
        handles are all stale already (the step's commit publishes it; see ``buffers.py``)."""
        b, cfg = self.buffers, self.model.config
        pair = b.spare(kind)
        logits_buf = b.output(kind, "logits", b.max_batch, cfg.vocab_size, torch.float32, pair)
        hidden_buf = b.output(kind, "hidden", b.max_batch, cfg.hidden_size, self.model.dtype, pair)
        return logits_buf, hidden_buf
