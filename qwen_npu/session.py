"""Session: the stateful facade over one model, its paged KV cache and its requests.

    sess.add_request(prompt) ─> sess.prefill() ─> sess.sample() ─> sess.decode_step() ─> sess.sample() ...
    sess.step()      = schedule + run + sample one step (mixed_steps=True: decode rows and
                       prefill chunks in one forward)
    sess.generate()  = step() until the given prompts finish (continuous batching)

Every step is a transaction (see ``engine/transaction.py``): it is planned on a draft, checked,
dispatched, and only then committed with plain assignments. A step refused or interrupted
before its commit — by an error, Ctrl-C or a warning turned into an error — changes nothing.
"""
from __future__ import annotations

import collections
import random
from pathlib import Path

import torch

from . import chat
from .config import ModelConfig, SessionConfig
from .engine import sampler
from .engine.admission import prepare_request
from .engine.calls import exclusive
from .engine.engine import Engine, check_not_pending
from .engine.outputs import StepResult
from .engine.request import ABORTED, Completion, Request, SamplingParams
from .engine.scheduler import Scheduler
from .engine.transaction import deferred_interrupts
from .errors import InvalidRequestError
from .extensions import implementation
from .loading import load_session
from .model.hub import checkpoint_folder
from .model.qwen3 import Qwen3Model
from .session_steps import SessionSteps
from .tokenizer import Tokenizer

HISTORY = 256


class Session(SessionSteps):
    """One model, its paged KV cache and its requests. Create with ``Session.from_pretrained``."""

    def __init__(self, model: Qwen3Model, config: SessionConfig, *, path: Path | None = None,
                 tokenizer: Tokenizer | None = None, engine: Engine | None = None):
        self.config = config
        self.model_config: ModelConfig = model.config
        self.path = path
        self.tokenizer = tokenizer
        self.model = model
        self._owns_engine = engine is None
        self._engine = engine if engine is not None else Engine(model, config)   # shared by forks
        self._scheduler = Scheduler(max_batch=config.max_batch, chunk_size=config.chunk_size)
        self._init_state()

    def _init_state(self) -> None:
        if hasattr(self, "_requests"):
            self._requests.clear()       # the same dict: a fork's finalizer watches it
        else:
            self._requests: dict[int, Request] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._step_index = 0
        self._seed_rng = random.Random(0)
        self.history: collections.deque[StepResult] = collections.deque(maxlen=HISTORY)

    @classmethod
    def from_pretrained(cls, path, *, device="auto", dtype="auto", max_batch=16, block_size=None,
                        num_blocks=None, max_model_len=None, chunk_size=512, prefix_cache=True,
                        device_outputs=None, slot_check="raise", decode_padding="runtime",
                        kernels="auto", kv_memory=None, deterministic=False, sync_timings=None,
                        mixed_steps=False, revision=None) -> Session:
        """Load a Qwen3 checkpoint into a new Session: a folder, or a Hugging Face repo id found in
        the user's Hugging Face cache (downloaded only where missing and the hub is online;
        ``revision`` pins a branch, tag or commit). See the API docs for the options."""
        path = checkpoint_folder(path, revision)
        model, config, tokenizer = load_session(
            path, device=device, dtype=dtype, max_batch=max_batch, block_size=block_size,
            num_blocks=num_blocks, max_model_len=max_model_len, chunk_size=chunk_size,
            prefix_cache=prefix_cache, device_outputs=device_outputs, slot_check=slot_check,
            decode_padding=decode_padding, kernels=kernels, kv_memory=kv_memory, deterministic=deterministic,
            sync_timings=sync_timings, mixed_steps=mixed_steps)
        return cls(model, config, path=path, tokenizer=tokenizer)

    # ---- requests -----------------------------------------------------------------------------------
    @exclusive
    def add_request(self, prompt, sampling: SamplingParams | None = None, *,
                    enable_thinking: bool | None = None, chat_template_kwargs: dict | None = None) -> Request:
        """Queue a prompt (text, token ids or chat messages); returns the live Request.

        Chat messages are rendered with the checkpoint's chat template; ``enable_thinking`` and
        ``chat_template_kwargs`` are passed to it as template variables."""
        chat_kwargs = chat.template_kwargs(enable_thinking, chat_template_kwargs)
        return self._add(*self._prepare(prompt, sampling, chat_kwargs))

    def _prepare(self, prompt, sampling,
                 chat_kwargs: dict | None = None) -> tuple[list[int], str | None, SamplingParams]:
        """Validate one prompt without changing any state."""
        return prepare_request(prompt, sampling, self.model_config, self.config, self.tokenizer,
                               where=str(self.path), chat_kwargs=chat_kwargs)

    def _add(self, ids: list[int], text: str | None, sampling: SamplingParams, *,
             draw_seed: bool = True) -> Request:
        """Add a validated request. ``draw_seed=False``: a greedy request that must not shift the
        seeds later unseeded requests draw (``score``)."""
        self._engine.collect_dropped()
        rid = self._engine.next_request_id
        req = self._new_request(rid, ids, text, sampling)
        rng = self._seed_rng.getstate()
        try:
            seed = sampling.seed
            if seed is None and draw_seed:
                seed = self._seed_rng.getrandbits(63)
            gen = None if sampling.greedy else sampler.new_generator(self.model.device, seed or 0)
        except BaseException:
            self._seed_rng.setstate(rng)
            raise
        with deferred_interrupts():
            self._engine.next_request_id = rid + 1
            if gen is not None:
                self._generators[rid] = gen
            self._requests[rid] = req
        return req

    def _new_request(self, rid: int, ids: list[int], text: str | None, sampling: SamplingParams) -> Request:
        """A Request object for this session; changes nothing."""
        eos = () if sampling.ignore_eos else self.model_config.eos_token_ids
        stops = frozenset(sampling.stop_token_ids if sampling.stop_token_ids is not None else eos)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return Request(rid, ids, sampling, stops, block_table=self._engine.manager.block_table,
                       decode=decode, prompt_text=text)

    @property
    def requests(self) -> list[Request]:
        """The live Requests in arrival order."""
        return list(self._requests.values())

    def request(self, request_id: int) -> Request:
        try:
            return self._requests[int(request_id)]
        except KeyError:
            raise InvalidRequestError(f"no request with id {request_id}") from None

    @exclusive
    def abort(self, req) -> None:
        """Stop a request wherever it is and free its blocks."""
        self._engine.collect_dropped()
        req = self.request(req.id if isinstance(req, Request) else req)
        if req.is_done:
            raise InvalidRequestError(f"request {req.id} already {req.status}")
        self._engine.finish(req, "abort", ABORTED)

    @exclusive
    def reset(self) -> None:
        """Forget every request and step; empty the cache (back to the state after loading).
        A forked Session (sharing its cache) only aborts its own requests and forgets its steps."""
        self._engine.collect_dropped()
        if self._engine.branches is not None:
            from .session_fork import reset_branch
            if reset_branch(self):
                return
        with deferred_interrupts():
            self._engine.reset()
            self._init_state()

    # ---- steps ----------------------------------------------------------------------------------------
    @property
    def last_step(self) -> StepResult | None:
        return self.history[-1] if self.history else None

    @exclusive
    def generate(self, prompts, sampling=None, progress=None, *, enable_thinking: bool | None = None,
                 chat_template_kwargs: dict | None = None) -> list[Completion]:
        """Run ``prompts`` to completion with continuous batching; results in input order."""
        chat_kwargs = chat.template_kwargs(enable_thinking, chat_template_kwargs)
        reqs = self._add_batch(prompts, sampling, "generate", chat_kwargs)
        from .progress import StepProgress
        bar = StepProgress(progress, reqs)           # prompt tokens prefilled + tokens generated
        try:
            while not all(r.is_done for r in reqs):
                bar.update(self.step())
        finally:
            bar.close()
        return [Completion.of(r) for r in reqs]

    def _add_batch(self, prompts, sampling, action: str, chat_kwargs: dict) -> list[Request]:
        """Validate every prompt first, then add them all (one prompt or a list; one sampling or one each)."""
        single = isinstance(prompts, (str, torch.Tensor)) or chat.is_messages(prompts)
        if single or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(samplings) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(samplings)} sampling params")
        check_not_pending(self.last_step, action, self._requests)
        prepared = [self._prepare(p, s, chat_kwargs) for p, s in zip(prompts, samplings)]
        return [self._add(*p) for p in prepared]

    def stream(self, prompts, sampling=None, *, enable_thinking: bool | None = None,
               chat_template_kwargs: dict | None = None):
        """Like ``generate``, but yields StreamEvents (request, text increment) as tokens arrive."""
        from .streaming import stream
        return stream(self, prompts, sampling, chat.template_kwargs(enable_thinking, chat_template_kwargs))

    @exclusive
    def score(self, prompt, continuation, *, include_prompt: bool = False):
        """Teacher-force ``continuation`` after ``prompt``; per-token log-probabilities (ScoreResult)."""
        from .scoring import score
        return score(self, prompt, continuation, include_prompt=include_prompt)

    # ---- dumps, memory, lifetime ------------------------------------------------------------------------
    def dump(self, path, steps=None, *, logits_topk: int = 0):
        """Write ``steps`` (default: ``sess.history``) as a JSON dump (docs/dump-format.md); returns the path."""
        from .dump import dump_session
        return dump_session(self, path, steps, logits_topk=logits_topk)

    def memory(self):
        """Where the memory goes now: weights, KV cache (used / cached / free), buffers (MemoryReport)."""
        from .memory import memory_report
        return memory_report(self)

    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", False)

    @exclusive
    def close(self) -> None:
        """Free the model weights, KV cache and buffers; any later use raises "session is closed"."""
        from .session_close import close_session
        close_session(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- inspection -------------------------------------------------------------------------------------
    @property
    def state(self):
        """The read-only door into the live state (cache manager, K/V, ledger, requests, generators);
        see ``qwen_npu.session_state``."""
        from .session_state import SessionState
        return SessionState(self)

    def state_digest(self):
        """A fingerprint of everything a step may change (requests, block tables, free-queue order,
        prefix cache and its statistics, ledger, history, generators, buffer generations); equal
        digests before and after an interrupted cell prove it changed nothing. See ``StateDigest``."""
        self._engine.collect_dropped()
        return implementation("session.state_digest")(self)

    @property
    def buffers(self):
        """Read-only mapping name -> live tensor of the dispatch and output buffers."""
        import types
        return types.MappingProxyType(self._engine.buffers.tensors)

    @property
    def prefix_cache_stats(self):
        """Prefix-cache hits and misses (blocks and tokens) since creation or ``reset``; frozen."""
        return self._engine.manager.stats

    @property
    def blocks(self):
        """A snapshot of every KV block: state, ref count, holders, prefix hash, tokens held."""
        return implementation("session.blocks")(self)

    def snapshot(self):
        """A frozen copy of what the Session view shows (model, cache, requests, last step)."""
        return implementation("session.snapshot")(self)

    # ---- KV slots: view, invariant sweep, audit, fault emulation ------------------------------------------
    @property
    def kv(self):
        """The KV cache: live ``key(layer)``/``value(layer)``, ``read(request, position, layer)``, ``slot(s)``."""
        return implementation("session.kv")(self._engine, self.state.visible_requests())

    def check(self):
        """Sweep every cache invariant (blocks, tables, live slots, ledger collisions, non-finite K/V)."""
        self._engine.collect_dropped()
        return implementation("session.check")(self._engine, self._visible_requests(), list(self.history))

    def audit(self, request, *, tol: float | None = None):
        """Recompute ``request``'s K/V densely from its tokens and compare with its slots, per layer."""
        return implementation("session.audit")(self.kv, self.model, request, tol)

    @exclusive
    def emulate_faults(self, model: str | None):
        """Turn on an EMULATION of what racing writes to one slot may leave on hardware, or None for off.

        ``"zero_on_collision"`` / ``"nan_on_collision"``: after a step that wrote a slot from more than
        one row, that slot's K and V become 0 / NaN in every layer. On until changed; used in a ``with``
        block, the previous setting returns on exit. See ``qwen_npu.engine.faults``.
        """
        from .engine.faults import set_fault_model
        return set_fault_model(self._engine, model)

    @property
    def fault_model(self) -> str | None:
        """The EMULATED fault model in force, or None (the default)."""
        return self._engine.faults.model if self._engine.faults is not None else None

    # ---- research hooks (qwen_npu/research) ------------------------------------------------------------
    def capture_names(self) -> list[str]:
        """Every activation name ``capture`` and ``intervene`` accept, in forward order."""
        from .model.qwen3 import capture_names
        return capture_names(self.model_config.num_hidden_layers)

    def capture(self, names="*", *, requests=None, positions=None, reduce=None, offload=None, budget=None,
                on_step=None):
        """``with sess.capture(names) as cap:`` records activations (names or globs) of every step
        run inside the block, per step and request row. See ``qwen_npu.research.capture``."""
        return implementation("session.capture")(self, names, requests=requests, positions=positions, reduce=reduce, offload=offload,
                       budget=budget, on_step=on_step)

    def intervene(self, name, fn, *, requests=None, positions=None):
        """``with sess.intervene(name, fn):`` edits an activation of chosen rows in every step run
        inside the block. See ``qwen_npu.research.intervene``."""
        return implementation("session.intervene")(self, name, fn, requests=requests, positions=positions)

    def attention(self, request, layer: int, head=None, positions=None):
        """Softmax attention probabilities of ``request`` at ``layer`` over its cached keys.
        Changes nothing. See ``qwen_npu.research.attention``."""
        return implementation("session.attention")(self, request, layer, head, positions)

    @exclusive
    def fork(self, sampling=None) -> Session:
        """A new Session that branches from this one, sharing its KV blocks copy-on-write.
        See ``qwen_npu.session_fork``."""
        from .session_fork import fork_session
        return fork_session(self, sampling)

    def __repr__(self) -> str:
        if self.closed:
            return f"Session({self.path.name if self.path else 'model'}: closed)"
        return repr(self.snapshot())

    def _repr_html_(self) -> str:
        if self.closed:
            return implementation("closed_session_html")(self)
        return self.snapshot()._repr_html_()
