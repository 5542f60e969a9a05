"""Running prompts to completion (mixed into ``Session``): ``generate`` and ``stream`` drive
``step()`` until their requests finish; a call whose first step fails takes its requests back.
"""
from __future__ import annotations

import torch

from ..engine.request import Completion, Request
from ..engine.step import Commit, check_not_pending, commit
from ..errors import InvalidRequestError
from ..text import chat
from .steps import exclusive


class SessionGenerate:
    """``generate`` and ``stream``: whole requests, step after step."""

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
