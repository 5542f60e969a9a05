"""The engine: what the branches of one Session share — model runner, KV cache, cache manager,
slot ledger, dispatch buffers, hooks, the Session's call gate. It holds state; ``step.py`` runs
steps on it.
"""
from __future__ import annotations

import torch

from ..cache.kv_cache import KVCache
from ..cache.ledger import SlotLedger
from ..cache.manager import KVCacheManager
from ..config import SessionConfig
from ..kernels.invariant import BatchInvariant
from ..model.qwen3 import Qwen3Model
from .faults import FaultEmulator
from .hooks import StepHooks
from .request import ABORTED, FINISHED, Request
from .runner import DispatchBuffers, ModelRunner
from .step import Commit, commit
from .transaction import StepDraft


class Engine:
    def __init__(self, model: Qwen3Model, config: SessionConfig, calls, parallel=None):
        """``calls``: the call gate of the Session that makes this engine (``session/steps.py``'s
        ``CallGate``), shared by its forks. ``parallel``: the ``TensorParallelGroup`` of the other
        ranks when the model spans several devices (``model`` is then rank 0's shard and
        ``kv_cache`` holds rank 0's KV heads)."""
        self.model = model
        self.config = config
        mc = model.config
        device = model.device
        self.max_blocks = config.max_blocks_per_seq     # a request's block table, at most
        self.kv_cache = KVCache(mc.num_hidden_layers, config.num_blocks, config.block_size,
                                mc.num_key_value_heads, mc.head_dim, model.dtype, device)
        self.manager = KVCacheManager(config.num_blocks, config.block_size, config.prefix_cache)
        self.ledger = SlotLedger(self.kv_cache.num_slots)
        self.buffers = DispatchBuffers(
            max_batch=config.max_batch,
            max_tokens=min(config.chunk_size, config.max_batch * config.max_model_len),
            max_blocks=config.max_blocks_per_seq, vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
            hidden_dtype=model.dtype, device=device,
            max_logits=config.max_batch * (1 + config.num_speculative_tokens))
        if config.deterministic != isinstance(model.kernels, BatchInvariant):
            raise ValueError(f"SessionConfig.deterministic is {config.deterministic} but the model's "
                             f"kernels are {model.kernels!r}: a deterministic Session's model runs "
                             "BatchInvariant kernels (kernels/invariant.py), and only it does")
        self.parallel = parallel
        make_runner = ModelRunner if parallel is None else parallel.runner     # ``parallel/runner.py``
        self.runner = make_runner(model, self.kv_cache, self.buffers, sync_timings=config.sync_timings)
        # None, or the step hooks of the open captures and interventions (engine/hooks.py)
        self.hook: StepHooks | None = None
        self.branches = None       # the Sessions sharing this engine after a fork (session_fork.py)
        self.calls = calls          # one state-changing call at a time, across threads
        self.next_request_id = 0   # request ids are unique per engine, so forked Sessions never clash
        self.faults: FaultEmulator | None = None   # EMULATED hardware faults; off unless asked for
        self.dropped: list[dict] = []   # request maps of branches garbage-collected with live requests

    def kv_rows(self, layers, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [layers, slots, num_kv_heads, head_dim] of ``slots``: every KV head of the model,
        gathered from every rank with tensor parallelism (rank r's heads after rank r-1's; one
        host copy per rank). On the cache's device without, on the host with."""
        if self.parallel is not None:
            return self.parallel.read_slots(self.kv_cache, list(layers), list(slots))
        return self.kv_cache.rows(layers, slots)

    def collect_dropped(self) -> None:
        """Abort the unfinished requests of branches dropped since the last call, freeing their
        blocks (a branch's finalizer only queues them: it may run in the middle of a step)."""
        while self.dropped:
            requests = self.dropped.pop()
            for req in requests.values():
                if not req.is_done:
                    self.finish(req, "abort", ABORTED)

    def finish(self, req: Request, reason: str, status: str = FINISHED) -> None:
        """Finish ``req`` now (an abort): a change of its own, applied by ``step.commit``."""
        draft = StepDraft(self.manager, {req.id: req})
        draft.finish(draft.of(req), reason, status)
        commit(self, Commit(draft=draft))

    def reset(self) -> None:
        self.dropped.clear()
        self.next_request_id = 0
        self.manager.reset()
        self.ledger.reset()
        self.kv_cache.zero_()
        if self.faults is not None:
            self.faults.applied.clear()          # the cache they describe is gone; the model stays on
