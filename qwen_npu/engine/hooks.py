"""What the engine asks of the step hooks it runs (``Engine.hook``; ``qwen_npu.research.hooks.HookSet``).

One step, and where each call falls in its transaction::

    plan ─ validate ─ begin_step(plan) -> StepHook ─ forward(hook=StepHook) ─ book
                        (may refuse the step;       StepHook.private_requests()
                         nothing has run yet)       (read while booking the draft)
         ─ commit: ... commit_step(step_index) ... ─ after_commit() ─ warnings

``commit_step`` runs inside the commit, with Ctrl-C held back: plain assignments only, never
user code, never an exception. ``after_commit`` runs once the commit is whole; user callbacks
run there, and an exception from it reports a step that has committed. A step that fails or is
interrupted before its commit reaches neither, so what ``begin_step`` and the forward staged is
dropped with the step.
"""
from __future__ import annotations

from typing import Protocol

from ..model.hooks import ForwardHook


class StepHook(ForwardHook, Protocol):
    """The forward hook of one step."""

    def private_requests(self) -> dict[int, str]:
        """Requests whose K/V this step computed under an edit (id -> why): the step books them
        as private on its draft, so their blocks are never published to the prefix cache."""


class StepHooks(Protocol):
    """The engine's hook across steps (see the module docstring for when each is called)."""

    def begin_step(self, plan) -> StepHook:
        """The forward hook of the step ``plan``; may refuse the step (raise) before it runs."""

    def commit_step(self, step_index: int) -> None:
        """The step committed: publish what it staged, with plain assignments only."""

    def after_commit(self) -> None:
        """After the commit, the state whole: hand over what the step produced (user code)."""

    def prefix_limit(self, request_id: int) -> int | None:
        """The most leading tokens a request admitted now may take from the prefix cache, or None
        for no limit."""
