"""Speculative decoding with an n-gram drafter: proposals from a request's own tokens.

    propose        the drafts of a decoding request: the tokens that followed the latest earlier
                   occurrence of its last n tokens (n = NGRAM_MAX down to NGRAM_MIN), at most k
    attach_drafts  a step's decode rows grow from 1 token to 1 + drafts (the verification row)
    verify.py      the step's sampling tests each draft, keeps the accepted prefix and gives the
                   slots of the rest back

A verification row of a request with ``num_tokens = t`` and drafts ``d1..dk`` computes positions
``t-1 .. t-1+k`` (its last token, then the drafts) in one forward, with logits at every position::

    tokens   ... x   | d1  d2  d3          block_size 4, t = 6, k = 3
    position     5   |  6   7   8          the table grows to cover position 8 (3 blocks)
    logits       y5     y6  y7  y8         y5 tests d1, y6 tests d2, y7 tests d3; y8 is a bonus

Invariants a verification keeps (``verify.py`` does the rest):

* Drafts are never computed tokens: the verification step books the row as a plain decode row
  (``num_computed_tokens = t``), so no prefix hash ever covers a draft, ``is_live`` never sees a
  draft's slot as live, and ``check()`` holds between the verification step and its sample.
* A draft never preempts anyone and never takes the token budget from a decode row: drafts are
  attached after every decode row has its block, within what is left of ``chunk_size``, and
  dropped (the row decodes one token) when their blocks cannot be allocated.
* A request speculates only while nothing per-token steers its next tokens' sampling: no
  ``logprobs``, ``min_new_tokens`` already reached; and never past ``max_new_tokens`` or the
  model's length (every draft plus the bonus token fits).
"""
from __future__ import annotations

import dataclasses

DRAFTERS = ("ngram",)
NGRAM_MAX = 3          # the longest suffix matched
NGRAM_MIN = 1          # the shortest


@dataclasses.dataclass(frozen=True)
class SpecStats:
    """A request's speculation counts, per draft position: ``drafted[i]`` verifications that
    carried a draft at position i, ``accepted[i]`` of them that kept it."""

    drafted: tuple[int, ...] = ()
    accepted: tuple[int, ...] = ()

    @property
    def num_drafts(self) -> int:
        return sum(self.drafted)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens; 0.0 before any draft."""
        return self.num_accepted / self.num_drafts if self.num_drafts else 0.0

    @property
    def rate_by_position(self) -> tuple[float, ...]:
        """Per draft position: the share of drafts there that were accepted."""
        return tuple(a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted))

    def add(self, drafted: int, accepted: int) -> SpecStats:
        """These counts after one verification of ``drafted`` drafts keeping ``accepted``."""
        width = max(len(self.drafted), drafted)
        d = [x + (i < drafted) for i, x in enumerate(self.drafted + (0,) * (width - len(self.drafted)))]
        a = [x + (i < accepted) for i, x in enumerate(self.accepted + (0,) * (width - len(self.accepted)))]
        return SpecStats(tuple(d), tuple(a))

    def __add__(self, other: SpecStats) -> SpecStats:
        width = max(len(self.drafted), len(other.drafted))

        def pad(t):
            return t + (0,) * (width - len(t))
        return SpecStats(tuple(map(sum, zip(pad(self.drafted), pad(other.drafted)))),
                         tuple(map(sum, zip(pad(self.accepted), pad(other.accepted)))))

    def __repr__(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.rate_by_position)
        return (f"SpecStats({self.num_accepted} of {self.num_drafts} drafts accepted "
                f"({self.acceptance_rate:.0%}); by position [{rates}])")


def propose_ngram(tokens: list[int], k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> tuple[int, ...]:
    """Up to ``k`` tokens that followed an earlier occurrence of the last ``n`` tokens of
    ``tokens``, for the longest ``n`` in ``n_max..n_min`` that occurs; () when none does. Of the
    occurrences, the latest followed by ``k`` tokens wins, else the latest (a shorter proposal)."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = tokens[size - n:]
        first = tail[0]
        full = max(-1, size - n - k)                       # starts followed by k known tokens: 0..full
        for start in [*range(full, -1, -1), *range(size - n - 1, full, -1)]:
            if tokens[start] == first and tokens[start:start + n] == tail:
                return tuple(tokens[start + n:start + n + k])
    return ()


def room(req, k: int, max_model_len: int) -> int:
    """How many drafts ``req`` may carry now (0: it decodes one token; see the module doc)."""
    s = req.sampling
    if s.logprobs is not None or len(req.output_token_ids) < s.min_new_tokens:
        return 0
    return max(0, min(k, s.max_new_tokens - len(req.output_token_ids) - 1, max_model_len - req.num_tokens))


def propose(req, config) -> tuple[int, ...]:
    """The drafts the session's drafter proposes for ``req`` (a decoding request or its draft)."""
    n = room(req, config.num_speculative_tokens, config.max_model_len)
    return propose_ngram(req.all_token_ids, n) if n else ()


def attach_drafts(draft, rows: list[tuple], budget: int, config, *, fresh: bool) -> list[tuple]:
    """``rows`` [(request draft, 1)] of decode rows -> [(request draft, 1 + drafts)].

    ``fresh``: propose now (``step``); else verify what ``propose()`` staged (``decode_step``).
    ``budget``: the tokens the step has left for drafts. Blocks for the drafts are allocated on
    the step's manager clone; a row whose drafts do not fit carries none. Each row's request draft
    holds exactly the drafts its row verifies (``draft_token_ids``)."""
    out = []
    for req, n in rows:
        d = draft.of(req)
        want = propose(d, config) if fresh else d.draft_token_ids[:room(d, config.num_speculative_tokens,
                                                                         config.max_model_len)]
        want = tuple(want[:max(0, budget)])
        if want and not draft.manager.allocate(d.id, d.num_tokens + len(want)):
            want = ()
        if want != d.draft_token_ids:
            d.draft_token_ids = want
        budget -= len(want)
        out.append((d, n + len(want)))
    return out


def speculation_stats(requests) -> SpecStats:
    """The counts of ``requests`` together."""
    total = SpecStats()
    for r in requests:
        total = total + r.spec_stats
    return total
