"""Every state-changing Session call is a transaction: its changes are staged on a draft, Ctrl-C
lands only where it is safe, and the K/V that committed state points to is given back if the
call fails.

    call ──> gate: one thread at a time (``session/steps.py``: ``exclusive``, ``CallGate``)
             Ctrl-C held back for the whole call ──────────────────────────────────┐
               plan, check on a StepDraft (live state untouched)                   │
               forward ── the one place Ctrl-C lands at once (``interruptible``) ──┤
               book, sample (on the draft)       any way out: KVGuard.restore()    │
               commit: StepDraft.apply (plain assignments)                         │
             held-back Ctrl-C raised once the call is over, the state whole <──────┘

How Ctrl-C is held back and where it lands: ``interrupts.py``.

The draft: ``RequestDraft`` stands in for a ``Request`` while a step is planned and booked. It
holds the request's fields that never change (id, prompt, sampling), its own copy of every
field a step changes (status, token counts, stop state) and, for the output tokens and their
log-probabilities, the entries the step adds (the commit appends them to the request's lists).
``StepDraft`` holds the drafts, a clone of the cache manager and copies of the random generators
a step draws from. Nothing live changes until ``apply``, which only assigns: it cannot fail half
way.

``fault_point(name)`` marks places a test may raise at (``inject_faults``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from . import sampler
from .request import (ABORTED, DECODING, FINISHED, FIXED_FIELDS, GROWING_FIELDS, PREFILLING, STEP_FIELDS, WAITING,
                      Request)

_injector: Callable[[str], None] | None = None


def fault_point(name: str) -> None:
    """A named point between the phases of a call (for fault-injection tests)."""
    if _injector is not None:
        _injector(name)


@contextlib.contextmanager
def inject_faults(fn: Callable[[str], None]):
    """Call ``fn(point name)`` at every ``fault_point`` while the block runs; ``fn`` may raise."""
    global _injector
    previous, _injector = _injector, fn
    try:
        yield
    finally:
        _injector = previous


class TokenIds(Sequence):
    """Two sequences of tokens read in place as one: a request draft's ``prompt + output`` (the
    same ints as ``all_token_ids``), and its output, the request's tokens and those the step
    staged after them. Nothing is copied, so a step reading a few of a request's tokens costs the
    same at any context length. A view of the two as they are when it is made (use it at once)."""

    __slots__ = ("_prompt", "_output")

    def __init__(self, prompt: Sequence[int], output: Sequence[int]):
        self._prompt, self._output = prompt, output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    def __getitem__(self, i):
        n = len(self._prompt)
        if not isinstance(i, slice):                  # one token: the common case, tested first
            if i < 0:
                i += len(self)
            if 0 <= i < n:
                return self._prompt[i]
            if 0 <= i - n < len(self._output):
                return self._output[i - n]
            raise IndexError(f"token {i} of {len(self)}")
        start, stop, stride = i.indices(len(self))
        if stride != 1:
            return [self[j] for j in range(start, stop, stride)]
        if stop <= n:
            return self._prompt[start:stop]
        if start >= n:
            return self._output[start - n:stop - n]
        return self._prompt[start:] + self._output[:stop - n]


class RequestDraft:
    """A request as a step in progress sees it (see the module docstring). Its fields are exactly
    ``Request.STEP_FIELDS`` (staged here, written back by ``StepDraft.apply``) and
    ``Request.FIXED_FIELDS`` (the request's, which no step changes); any other name is an
    AttributeError, so a field a draft does not know cannot be read silently from the live
    request.

    The two growing lists, ``output_token_ids`` and ``logprobs``, are staged as what the step
    adds: the draft reads the request's list and its own new entries as one sequence and never
    changes the request's list; ``write_back`` appends the new entries to it. So staging a token
    costs the same at any output length, and a step kept in the history holds no copy of any
    request's tokens."""

    __slots__ = ("request", "_new_tokens", "_new_logprobs") + FIXED_FIELDS + tuple(
        name for name in STEP_FIELDS if name not in GROWING_FIELDS)

    def __init__(self, req: Request):
        # every name of FIXED_FIELDS + STEP_FIELDS, written out: a loop of getattr/setattr costs
        # four times as much, once per request per step (a field left out reads as AttributeError)
        self.request = req
        self.id, self.prompt_token_ids, self.sampling = req.id, req.prompt_token_ids, req.sampling
        self.stop_token_ids, self.prompt_text = req.stop_token_ids, req.prompt_text
        self.status, self.num_computed_tokens = req.status, req.num_computed_tokens
        self.num_cached_tokens, self.num_preemptions = req.num_cached_tokens, req.num_preemptions
        self.finish_reason, self.stop_reason = req.finish_reason, req.stop_reason
        self.stop_strings, self.draft_token_ids, self.spec_stats = req.stop_strings, req.draft_token_ids, req.spec_stats
        self._new_tokens: list[int] = []           # the output tokens staged by this step
        self._new_logprobs: list = []              # and their log-probabilities (when recorded)

    def write_back(self) -> None:
        """Assign every other field of STEP_FIELDS to the request and append the staged tokens and
        log-probabilities to its lists (assignments and appends of a few items: cannot fail); the
        draft then has nothing staged."""
        req = self.request
        req.status, req.num_computed_tokens = self.status, self.num_computed_tokens
        req.num_cached_tokens, req.num_preemptions = self.num_cached_tokens, self.num_preemptions
        req.finish_reason, req.stop_reason = self.finish_reason, self.stop_reason
        req.stop_strings, req.draft_token_ids, req.spec_stats = self.stop_strings, self.draft_token_ids, self.spec_stats
        if self._new_tokens:
            req.output_token_ids.extend(self._new_tokens)
            if req.logprobs is not None:
                req.logprobs.extend(self._new_logprobs)
            self._new_tokens, self._new_logprobs = [], []

    @property
    def output_token_ids(self) -> Sequence[int]:
        """The request's output tokens, then those this step staged (read in place)."""
        live = self.request.output_token_ids
        return TokenIds(live, self._new_tokens) if self._new_tokens else live

    @property
    def logprobs(self) -> list | None:
        """The request's log-probabilities, then those this step staged (a new list; None when the
        request records none)."""
        live = self.request.logprobs
        return None if live is None else live + self._new_logprobs

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.request.output_token_ids + self._new_tokens

    @property
    def token_ids(self) -> TokenIds:
        return TokenIds(self.prompt_token_ids, self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.request.output_token_ids) + len(self._new_tokens)

    def token(self, i: int) -> int:
        """Token ``i`` of ``token_ids`` (0 <= i < num_tokens), read without making a view."""
        prompt = self.prompt_token_ids
        return prompt[i] if i < len(prompt) else self.output_token_ids[i - len(prompt)]

    @property
    def num_output_tokens(self) -> int:
        return len(self.request.output_token_ids) + len(self._new_tokens)

    @property
    def is_done(self) -> bool:
        return self.status in DONE

    def append_token(self, token: int, logprob=None) -> None:
        """Stage one sampled token (with its log-probability, when the request records them)."""
        if self.stop_strings is not None and self.stop_strings is self.request.stop_strings:
            self.stop_strings = self.stop_strings.copy()       # the step's own, before its first token
        self._new_tokens.append(token)
        if logprob is not None and self.request.logprobs is not None:
            self._new_logprobs.append(logprob)

    def __repr__(self) -> str:
        return f"RequestDraft({self.request.id}, {self.status}, computed {self.num_computed_tokens})"


class StepDraft:
    """The staged changes of one step: request drafts, a manager clone, generator copies."""

    def __init__(self, manager, requests: dict[int, Request], hooks=None):
        self.live_manager = manager
        self.hooks = hooks               # the engine's step hooks, which may cap prefix-cache reuse
        self._manager = None             # cloned on first use: a step that touches no block copies nothing
        self.requests = requests
        self.drafts: dict[int, RequestDraft] = {}
        self.generators: dict[int, torch.Generator] = {}     # copies that replace the live ones

    @property
    def manager(self):
        """The step's clone of the cache manager (made on first use)."""
        if self._manager is None:
            self._manager = self.live_manager.clone()
        return self._manager

    def prefix_limit(self, request_id: int) -> int | None:
        """The most leading tokens a request admitted now may take from the prefix cache (None:
        no cap; the open captures and interventions set one, so their positions are recomputed)."""
        return self.hooks.prefix_limit(request_id) if self.hooks is not None else None

    def of(self, req) -> RequestDraft:
        if isinstance(req, RequestDraft):
            return req
        d = self.drafts.get(req.id)
        if d is None:
            d = self.drafts[req.id] = RequestDraft(req)
        return d

    def all(self, reqs) -> list[RequestDraft]:
        """Drafts of the requests that are not done (a finished or aborted request never changes)."""
        out, drafts = [], self.drafts
        for r in reqs:
            d = r if isinstance(r, RequestDraft) else drafts.get(r.id)
            if d is None:
                if r.status in DONE:
                    continue
                d = self.of(r)
            if d.status not in DONE:
                out.append(d)
        return out

    def generator(self, rid: int, live: dict[int, torch.Generator]) -> torch.Generator | None:
        """A private copy of request ``rid``'s generator (None for a greedy request)."""
        g = self.generators.get(rid)
        if g is None and rid in live:
            g = self.generators[rid] = sampler.copy_generator(live[rid])
        return g

    def stage_token(self, d: RequestDraft, token: int, logprob=None) -> None:
        """Stage one sampled token and finish the request when it stops it (``stopping.py``): past
        ``min_new_tokens``, a stop token id or a completed stop string gives ``"stop"`` (with the
        token or string as ``stop_reason``); else reaching ``max_new_tokens`` gives ``"length"``."""
        d.append_token(token, logprob)
        d.status = DECODING
        if d.draft_token_ids:             # drafts are proposed for the tokens as they were
            d.draft_token_ids = ()
        n = d.num_output_tokens
        may_stop = n > d.sampling.min_new_tokens
        hit = d.stop_strings.push(token, search=may_stop) if d.stop_strings is not None else None
        if may_stop and (token in d.stop_token_ids or hit is not None):
            d.stop_reason = token if token in d.stop_token_ids else hit
            self.finish(d, "stop")
        elif n >= d.sampling.max_new_tokens:
            self.finish(d, "length")

    def finish(self, d: RequestDraft, reason: str, status: str = FINISHED) -> None:
        d.status, d.finish_reason = status, reason
        if self.manager.has(d.id):
            self.manager.free(d.id)

    def apply(self, generators: dict[int, torch.Generator]) -> None:
        """Publish every staged change: plain assignments only (no call here can raise)."""
        if self._manager is not None:
            self.live_manager.adopt(self._manager)
        for d in self.drafts.values():
            d.write_back()
        generators.update(self.generators)


def preempt(draft: StepDraft, d: RequestDraft) -> None:
    """Stage a preemption: the request's blocks go back, it waits to be recomputed."""
    draft.manager.free(d.id)
    d.num_computed_tokens = 0
    d.draft_token_ids = ()
    d.status = WAITING
    d.num_preemptions += 1


RUNNING = (PREFILLING, DECODING)
DONE = (FINISHED, ABORTED)


class KVGuard:
    """A copy of the K/V of blocks a call overwrites although committed state points to them.

    Planning may hand a step blocks that the live state still uses: a cached prefix block it
    evicts, or a block of a request it preempts. If the step then fails, those blocks go back to
    their owners, so their K/V must be as it was; ``restore`` copies it back.
    """

    def __init__(self, kv_cache, blocks: Sequence[int], staging=None):
        """``staging``: the step's ``PinnedCopies`` the block index reaches the device through (on
        an accelerator, ``pinned.py``; a plain ``.to`` without one)."""
        self.kv_cache = kv_cache
        self.blocks = list(blocks)
        self.saved = None
        if self.blocks:
            index = torch.tensor(self.blocks, dtype=torch.int64)
            if staging is None:
                index = index.to(kv_cache.keys[0].device)
            else:
                with staging.writing():
                    index = staging.put(index, "guard")
            self.index = index
            self.saved = [t.index_select(0, index) for t in kv_cache.keys + kv_cache.values]

    def restore(self) -> None:
        if self.saved is None:
            return
        for t, s in zip(self.kv_cache.keys + self.kv_cache.values, self.saved):
            t.index_copy_(0, self.index, s)
