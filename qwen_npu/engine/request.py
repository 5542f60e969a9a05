"""Requests, their sampling parameters, and finished completions.

A request's life::

    waiting ──admit──> prefilling ──last prompt chunk sampled──> decoding ──stop──> finished
       ^                   │                                        │
       └──── preempted ────┴────────────────────────────────────────┘          (any) ──> aborted

Its tokens are ``prompt_token_ids + output_token_ids``; ``num_computed_tokens`` of them have
K/V in the cache. It needs a step while ``num_computed_tokens < num_tokens``: a prefill step
while more than the last sampled token is missing, a decode step when exactly that one is.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable

from ..errors import InvalidRequestError
from .logprobs import TokenLogprob
from .speculative import SpecStats
from .stopping import StopStrings

WAITING, PREFILLING, DECODING, FINISHED, ABORTED = "waiting", "prefilling", "decoding", "finished", "aborted"
STATUSES = (WAITING, PREFILLING, DECODING, FINISHED, ABORTED)
# The smallest temperature above 0. Far below it logits / temperature overflows float32 (a logit of
# 4 over 1e-38 is 4e38 > 3.4e38: inf, then NaN probabilities); at it the softmax already puts all
# the mass on the top token whenever the top-2 gap exceeds 1e-3, so nothing sharper is lost.
MIN_TEMPERATURE = 1e-5

# A Request's public fields, in two kinds: those a step may change (a step stages them on a
# RequestDraft and its commit assigns exactly these) and those fixed when the request is made.
STEP_FIELDS = ("status", "num_computed_tokens", "num_cached_tokens", "num_preemptions", "output_token_ids",
               "logprobs", "finish_reason", "stop_reason", "stop_strings", "draft_token_ids", "spec_stats")
FIXED_FIELDS = ("id", "prompt_token_ids", "sampling", "stop_token_ids", "prompt_text")
# The step fields that only grow: a commit appends to these lists in place (the request keeps one
# list of each for its life; copy it to keep the tokens as they are now).
GROWING_FIELDS = ("output_token_ids", "logprobs")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick a request's tokens. temperature 0 is greedy; a seed makes samples reproducible
    whatever else shares the batch; ``stop_token_ids=None`` means the checkpoint's eos ids.
    ``stop``: strings that end the output (matched on decoded text, cut from it);
    ``min_new_tokens``: no stop before that many tokens; ``logprobs=k``: record each token's
    log-probability and its k most likely alternatives (see ``stopping.py``, ``logprobs.py``).
    Checked on construction: counts are ints (never bools), a temperature is 0 or at least
    ``MIN_TEMPERATURE``, a seed is an int in [0, 2**64), ``ignore_eos`` is a bool."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] | None = None
    min_new_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self):
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """``SamplingParams(**d)``, refusing a key that names no field (listing the close matches)."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in names:
                near = difflib.get_close_matches(str(key), names, n=3, cutoff=0.6)
                hint = f"; did you mean {' or '.join(map(repr, near))}?" if near else ""
                raise InvalidRequestError(f"sampling: unknown SamplingParams field {key!r}{hint} "
                                          f"(the fields: {', '.join(names)})")
        return cls(**d)

    def validate(self) -> None:
        def bad(field, why):
            raise InvalidRequestError(f"SamplingParams.{field}={getattr(self, field)!r}: {why}")
        if not _int(self.max_new_tokens) or self.max_new_tokens < 1:
            bad("max_new_tokens", "must be an int >= 1")
        if not _finite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            bad("temperature", f"is below {MIN_TEMPERATURE:g}, where logits / temperature may overflow "
                               f"float32; use temperature=0 for greedy decoding")
        if not _int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an int >= 0 (0 = off)")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (not _int(self.seed) or not 0 <= self.seed < 2**64):
            bad("seed", "must be None or an int in [0, 2**64)")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be True or False")
        if self.stop is not None and (not isinstance(self.stop, tuple)
                                      or not all(isinstance(x, str) and x for x in self.stop)):
            bad("stop", "must be a non-empty string or a list of them")
        if not _int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            bad("min_new_tokens", f"must be an int in 0..max_new_tokens ({self.max_new_tokens})")
        lp = self.logprobs
        if lp is not None and (not _int(lp) or lp < 0):
            bad("logprobs", "must be None (off) or an int >= 0 (alternatives per token)")

    def validate_for(self, vocab_size: int, *, has_tokenizer: bool) -> None:
        """The checks that need the checkpoint: token ids in the vocabulary, a tokenizer for ``stop``."""
        bad = [t for t in self.stop_token_ids or () if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"SamplingParams.stop_token_ids: {bad[0]} is outside the "
                                      f"vocabulary [0, {vocab_size})")
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise InvalidRequestError(f"SamplingParams.logprobs={self.logprobs}: more than the "
                                      f"vocabulary ({vocab_size})")
        if self.stop and not has_tokenizer:
            raise InvalidRequestError("SamplingParams.stop needs text, but this checkpoint has no tokenizer; "
                                      "use stop_token_ids instead")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int(x) -> bool:
    """An int and not a bool (True is not a count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _token_ids(value) -> tuple[int, ...]:
    """``stop_token_ids`` as a tuple of ints, or InvalidRequestError saying what is wrong."""
    def bad(why):
        raise InvalidRequestError(f"SamplingParams.stop_token_ids={value!r}: {why}")
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, (list, tuple, set, frozenset)):
        bad("must be None (the checkpoint's eos ids) or a list of int token ids")
    for i, t in enumerate(value):
        if not hasattr(t, "__index__") or isinstance(t, bool):
            bad(f"item {i} is {t!r} ({type(t).__name__}); token ids must be ints")
    return tuple(t.__index__() for t in value)


class Request:
    """A live request: its fields change as the session runs it (see module docstring)."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], sampling: SamplingParams,
                 stop_token_ids: frozenset[int], *, block_table: Callable[[int], list[int]],
                 decode: Callable[[list[int]], str] | None = None, prompt_text: str | None = None):
        self.id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling
        self.stop_token_ids = stop_token_ids
        self.status = WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0       # prompt tokens taken from the prefix cache at admission
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None   # the stop token id or stop string that fired
        self.logprobs: list[TokenLogprob] | None = [] if sampling.logprobs is not None else None
        self.stop_strings = StopStrings(sampling.stop, decode) if sampling.stop and decode else None
        self.prompt_text = prompt_text
        # speculative decoding (speculative.py): the drafts staged for the next verification
        # (never computed tokens) and the acceptance counts so far
        self.draft_token_ids: tuple[int, ...] = ()
        self.spec_stats = SpecStats()
        self._block_table = block_table
        self._decode = decode

    @property
    def block_table(self) -> list[int]:
        """The physical blocks holding this request's tokens, in order (a copy)."""
        return self._block_table(self.id)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_done(self) -> bool:
        return self.status in (FINISHED, ABORTED)

    @property
    def text(self) -> str | None:
        """The output decoded to text (None when the checkpoint has no tokenizer), cut before the
        stop string that finished it, if one did."""
        if self._decode is None:
            return None
        text = self._decode(self.output_token_ids)
        cut = self.stop_strings.cut if self.stop_strings is not None else None
        return text if cut is None else text[:cut]

    def __repr__(self) -> str:
        return (f"Request(id={self.id}, status={self.status!r}, prompt={len(self.prompt_token_ids)} tokens, "
                f"output={len(self.output_token_ids)} tokens, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, finish_reason={self.finish_reason!r})")

    def _repr_html_(self) -> str:
        from ..inspect.snapshot import take_request
        return take_request(self)._repr_html_()


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request's result, as ``generate`` returns it."""

    request_id: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str | None
    stop_reason: int | str | None = None               # the stop token id or stop string
    logprobs: tuple[TokenLogprob, ...] | None = None   # one per token, with SamplingParams(logprobs=k)

    @classmethod
    def of(cls, req: Request) -> Completion:
        lps = tuple(req.logprobs) if req.logprobs is not None else None
        return cls(req.id, tuple(req.prompt_token_ids), tuple(req.output_token_ids), req.text,
                   req.finish_reason, req.stop_reason, lps)
