"""``sess.score(prompt, continuation)``: per-token log-probabilities of a given text.

The continuation is teacher-forced through the session's own steps: a fresh request holds the
prompt, its prefill runs as usual, and then each continuation token is forced at sampling and
fed back by a decode step that dispatches only that request. Each step is one transaction
(forward and forced sample together); a score interrupted part way aborts its request, so no
half-scored request is left for later steps. The score request is greedy and draws no seed,
so scoring never shifts the seeds of later unseeded requests. Its log-probability is recorded on the device at the token-id copy
(``SamplingParams(logprobs=0)``). Other requests are not touched: no step of theirs runs, nothing
is preempted (a score that would need that is refused up front), and the score request ends
finished in ``sess.requests`` like any other.

With ``include_prompt=True`` the prompt's own tokens (from the second on) are scored too, by
teacher-forcing them one step each after the first token.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..engine.request import DECODING, PREFILLING, WAITING, Request, SamplingParams
from ..engine.step import check_not_pending
from ..errors import InvalidRequestError, OutOfBlocksError


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """Log-probabilities of scored tokens given everything before them."""

    request_id: int
    token_ids: tuple[int, ...]      # the scored tokens
    positions: tuple[int, ...]      # their positions in prompt + continuation
    logprobs: tuple[float, ...]     # natural log, float32 precision
    num_prompt_tokens: int

    @property
    def total(self) -> float:
        return float(sum(self.logprobs))

    @property
    def mean(self) -> float:
        return self.total / len(self.logprobs)

    @property
    def perplexity(self) -> float:
        return math.exp(-self.mean)

    def __repr__(self) -> str:
        return (f"ScoreResult(request {self.request_id}: {len(self.logprobs)} tokens, total logprob "
                f"{self.total:.4f}, mean {self.mean:.4f}, perplexity {self.perplexity:.3f})")


def score(sess, prompt, continuation, *, include_prompt: bool = False) -> ScoreResult:
    """Score ``continuation`` (text or token ids) after ``prompt`` (text, token ids or chat messages)."""
    view = sess.state
    check_not_pending(sess.last_step, "score", view.requests)
    prompt_ids, _, _ = sess._prepare(prompt, SamplingParams(max_new_tokens=1))
    cont = _continuation_ids(sess, continuation)
    ids, forced = (prompt_ids[:1], prompt_ids[1:] + cont) if include_prompt else (prompt_ids, cont)
    sampling = SamplingParams(max_new_tokens=len(forced), ignore_eos=True, stop_token_ids=(), logprobs=0)
    ids, text, sampling = sess._prepare(ids, sampling)
    _check_room(sess, len(ids) + len(forced))
    req = sess._add(ids, text, sampling, draw_seed=False)      # greedy: later seeds stay as they were
    try:
        while not req.is_done:
            force = {req.id: forced[len(req.output_token_ids)]}
            if req.status in (WAITING, PREFILLING):
                sess._transact(lambda d: ("prefill", sess._scheduler.prefill_rows(d, sess.requests, [req])),
                               "score", sample=True, force=force)
            else:
                sess._transact(lambda d: _decode_alone(d, req), "score", sample=True, force=force)
    except BaseException:
        if not req.is_done:                 # each step was a transaction; the score as a whole ends here
            sess.abort(req)
        raise
    start = len(ids)
    return ScoreResult(req.id, tuple(forced), tuple(range(start, start + len(forced))),
                       tuple(lp.logprob for lp in req.logprobs), len(prompt_ids))


def _continuation_ids(sess, continuation) -> list[int]:
    if isinstance(continuation, str):
        if sess.tokenizer is None:
            raise InvalidRequestError("score: this checkpoint has no tokenizer, so the continuation must be "
                                      "token ids, not text")
        ids = sess.tokenizer.encode(continuation)
    else:
        if isinstance(continuation, torch.Tensor):
            continuation = continuation.flatten().tolist()
        try:
            ids = [int(t) for t in continuation]
        except (TypeError, ValueError):
            raise InvalidRequestError(f"score: the continuation must be text or token ids, "
                                      f"not {type(continuation).__name__}") from None
    if not ids:
        raise InvalidRequestError("score: the continuation is empty; give at least one token to score")
    vocab = sess.model_config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"score: continuation token {bad[0]} is outside the "
                                  f"vocabulary [0, {vocab})")
    return ids


def _check_room(sess, num_tokens: int) -> None:
    """Refuse a score that would have to preempt another request or exceed the batch."""
    manager = sess.state.manager
    need = -(-num_tokens // sess.config.block_size)
    if need > manager.num_free_blocks:
        raise OutOfBlocksError(f"score needs {need} free blocks for {num_tokens} tokens but only "
                               f"{manager.num_free_blocks} are free; finish or abort requests first")
    running = sum(r.status in (PREFILLING, DECODING) for r in sess.requests)
    if running >= sess.config.max_batch:
        raise InvalidRequestError(f"score needs a batch row but all max_batch={sess.config.max_batch} are "
                                  f"taken by running requests; finish or abort one first")


def _decode_alone(draft, req: Request):
    """Plan a decode step that dispatches ``req`` only (its block was reserved by ``_check_room``)."""
    if not draft.manager.allocate(req.id, req.num_tokens):
        raise OutOfBlocksError(f"score: no free block for request {req.id}")   # not after _check_room
    return "decode", [(draft.of(req), 1)]
