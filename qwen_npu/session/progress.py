"""Progress bars (``tqdm.auto``: a widget in notebooks, text elsewhere) for runs of many steps.

A ``generate`` run moves through prompt tokens first (prefill chunks) and output tokens after, so
its bar counts both::

    total    = sum over requests of (prompt tokens + max_new_tokens)
    progress = prompt tokens computed (or taken from the prefix cache) + tokens generated

A long prompt therefore moves the bar chunk by chunk instead of freezing it until its first
token. The count never goes backwards (a preempted request recomputes its prompt unseen), and a
request that stops early simply leaves the bar short of its total. ``progress=False`` turns it off.
"""
from __future__ import annotations


class StepProgress:
    """One bar over ``requests``; call ``update(step)`` after every step and ``close()`` at the end."""

    def __init__(self, progress, requests, *, desc: str = "generate"):
        self.requests = list(requests)
        self.done = 0
        self.bar = None
        if progress is False:
            return
        from tqdm.auto import tqdm
        total = sum(len(r.prompt_token_ids) + r.sampling.max_new_tokens for r in self.requests)
        self.bar = tqdm(total=total, unit="tok", desc=desc, leave=False)

    def tokens_done(self) -> int:
        return sum(min(r.num_computed_tokens, len(r.prompt_token_ids)) + len(r.output_token_ids)
                   for r in self.requests)

    def update(self, step=None) -> None:
        if self.bar is None:
            return
        now = self.tokens_done()
        if step is not None:
            self.bar.set_postfix_str(f"step {step.index} {step.kind}", refresh=False)
        if now > self.done:
            self.bar.update(now - self.done)
            self.done = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
