"""When a request stops: stop token ids, stop strings and ``min_new_tokens``.

Rules, for the n-th generated token (n counts from 1):

* While ``n <= min_new_tokens`` nothing stops the request: the sampler masks its stop token ids
  (eos included) to -inf on the device before picking, and a teacher-forced stop token or a stop
  string completed by such a token is not a stop.
* Otherwise a stop token id finishes it with ``finish_reason="stop"`` and ``stop_reason`` = the
  token id (the token stays in ``output_token_ids``); a stop string completed by the token
  finishes it with ``finish_reason="stop"`` and ``stop_reason`` = the string. The text is cut
  before the stop string; the token ids that spelled it stay in ``output_token_ids`` (they were
  sampled and their K/V computed).
* Else reaching ``max_new_tokens`` finishes it with ``finish_reason="length"``.

The rules are applied as a step stages each sampled token (``StepDraft.stage_token``); the
``min_new_tokens`` mask is the sampler's (``sampler.mask_early_stops``). Stop strings are matched
on the decoded output text (special tokens skipped), so they may span
several tokens; among several matches the one that starts first wins (then the earlier listed).
"""
from __future__ import annotations

from collections.abc import Callable

from .detokenizer import IncrementalDetokenizer


class StopStrings:
    """Watches a request's output text for its stop strings as tokens arrive."""

    def __init__(self, stops: tuple[str, ...], decode: Callable[[list[int]], str]):
        """``decode``: the checkpoint tokenizer's bound ``decode`` (or the tokenizer itself)."""
        self.stops = stops
        self.text = IncrementalDetokenizer(decode)
        self.cut: int | None = None        # the output text ends here once a stop string matched
        self.matched: str | None = None
        self._overlap = max(len(s) for s in stops) - 1

    def copy(self) -> StopStrings:
        """An independent copy (a step stages its tokens on one)."""
        new = object.__new__(StopStrings)
        new.stops, new.text, new.cut, new.matched = self.stops, self.text.copy(), self.cut, self.matched
        new._overlap = self._overlap
        return new

    def push(self, token: int, *, search: bool = True) -> str | None:
        """Add one token; returns the stop string it completed (when ``search``), else None."""
        before = len(self.text.text)
        if not self.text.push([token]) or not search:
            return None
        text, lo = self.text.text, max(0, before - self._overlap)
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = text.find(s, lo)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.cut, self.matched = best
        return self.matched
