"""Dispatch one planned step and book its results on the step's draft; sample on the device.

Nothing here changes live state: ``run`` and ``sample`` stage their results on a StepDraft and a
Commit, which the Session applies (see ``transaction.py`` for the phases).

    plan ─> slot checks ─> runner.dispatch (buffers [:n], model) ─> bookkeeping (computed
    tokens, prefix hashes, slot ledger) ─> StepResult ─> sample on device ─> token ids to host
    ─> requests advance / finish / free their blocks

The only host syncs are named: the token-id copy in ``sample`` and, with device outputs off,
the full-logits copy after the forward.
"""
from __future__ import annotations

import time

import torch

from ..cache.block_table import pad_block_tables
from ..cache.kv_cache import KVCache
from ..cache.ledger import SlotLedger
from ..cache.manager import KVCacheManager
from ..cache.slot_check import StepWrites, check_step_writes, raise_or_warn
from ..config import SessionConfig
from ..errors import InvalidRequestError
from ..model.qwen3 import Hook, Qwen3Model
from . import logprobs, sampler, stopping
from .buffers import DispatchBuffers
from .calls import CallGate
from .commit import Commit, StreamHealthWarning  # noqa: F401 - re-exported
from .deterministic import TokenByTokenRunner
from .draft import RequestDraft, StepDraft
from .faults import FaultEmulator
from .outputs import DeviceLogits, StepResult
from .plan import StepPlan, buffer_set
from .request import ABORTED, DECODING, FINISHED, Request
from .runner import ModelRunner
from .transaction import KVGuard, deferred_interrupts, fault_point

HEALTH = {1: "non-finite logits", 2: "all-zero logits", 3: "all-equal logits"}


class Engine:
    def __init__(self, model: Qwen3Model, config: SessionConfig):
        self.model = model
        self.config = config
        mc = model.config
        device = model.device
        self.kv_cache = KVCache(mc.num_hidden_layers, config.num_blocks, config.block_size,
                                mc.num_key_value_heads, mc.head_dim, model.dtype, device)
        self.manager = KVCacheManager(config.num_blocks, config.block_size, config.prefix_cache)
        self.ledger = SlotLedger(self.kv_cache.num_slots)
        self.buffers = DispatchBuffers(
            max_batch=config.max_batch, max_tokens=min(config.chunk_size, config.max_batch * config.max_model_len),
            max_blocks=config.max_blocks_per_seq, vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
            hidden_dtype=model.dtype, device=device)
        runner = TokenByTokenRunner if config.deterministic else ModelRunner
        self.runner = runner(model, self.kv_cache, self.buffers, sync_timings=config.sync_timings)
        # None (the forward pays one flag check per hook point), a model Hook, or a step hook: an
        # object whose ``begin_step(plan)`` returns the Hook for that step (qwen_npu/research/hooks.py)
        self.hook: Hook | None = None
        self.branches = None       # the Sessions sharing this engine after a fork (session_fork.py)
        self.calls = CallGate()     # one state-changing call at a time, across threads (engine/calls.py)
        self.next_request_id = 0   # request ids are unique per engine, so forked Sessions never clash
        self.faults: FaultEmulator | None = None   # EMULATED hardware faults; off unless asked for
        self.dropped: list[dict] = []   # request maps of branches garbage-collected with live requests

    def collect_dropped(self) -> None:
        """Abort the unfinished requests of branches dropped since the last call, freeing their
        blocks (a branch's finalizer only queues them: it may run in the middle of a step)."""
        while self.dropped:
            requests = self.dropped.pop()
            for req in requests.values():
                if not req.is_done:
                    self.finish(req, "abort", ABORTED)

    # ---- running a step: dispatch, then book on the draft (nothing live changes) --------------
    def run(self, plan: StepPlan, draft: StepDraft, requests: dict, timings: dict) -> tuple[StepResult, Commit]:
        """Validate and dispatch ``plan``; book its results on ``draft``. Returns the StepResult
        (not yet sampled) and the Commit that publishes it. Changes no live state."""
        transfers = {"h2d": 0, "d2h": 0}
        problems = []
        if self.config.slot_check != "off":
            t0 = time.perf_counter()
            problems = self.check_plan(plan, requests, draft)
            timings["check"] = time.perf_counter() - t0
            raise_or_warn(problems, self.config.slot_check, stacklevel=5)
        fault_point("validated")
        hook = self.hook
        if hook is not None and hasattr(hook, "begin_step"):
            hook = hook.begin_step(plan)
        guard = KVGuard(self.kv_cache, self.manager.committed_blocks(_written_blocks(plan, self.config.block_size)))
        try:
            logits_buf, hidden_buf, out_rows = self.runner.dispatch(plan, timings, transfers, hook=hook)
            fault_point("dispatched")
            step, commit = self._book(plan, draft, logits_buf, hidden_buf, problems, timings, transfers,
                                      hook)
        except BaseException:
            guard.restore()
            raise
        commit.guard = guard
        return step, commit

    def _book(self, plan, draft, logits_buf, hidden_buf, problems, timings, transfers, hook=None):
        t0 = time.perf_counter()
        manager = draft.manager
        private = getattr(hook, "private_requests", None)      # K/V computed under a research edit
        for rid, why in (private() if private is not None else {}).items():
            manager.keep_private(rid, why)
        for row in plan.rows[:plan.num_active]:
            req = row.request
            req.num_computed_tokens = row.end
            manager.commit(req.id, req.all_token_ids, row.end)
        writes = self.ledger.prepare(plan.index, plan.slot_mapping,
                                     [r.request.id for r in plan.rows for _ in range(r.end - r.start)],
                                     plan.positions,
                                     [i for i, r in enumerate(plan.rows) for _ in range(r.end - r.start)],
                                     [r.phase for r in plan.rows for _ in range(r.end - r.start)])
        fault_point("booked")
        n_logits = len(plan.logits_rows)
        gen = logits_buf.generation + 1          # what the commit makes it
        logits = DeviceLogits(logits_buf, n_logits, transfers, plan.index, generation=gen) if n_logits else None
        host_logits = torch.empty(0)
        if logits is not None and not self.config.device_outputs:
            host_logits = logits.view_unchecked().to("cpu", copy=True)
            transfers["d2h"] += host_logits.nbytes
            fault_point("d2h")
        timings["bookkeeping"] = time.perf_counter() - t0
        usage = _usage(manager)
        step = StepResult(
            kind=plan.kind, index=plan.index, request_ids=plan.request_ids, batch_size=len(plan.rows),
            num_active=plan.num_active,
            input_ids=torch.tensor(plan.input_ids), positions=torch.tensor(plan.positions),
            slot_mapping=torch.tensor(plan.slot_mapping), query_lens=torch.tensor(plan.query_lens),
            block_tables=_pad(plan.block_tables, self.config.max_blocks_per_seq),
            seq_lens=torch.tensor(plan.seq_lens), logits=logits,
            logits_request_ids=[plan.rows[r].request.id for r in plan.logits_rows],
            host_logits=host_logits, hidden=hidden_buf.tensor[:n_logits] if n_logits else None,
            timings=timings, transfers=transfers, slot_problems=problems, block_size=self.config.block_size,
            cache_usage=usage,
            row_preemptions=[r.request.num_preemptions for r in plan.rows[:plan.num_active]],
            row_kinds=plan.row_kinds)
        commit = Commit(self, draft)
        commit.ledger = writes
        commit.outputs = buffer_set(plan.kind)
        commit.step_index = plan.index
        return step, commit

    def cache_usage(self) -> dict:
        return _usage(self.manager)

    def check_plan(self, plan: StepPlan, requests: dict[int, Request], draft: StepDraft | None = None):
        rows = list(plan.row_slices())
        writes = StepWrites(
            plan.index, plan.kind, len(plan.rows), plan.num_active, plan.request_ids,
            [plan.positions[a:b] for _, a, b in rows], [plan.slot_mapping[a:b] for _, a, b in rows],
            plan.block_tables, row_kinds=plan.row_kinds)
        bs = self.config.block_size
        manager = draft.manager if draft is not None else self.manager

        def is_live(request_id: int, position: int, slot: int) -> bool:
            """Does (request, position) still hold ``slot`` with a computed token?"""
            req = requests.get(request_id)
            if req is not None and draft is not None:
                req = draft.drafts.get(request_id, req)
            if req is None or req.is_done or position >= req.num_computed_tokens:
                return False
            table = manager.block_table(request_id)
            if position // bs >= len(table):
                return False
            return table[position // bs] * bs + position % bs == slot

        return check_step_writes(writes, block_size=bs, num_blocks=self.config.num_blocks,
                                 ref_count=manager.pool.ref_count, ledger=self.ledger, is_live=is_live)

    # ---- sampling: on the device, tokens staged on the draft ----------------------------------
    def sample(self, step: StepResult, draft: StepDraft, generators: dict[int, torch.Generator],
               commit: Commit, *, force: dict[int, int] | None = None) -> torch.Tensor:
        """Sample every logits row of ``step`` on the device and stage the tokens on ``draft``.

        Returns the token ids [rows] on the device. The one host sync: a single int64 per row,
        the token id with the row's health code packed into its upper 32 bits (widened to
        ``2 + k`` int64 when a row asks for log-probabilities, see ``logprobs.py``). Random
        generators are advanced on copies that ``commit`` puts in place.
        """
        t0 = time.perf_counter()
        reqs = [draft.of(r) for r in (draft.requests[i] for i in step.logits_request_ids)]
        logits = step.logits.view_unchecked()                          # [rows, vocab]
        allowed, h2d_mask = stopping.mask_early_stops(logits, reqs)
        ids, h2d = sampler.sample(allowed, [r.sampling for r in reqs],
                                  [draft.generator(r.id, generators) for r in reqs])
        fault_point("sampled")
        h2d += h2d_mask
        if force:
            forced = torch.tensor([force.get(r.id, -1) for r in reqs], dtype=torch.int64)
            h2d += forced.nbytes
            forced = forced.to(ids.device)
            ids = torch.where(forced >= 0, forced, ids)
        ks = [r.sampling.logprobs for r in reqs]
        packed = ids | (_health_codes(logits) << 32)
        packed = logprobs.attach(packed, logits, ids, logprobs.width(ks, logits.shape[-1]))
        host = packed.cpu()
        d2h = host.nbytes
        fault_point("d2h")
        lps = logprobs.unpack(host, ks)
        host = host if host.dim() == 1 else host[:, 0]
        tokens = host & 0xFFFFFFFF
        codes = (host >> 32).tolist()
        health = [(reqs[i].id, HEALTH[c]) for i, c in enumerate(codes) if c]
        for req, tok, lp in zip(reqs, tokens.tolist(), lps):
            if req.is_done:
                continue                         # aborted between the forward and this sample
            self.stage_token(draft, req, tok, lp)
        fault_point("staged")
        commit.sampled = (step, tokens, health, h2d, d2h, time.perf_counter() - t0)
        return ids

    @staticmethod
    def stage_token(draft: StepDraft, req: RequestDraft, token: int, lp=None) -> None:
        req.append_token(token, lp)
        req.status = DECODING
        why = stopping.fired(req, token)
        if why is not None:
            req.stop_reason = why
            draft.finish(req, "stop")
        elif len(req.output_token_ids) >= req.sampling.max_new_tokens:
            draft.finish(req, "length")

    def finish(self, req: Request, reason: str, status: str = FINISHED) -> None:
        """Finish ``req`` now (an abort): one small transaction of its own."""
        draft = StepDraft(self.manager, {req.id: req})
        draft.finish(draft.of(req), reason, status)
        with deferred_interrupts():
            draft.apply({})

    def reset(self) -> None:
        self.dropped.clear()
        self.next_request_id = 0
        self.manager.reset()
        self.ledger.reset()
        self.kv_cache.zero_()
        if self.faults is not None:
            self.faults.applied.clear()          # the cache they describe is gone; the model stays on


def _written_blocks(plan: StepPlan, block_size: int) -> dict[int, int]:
    """block -> the request whose row writes it in ``plan`` (active rows)."""
    out: dict[int, int] = {}
    for row, a, b in plan.row_slices():
        if row >= plan.num_active:
            break
        rid = plan.rows[row].request.id
        for slot in plan.slot_mapping[a:b]:
            if slot >= 0:
                out.setdefault(slot // block_size, rid)
    return out


def _usage(m) -> dict:
    """Blocks by state: used (held), cached (reusable prefix, ref count 0), free."""
    return {"used": m.num_used_blocks, "cached": m.num_cached_blocks,
            "free": m.num_free_blocks - m.num_cached_blocks}


def _health_codes(logits: torch.Tensor) -> torch.Tensor:
    """Per row: 0 healthy, 1 non-finite, 2 all zero, 3 all equal (int64, on the device)."""
    hi, lo = logits.amax(dim=-1), logits.amin(dim=-1)                   # [rows]
    if logits.is_cpu:
        # torch's CPU max/min propagate NaN, so a row holds a NaN or an inf exactly when its max or
        # min is not finite: two passes over the logits instead of four (~6 ms a batch-16 step)
        nonfinite = ~(torch.isfinite(hi) & torch.isfinite(lo))
    else:
        nonfinite = ~torch.isfinite(logits).all(dim=-1)
    equal = hi == lo
    zero = equal & (hi == 0)
    code = torch.where(zero, 2, torch.where(equal, 3, 0))
    return torch.where(nonfinite, 1, code).to(torch.int64)


def _pad(tables: list[list[int]], width: int) -> torch.Tensor:
    """[rows, width] int32, -1 padded; only the longest table's width goes through Python lists."""
    out = torch.full((len(tables), width), -1, dtype=torch.int32)
    used = max(map(len, tables), default=0)
    if used:
        out[:, :used] = torch.tensor(pad_block_tables(tables, used), dtype=torch.int32)
    return out


def check_not_pending(last: StepResult | None, action: str, requests: dict | None = None) -> None:
    """Refuse ``action`` while the last step has unsampled logits rows of unfinished requests
    (a step whose rows all belong to requests aborted since needs no sample)."""
    if last is not None and not last.sampled:
        if requests is not None and all(
                rid not in requests or requests[rid].is_done for rid in last.logits_request_ids):
            return
        raise InvalidRequestError(
            f"cannot {action}: step {last.index} ({last.kind}) has unsampled rows for requests "
            f"{last.logits_request_ids}; call sess.sample() first")
