"""What every entry of a HookSet (a Capture, an Intervention) offers the step hook.

The HookSet calls these on every entry, in this order for one step::

    check_step(plan)          may refuse the step (raise); nothing has run yet
    begin_step(plan)          reset what the entry stages for the step
    on_tensor(...)            at each hook point the entry names (``names``), per call of the forward
    private_requests()        read while the step is booked (before its commit)
    commit_step(index)        inside the commit: plain assignments only, never raises
    after_commit()            after the commit, the state whole: user code may run (and raise)

A step that fails before its commit reaches neither ``commit_step`` nor ``after_commit``; the next
``begin_step`` drops what it staged. The defaults here do nothing, so an entry defines only what
it uses.
"""
from __future__ import annotations

import torch


class HookEntry:
    """Base of the entries a HookSet runs; subclasses set ``names`` and ``is_capture``."""

    names: tuple[str, ...] = ()
    is_capture = False               # captures run after interventions at a hook point

    def check_step(self, plan) -> None:
        """Refuse ``plan`` (raise) before it runs; the default accepts every step."""

    def begin_step(self, plan) -> None:
        """A new step begins: forget what a step that did not commit staged."""

    def on_tensor(self, plan, name: str, x: torch.Tensor, spans) -> torch.Tensor | None:
        """The tensor at ``name`` for the call's row ``spans``: a replacement, or None to keep it."""
        return None

    def private_requests(self) -> dict[int, str]:
        """Requests this step computed under an edit (id -> why); their blocks stay private."""
        return {}

    def commit_step(self, index: int) -> None:
        """Step ``index`` committed: publish what was staged (plain assignments only)."""

    def after_commit(self) -> None:
        """After the commit, with the state whole: hand over what the step produced."""

    def prefix_limit(self, request_id: int) -> int | None:
        """The most leading tokens a request admitted now may take from the prefix cache (None: any)."""
        return None
