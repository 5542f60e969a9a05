"""Run one planned step end to end and apply its sampled tokens.

    plan ─> slot checks ─> runner.dispatch (buffers [:n], model) ─> bookkeeping (computed
    tokens, prefix hashes, slot ledger) ─> StepResult ─> sample on device ─> token ids to host
    ─> requests advance / finish / free their blocks

The only host syncs are named: the token-id copy in ``sample`` and, with device outputs off,
the full-logits copy after the forward.
"""
from __future__ import annotations

import time
import warnings

import torch

from ..cache.kv_cache import KVCache
from ..cache.ledger import SlotLedger
from ..cache.manager import KVCacheManager
from ..cache.slot_check import StepWrites, check_step_writes, raise_or_warn
from ..config import SessionConfig
from ..errors import InvalidRequestError
from ..model.qwen3 import Hook, Qwen3Model
from . import logprobs, sampler, stopping
from .buffers import DispatchBuffers
from .faults import FaultEmulator
from .outputs import DeviceLogits, StepResult
from .plan import StepPlan
from .request import DECODING, FINISHED, Request
from .deterministic import TokenByTokenRunner
from .runner import ModelRunner

HEALTH = {1: "non-finite logits", 2: "all-zero logits", 3: "all-equal logits"}


class StreamHealthWarning(UserWarning):
    """A row's logits are all zero, all equal or non-finite: its stream is broken."""


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
        self.runner = runner(model, self.kv_cache, self.buffers)
        # None (the forward pays one flag check per hook point), a model Hook, or a step hook: an
        # object whose ``begin_step(plan)`` returns the Hook for that step (qwen_npu/research/hooks.py)
        self.hook: Hook | None = None
        self.branches = None       # the Sessions sharing this engine after a fork (research/fork.py)
        self.next_request_id = 0   # request ids are unique per engine, so forked Sessions never clash
        self.faults: FaultEmulator | None = None   # EMULATED hardware faults; off unless asked for

    # ---- running a step ---------------------------------------------------------------------------
    def run(self, plan: StepPlan, requests: dict[int, Request], timings: dict) -> StepResult:
        """Check and dispatch ``plan``; returns its StepResult (not yet sampled)."""
        transfers = {"h2d": 0, "d2h": 0}
        problems = []
        if self.config.slot_check != "off":
            t0 = time.perf_counter()
            problems = self.check_plan(plan, requests if self.branches is None else self.branches.requests())
            timings["check"] = time.perf_counter() - t0
            raise_or_warn(problems, self.config.slot_check, stacklevel=4)
        hook = self.hook
        if hook is not None and hasattr(hook, "begin_step"):
            hook = hook.begin_step(plan)
        logits_buf, hidden_buf, out_rows = self.runner.dispatch(plan, timings, transfers, hook=hook)
        t0 = time.perf_counter()
        for row in plan.rows[:plan.num_active]:
            req = row.request
            req.num_computed_tokens = row.end
            self.manager.commit(req.id, req.all_token_ids, row.end)
        collisions = self.ledger.record(plan.index, plan.slot_mapping,
                                        [r.request.id for r in plan.rows for _ in range(r.end - r.start)],
                                        plan.positions,
                                        [i for i, r in enumerate(plan.rows) for _ in range(r.end - r.start)])
        if self.faults is not None and collisions:
            self.faults.apply(plan.index, collisions, self.kv_cache, stacklevel=4)
        n_logits = len(plan.logits_rows)
        logits = DeviceLogits(logits_buf, n_logits, transfers, plan.index) if n_logits else None
        host_logits = torch.empty(0)
        if logits is not None and not self.config.device_outputs:
            host_logits = logits.to_host()
        timings["bookkeeping"] = time.perf_counter() - t0
        return StepResult(
            kind=plan.kind, index=plan.index, request_ids=plan.request_ids, batch_size=len(plan.rows),
            num_active=plan.num_active,
            input_ids=torch.tensor(plan.input_ids), positions=torch.tensor(plan.positions),
            slot_mapping=torch.tensor(plan.slot_mapping), query_lens=torch.tensor(plan.query_lens),
            block_tables=_pad(plan.block_tables, self.config.max_blocks_per_seq),
            seq_lens=torch.tensor(plan.seq_lens), logits=logits,
            logits_request_ids=[plan.rows[r].request.id for r in plan.logits_rows],
            host_logits=host_logits, hidden=hidden_buf.tensor[:n_logits] if n_logits else None,
            timings=timings, transfers=transfers, slot_problems=problems, block_size=self.config.block_size,
            cache_usage=self.cache_usage(),
            row_preemptions=[r.request.num_preemptions for r in plan.rows[:plan.num_active]])

    def cache_usage(self) -> dict:
        """Blocks by state now: used (held), cached (reusable prefix, ref count 0), free."""
        m = self.manager
        return {"used": m.num_used_blocks, "cached": m.num_cached_blocks,
                "free": m.num_free_blocks - m.num_cached_blocks}

    def check_plan(self, plan: StepPlan, requests: dict[int, Request]):
        rows = list(plan.row_slices())
        writes = StepWrites(
            plan.index, plan.kind, len(plan.rows), plan.num_active, plan.request_ids,
            [plan.positions[a:b] for _, a, b in rows], [plan.slot_mapping[a:b] for _, a, b in rows],
            plan.block_tables)
        bs = self.config.block_size

        def is_live(request_id: int, position: int, slot: int) -> bool:
            """Does (request, position) still hold ``slot`` with a computed token?"""
            req = requests.get(request_id)
            if req is None or req.is_done or position >= req.num_computed_tokens:
                return False
            table = self.manager.block_table(request_id)
            if position // bs >= len(table):
                return False
            return table[position // bs] * bs + position % bs == slot

        return check_step_writes(writes, block_size=bs, num_blocks=self.config.num_blocks,
                                 ref_count=self.manager.pool.ref_count, ledger=self.ledger, is_live=is_live)

    # ---- sampling -------------------------------------------------------------------------------
    def sample(self, step: StepResult, requests: dict[int, Request],
               generators: dict[int, torch.Generator], *, force: dict[int, int] | None = None) -> torch.Tensor:
        """Sample every logits row of ``step`` on the device and apply the tokens to requests.

        Returns the token ids [rows] on the device. The one host sync: a single int64 per row,
        the token id with the row's health code packed into its upper 32 bits (widened to
        ``2 + k`` int64 when a row asks for log-probabilities, see ``logprobs.py``).
        """
        t0 = time.perf_counter()
        reqs = [requests[i] for i in step.logits_request_ids]
        logits = step.logits.tensor                                     # [rows, vocab]
        allowed, h2d_mask = stopping.mask_early_stops(logits, reqs)
        ids, h2d = sampler.sample(allowed, [r.sampling for r in reqs], [generators.get(r.id) for r in reqs])
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
        step.transfers["h2d"] += h2d
        step.transfers["d2h"] += host.nbytes
        lps = logprobs.unpack(host, ks)
        host = host if host.dim() == 1 else host[:, 0]
        tokens = host & 0xFFFFFFFF
        codes = (host >> 32).tolist()
        step.token_ids = tokens
        step.health = [(reqs[i].id, HEALTH[c]) for i, c in enumerate(codes) if c]
        if step.health:
            warnings.warn(f"step {step.index}: " + "; ".join(f"request {rid}: {why}" for rid, why in step.health),
                          StreamHealthWarning, stacklevel=3)
        for req, tok, lp in zip(reqs, tokens.tolist(), lps):
            if req.is_done:
                continue                         # aborted between the forward and this sample
            if lp is not None and req.logprobs is not None:
                req.logprobs.append(lp)
            self.append_token(req, tok)
        step.timings["sample"] = time.perf_counter() - t0
        return ids

    def append_token(self, req: Request, token: int) -> None:
        req.output_token_ids.append(token)
        req.status = DECODING
        sp = req.sampling
        why = stopping.fired(req, token)
        if why is not None:
            req.stop_reason = why
            self.finish(req, "stop")
        elif len(req.output_token_ids) >= sp.max_new_tokens:
            self.finish(req, "length")

    def finish(self, req: Request, reason: str, status: str = FINISHED) -> None:
        req.status = status
        req.finish_reason = reason
        if self.manager.has(req.id):
            self.manager.free(req.id)

    def new_request_id(self) -> int:
        rid = self.next_request_id
        self.next_request_id += 1
        return rid

    def reset(self) -> None:
        self.next_request_id = 0
        self.manager.reset()
        self.ledger.reset()
        self.kv_cache.zero_()
        if self.faults is not None:
            self.faults.applied.clear()          # the cache they describe is gone; the model stays on


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
    out = torch.full((len(tables), width), -1, dtype=torch.int32)
    for r, t in enumerate(tables):
        if t:
            out[r, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return out


def check_not_pending(last: StepResult | None, action: str) -> None:
    if last is not None and not last.sampled:
        raise InvalidRequestError(
            f"cannot {action}: step {last.index} ({last.kind}) has unsampled rows for requests "
            f"{last.logits_request_ids}; call sess.sample() first")
