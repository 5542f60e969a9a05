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

from ..config import ModelConfig, SessionConfig
from ..engine import sampler
from ..engine.admission import prepare_request
from ..engine.engine import Engine
from ..engine.plan import StepResult
from ..engine.request import ABORTED, Request, SamplingParams
from ..engine.scheduler import Scheduler
from ..engine.step import Commit, commit
from ..errors import InvalidRequestError
from ..model.hub import checkpoint_folder
from ..model.qwen3 import Qwen3Model
from ..text import chat
from ..text.tokenizer import Tokenizer
from .loading import load_session
from .options import SessionOptions
from .generate import SessionGenerate
from .steps import CallGate, SessionSteps, exclusive

HISTORY = 256


class Session(SessionSteps, SessionGenerate):
    """One model, its paged KV cache and its requests. Create with ``Session.from_pretrained``."""

    def __init__(self, model: Qwen3Model, config: SessionConfig, *, path: Path | None = None,
                 tokenizer: Tokenizer | None = None, engine: Engine | None = None, parallel=None):
        self.config = config
        self.model_config: ModelConfig = model.full_config      # the checkpoint's shape, on any rank count
        self.path = path
        self.tokenizer = tokenizer
        self.model = model
        self._owns_engine = engine is None
        self._engine = engine if engine is not None else Engine(model, config, CallGate(), parallel)   # forks share it
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
    @SessionOptions.keywords
    def from_pretrained(cls, path, **options) -> Session:
        """Load a Qwen3 checkpoint into a new Session: a folder, or a Hugging Face repo id found in
        the user's Hugging Face cache (downloaded only where missing and the hub is online;
        ``revision`` pins a branch, tag or commit). Every option is checked before anything is
        read (``InvalidRequestError``; an unknown keyword: ``UnknownOptionError``)."""
        opts = SessionOptions.from_kwargs(options)
        path = checkpoint_folder(path, opts.revision)
        model, config, tokenizer, parallel = load_session(path, opts)
        try:
            return cls(model, config, path=path, tokenizer=tokenizer, parallel=parallel)
        except BaseException:
            if parallel is not None:       # the other ranks' processes go with the Session that failed
                parallel.close()
            raise

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
        rid = self._engine.next_request_id
        req = self._new_request(rid, ids, text, sampling)
        seeds = random.Random()
        seeds.setstate(self._seed_rng.getstate())        # drawn from a copy: the commit keeps it
        seed = sampling.seed
        if seed is None and draw_seed:
            seed = seeds.getrandbits(63)
        gen = None if sampling.greedy else sampler.new_generator(self.model.device, seed or 0)
        commit(self._engine, Commit(session=self, requests={rid: req}, generators={rid: gen} if gen else None,
                                    seed_rng=seeds, next_request_id=rid + 1))
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
        req = self.request(req.id if isinstance(req, Request) else req)
        if req.is_done:
            raise InvalidRequestError(f"request {req.id} already {req.status}")
        self._engine.finish(req, "abort", ABORTED)

    @exclusive
    def reset(self) -> None:
        """Forget every request and step; empty the cache (back to the state after loading).
        A forked Session (sharing its cache) only aborts its own requests and forgets its steps."""
        if self._engine.branches is not None:
            from .fork import reset_branch
            if reset_branch(self):
                return
        commit(self._engine, Commit(then=(self._engine.reset, self._init_state)))

    # ---- steps ----------------------------------------------------------------------------------------
    @property
    def last_step(self) -> StepResult | None:
        return self.history[-1] if self.history else None

    @exclusive
    def score(self, prompt, continuation, *, include_prompt: bool = False):
        """Teacher-force ``continuation`` after ``prompt``; per-token log-probabilities (ScoreResult)."""
        from .scoring import score
        return score(self, prompt, continuation, include_prompt=include_prompt)

    # ---- dumps, memory, lifetime ------------------------------------------------------------------------
    def dump(self, path, steps=None, *, logits_topk: int = 0):
        """Write ``steps`` (default: ``sess.history``) as a JSON dump (docs/dump-format.md); returns the path."""
        from ..dump import dump_session
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
        from .close import close_session
        close_session(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- inspection -------------------------------------------------------------------------------------
    @property
    def state(self):
        """The read-only door into the live state (cache manager, K/V, ledger, requests, generators);
        see ``qwen_npu.session.state``."""
        from .state import SessionState
        return SessionState(self)

    @exclusive(changes_state=False)
    def state_digest(self, *, kv: bool = False):
        """A fingerprint of everything a step may change (requests, block tables, free-queue order,
        prefix cache and its statistics, ledger, history, generators, buffer generations); equal
        digests before and after an interrupted cell prove it changed nothing. ``kv=True`` adds
        the bytes of the K/V that committed state points to (one copy of those slots). See
        ``StateDigest``."""
        from ..inspect.digest import state_digest
        return state_digest(self, kv)

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
        from ..inspect.blocks import take_session_blocks
        return take_session_blocks(self)

    def snapshot(self):
        """A frozen copy of what the Session view shows (model, cache, requests, last step)."""
        from ..inspect.snapshot import take_session
        return take_session(self)

    # ---- KV slots: view, invariant sweep, audit, fault emulation ------------------------------------------
    @property
    def kv(self):
        """The KV cache: live ``key(layer)``/``value(layer)``, ``read(request, position, layer)``, ``slot(s)``."""
        from ..inspect.kv import KVView
        return KVView(self._engine, self.state.visible_requests())

    @exclusive(changes_state=False)
    def check(self):
        """Sweep every cache invariant (blocks, tables, live slots, ledger collisions, non-finite K/V)."""
        from ..inspect.check import check_session
        return check_session(self._engine, self._visible_requests(), list(self.history))

    def audit(self, request, *, tol: float | None = None):
        """Recompute ``request``'s K/V densely from its tokens and compare with its slots, per layer."""
        from ..inspect.audit import audit_request
        return audit_request(self.kv, self.model, request, tol)

    @exclusive
    def emulate_faults(self, model: str | None):
        """Turn on an EMULATION of what racing writes to one slot may leave on hardware, or None for off.

        ``"zero_on_collision"`` / ``"nan_on_collision"``: after a step that wrote a slot from more than
        one row, that slot's K and V become 0 / NaN in every layer. On until changed; used in a ``with``
        block, the previous setting returns on exit. See ``qwen_npu.engine.faults``.
        """
        from ..engine.faults import set_fault_model
        return set_fault_model(self._engine, model)

    @property
    def fault_model(self) -> str | None:
        """The EMULATED fault model in force, or None (the default)."""
        return self._engine.faults.model if self._engine.faults is not None else None

    # ---- research hooks (qwen_npu/research) ------------------------------------------------------------
    def capture_names(self) -> list[str]:
        """Every activation name ``capture`` and ``intervene`` accept, in forward order."""
        from ..model.hooks import capture_names
        return capture_names(self.model_config.num_hidden_layers)

    def capture(self, names="*", *, requests=None, positions=None, reduce=None, offload=None, budget=None,
                on_step=None):
        """``with sess.capture(names) as cap:`` records activations (names or globs) of every step
        run inside the block, per step and request row. See ``qwen_npu.research.capture``."""
        from ..research.capture import Capture
        return Capture(self, names, requests=requests, positions=positions, reduce=reduce, offload=offload,
                       budget=budget, on_step=on_step)

    def intervene(self, name, fn, *, requests=None, positions=None):
        """``with sess.intervene(name, fn):`` edits an activation of chosen rows in every step run
        inside the block. See ``qwen_npu.research.intervene``."""
        from ..research.intervene import Intervention
        return Intervention(self, name, fn, requests=requests, positions=positions)

    def attention(self, request, layer: int, head=None, positions=None):
        """Softmax attention probabilities of ``request`` at ``layer`` over its cached keys.
        Changes nothing. See ``qwen_npu.research.attention``."""
        from ..research.attention import attention_pattern
        return attention_pattern(self, request, layer, head, positions)

    @exclusive(returns_handle=True)
    def fork(self, sampling=None) -> Session:
        """A new Session that branches from this one, sharing its KV blocks copy-on-write.
        See ``qwen_npu.session.fork``."""
        from .fork import fork_session
        return fork_session(self, sampling)

    def __repr__(self) -> str:
        if self.closed:
            return f"Session({self.path.name if self.path else 'model'}: closed)"
        return repr(self.snapshot())

    def _repr_html_(self) -> str:
        if self.closed:
            from ..inspect.views import closed_session_html
            return closed_session_html(self)
        return self.snapshot()._repr_html_()
