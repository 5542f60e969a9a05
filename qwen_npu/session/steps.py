"""The steps of a Session (mixed into ``Session``): which rows each kind of step takes.

``prefill``, ``decode_step`` and ``step`` say how their rows are scheduled; ``sample`` which
step it samples. Each then runs ``engine/step.py`` top to bottom, one transaction.
``generate`` and ``stream`` drive ``step`` until their requests finish.
"""
from __future__ import annotations

import collections

import torch

from ..engine import speculative
from ..engine.draft import StepDraft
from ..engine.plan import StepResult
from ..engine.request import DECODING, PREFILLING, WAITING, Completion, Request
from ..engine.step import Commit, check_not_pending, commit, run_step, sample_step
from ..engine.transaction import exclusive
from ..errors import InvalidRequestError, StaleOutputError
from ..text import chat


class SessionSteps:
    """``prefill``, ``decode_step``, ``sample``, ``step``: the Session's transactions."""

    @exclusive
    def prefill(self, requests=None) -> StepResult:
        """One prefill step over waiting/prefilling requests (default: all, in arrival order;
        a request named twice runs once)."""
        check_not_pending(self._last_step(), "prefill", self._requests)
        if requests is None:
            cands = [r for r in self._requests.values() if r.status in (WAITING, PREFILLING)]
        else:
            if isinstance(requests, (Request, int)):
                requests = [requests]
            picked = {}
            for r in requests:
                req = self.request(r.id if isinstance(r, Request) else r)
                picked.setdefault(req.id, req)
            cands = list(picked.values())
            bad = [r for r in cands if r.status not in (WAITING, PREFILLING)]
            if bad:
                raise InvalidRequestError(f"cannot prefill request {bad[0].id}: it is {bad[0].status}")

        def plan(draft):
            return "prefill", self._scheduler.prefill_rows(draft, list(self._requests.values()), cands)
        return self._transact(plan, "prefill", sample=False)

    @exclusive
    def decode_step(self) -> StepResult:
        """One runtime-batch decode step over every decoding request. The drafts ``propose()``
        staged are verified in it (kind "verify": each such row computes its last token and its
        drafts); ``sample()`` then keeps the accepted ones and rolls the rest back."""
        check_not_pending(self._last_step(), "decode", self._requests)
        if not any(r.status == DECODING for r in self._requests.values()):
            raise InvalidRequestError(self._nothing_to_run("decode"))

        def plan(draft):
            return step_kind(self._decode_rows(draft, fresh=False))
        return self._transact(plan, "decode", sample=False)

    def _decode_rows(self, draft, *, fresh: bool) -> list[tuple]:
        """Every decode row, with drafts when the session speculates (``fresh``: proposed now)."""
        rows = [(r, 1) for r in self._scheduler.decode_rows(draft, list(self._requests.values()))]
        return self._drafts(draft, rows, self.config.chunk_size - len(rows), fresh=fresh)

    def _drafts(self, draft, rows: list[tuple], budget: int, *, fresh: bool) -> list[tuple]:
        if self.config.speculative is None:
            return rows
        return speculative.attach_drafts(draft, rows, budget, self.config, fresh=fresh)

    def speculation_stats(self):
        """The speculation counts of this session's requests together (``SpecStats``: drafts
        verified and accepted, per draft position)."""
        return speculative.speculation_stats(self._requests.values())

    @exclusive
    def propose(self) -> dict[int, tuple[int, ...]]:
        """Stage the drafter's drafts on every decoding request (``speculative="ngram"``) and
        return them by request id; the next ``decode_step()`` verifies them. A transaction:
        drafts are request state (``draft_token_ids``), never computed tokens."""
        if self.config.speculative is None:
            raise InvalidRequestError("cannot propose: this session does not speculate; make it with "
                                      "Session.from_pretrained(..., speculative='ngram')")
        check_not_pending(self._last_step(), "propose", self._requests)
        decoding = [r for r in self._requests.values() if r.status == DECODING]
        if not decoding:
            raise InvalidRequestError(self._nothing_to_run("propose"))
        draft = StepDraft(self._engine.manager, self._requests)
        out = {}
        for r in decoding:
            d = draft.of(r)
            d.draft_token_ids = out[r.id] = speculative.propose(d, self.config)
        commit(self._engine, Commit(draft=draft, session=self))
        return out

    def _last_step(self) -> StepResult | None:
        return self.history[-1] if self.history else None

    def _transact(self, schedule, action: str, *, sample: bool, force=None) -> StepResult:
        return run_step(self, schedule, action, sample=sample, force=force)

    def _visible_requests(self) -> dict:
        branches = self._engine.branches
        return self._requests if branches is None else branches.requests()

    def _nothing_to_run(self, kind: str) -> str:
        by = collections.Counter(r.status for r in self._requests.values())
        state = ", ".join(f"{n} {s}" for s, n in by.items()) or "no requests"
        msg = f"nothing to {kind}: {state}" + ("; add a request first" if not by else "")
        if (by.get(WAITING) or by.get(DECODING) or by.get(PREFILLING)) and self._engine.branches is not None:
            from .fork import sibling_holders
            msg += sibling_holders(self)
        return msg

    @exclusive
    def sample(self, step: StepResult | None = None, *, force=None) -> torch.Tensor:
        """Sample one token per logits row of ``step`` (default: the last) on the device.

        ``force`` teacher-forces instead: a list with one token id per logits row, or a dict
        request id -> token id (rows not named are sampled as usual).
        """
        last = self._last_step()
        step = step if step is not None else last
        if step is None:
            raise InvalidRequestError("nothing to sample: no step has run yet")
        if step is not last:
            raise InvalidRequestError(f"cannot sample step {step.index}: only the last step "
                                      f"({last.index}) can be sampled")
        if step.token_ids is not None:
            raise InvalidRequestError(f"step {step.index} was already sampled")
        if step.logits is None:
            raise InvalidRequestError(f"step {step.index} produced no logits (no row finished its prompt)")
        if step.logits.is_stale:
            raise StaleOutputError(f"cannot sample step {step.index}: its logits were overwritten by a step "
                                   f"of another branch sharing this cache")
        if force is not None and step.plan.num_drafts:
            raise InvalidRequestError(f"cannot force step {step.index}: it verifies drafts of requests "
                                      f"{sorted(step.drafts)}; teacher-force a step without drafts")
        if force is not None:
            force = self._forced(step, force)
        return sample_step(self, step, force)

    def _forced(self, step: StepResult, force) -> dict[int, int]:
        ids = step.logits_request_ids
        if isinstance(force, dict):
            unknown = sorted(set(force) - set(ids))
            if unknown:
                raise InvalidRequestError(f"force names requests {unknown} that have no logits row in step {step.index}")
            out = {int(k): int(v) for k, v in force.items()}
        else:
            force = list(force)
            if len(force) != len(ids):
                raise InvalidRequestError(f"force has {len(force)} tokens but step {step.index} has {len(ids)} logits rows")
            out = {rid: int(t) for rid, t in zip(ids, force)}
        bad = {k: v for k, v in out.items() if not 0 <= v < self.model_config.vocab_size}
        if bad:
            raise InvalidRequestError(f"forced tokens outside the vocabulary: {bad}")
        return out

    @exclusive
    def step(self) -> StepResult:
        """Schedule, run and sample one step. Separate steps (the default): prefill when a prompt
        can make progress, else decode. With ``mixed_steps=True``: decode rows first, then prefill
        chunks in the rest of the token budget, in one forward (kind "mixed" when both are there).
        One transaction: forward and sampling commit together or not at all."""
        check_not_pending(self._last_step(), "step", self._requests)
        mixed = self.config.mixed_steps

        def plan(draft):
            cands = [r for r in self._requests.values() if r.status in (WAITING, PREFILLING)]
            if mixed:
                return step_kind(self._scheduler.mixed_rows(
                    draft, list(self._requests.values()), cands,
                    None if self.config.speculative is None else
                    lambda rows, budget: self._drafts(draft, rows, budget, fresh=True)))
            rows = self._scheduler.prefill_rows(draft, list(self._requests.values()), cands)
            if rows:
                return "prefill", rows
            return step_kind(self._decode_rows(draft, fresh=True))
        return self._transact(plan, "step", sample=True)

    @exclusive
    def generate(self, prompts, sampling=None, progress=None, *, enable_thinking: bool | None = None,
                 chat_template_kwargs: dict | None = None) -> list[Completion]:
        """Run ``prompts`` to completion with continuous batching; results in input order.

        Every prompt is checked before any is added; when the first step fails before it commits
        (refused, interrupted), the requests this call added are removed again, so the session
        is exactly as before the call."""
        chat_kwargs = chat.template_kwargs(enable_thinking, chat_template_kwargs)
        mark = (self._engine.next_request_id, self._seed_rng.getstate(), self._step_index)
        reqs = self._add_batch(prompts, sampling, "generate", chat_kwargs)
        from .progress import StepProgress
        bar = StepProgress(progress, reqs)           # prompt tokens prefilled + tokens generated
        try:
            while not all(r.is_done for r in reqs):
                try:
                    bar.update(self.step())
                except BaseException:
                    if self._step_index == mark[2]:      # no step committed: take the requests back
                        commit(self._engine, Commit(then=(lambda: self._take_back(reqs, mark),)), undo=True)
                    raise
        finally:
            bar.close()
        return [Completion.of(r) for r in reqs]

    def _take_back(self, reqs: list[Request], mark: tuple) -> None:
        """Plain assignments: forget ``reqs`` (added by a call whose first step failed)."""
        for r in reqs:
            self._requests.pop(r.id, None)
            self._generators.pop(r.id, None)
        self._engine.next_request_id = mark[0]
        self._seed_rng.setstate(mark[1])

    def _add_batch(self, prompts, sampling, action: str, chat_kwargs: dict) -> list[Request]:
        """Validate every prompt first, then add them all (one prompt or a list or tuple of them;
        one sampling or one each)."""
        single = isinstance(prompts, (str, bytes, bytearray, torch.Tensor)) or chat.is_messages(prompts)
        if not single and not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"{action}: prompts must be one prompt (a str, chat messages, a list of "
                                      f"int token ids) or a list of them, not {type(prompts).__name__}")
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


def step_kind(rows: list[tuple]) -> tuple[str, list[tuple]]:
    """(kind, rows) for the rows of a mixed plan: "mixed" when decoding and prefilling rows share
    the step, else the one kind they all have ("verify" for decode rows of which some carry drafts)."""
    decoding = sum(r.status == DECODING for r, _ in rows)
    kind = "decode" if decoding == len(rows) else "prefill" if decoding == 0 else "mixed"
    if kind == "decode" and any(n > 1 for _, n in rows):
        kind = "verify"
    return kind, rows

