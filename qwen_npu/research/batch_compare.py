"""``qwen_npu.compare_batched(sess, request, neighbours)``: why do a request's bits change in a batch?

Three runs of one idle Session, each after ``sess.reset()`` (so every position is computed,
none served from the prefix cache), with captures on the request:

    alone      the request by itself, with its own sampling
    batched    the request beside ``neighbours``, added in the same step and teacher-forced onto
               alone's tokens (so both runs compute the same positions from the same inputs)
    perturbed  as batched, every neighbour's prompt tokens changed (same lengths) and each
               neighbour forced onto its batched tokens, so the schedule, every step's shapes and
               the request's own inputs are the same: only the other rows' data differ

Bits are compared exactly (``atol=0``). The verdict:

    "identical"      alone and batched agree bit for bit
    "rounding"       they differ, but batched and perturbed agree: the batch changed how the
                     request was computed (shapes, reduction order), not what it read
    "contamination"  batched and perturbed differ: another row's data reached the request's row
                     (a kernel that reads outside its row, a wrong slot, a shared buffer)

``first`` is where alone and batched first part (layer, hook point, position), and ``margin``
the top-2 logit margin of the alone run at the first logits row from that position on: how far
the rounding is from flipping a token. ``deterministic=True`` (batch-invariant kernels) should
give "identical"; anything else under it is a bug. With the prefix cache on, a neighbour that
shares the request's first blocks serves them in the batched run but not in the perturbed one
(whose prompts differ), so the two schedules differ: give such neighbours with
``prefix_cache=False``.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..errors import InvalidRequestError
from ..inspect import html as H
from . import hooks
from .compare import Divergence, DivergenceReport, _diff, _items, _run

VERDICTS = ("identical", "rounding", "contamination")


@dataclasses.dataclass(frozen=True)
class BatchDivergence:
    verdict: str                          # one of VERDICTS
    first: Divergence | None              # where alone and batched first differ (None: identical)
    margin: float | None                  # alone's top-2 logit margin at the first logits row from first on
    contamination: Divergence | None      # where batched and perturbed first differ (None: not contaminated)
    batched: DivergenceReport             # alone vs batched, every compared point
    perturbed: DivergenceReport           # batched vs perturbed neighbours
    num_neighbours: int

    def __repr__(self) -> str:
        lines = [f"BatchDivergence: {self.verdict} (beside {self.num_neighbours} neighbours)"]
        if self.first is not None:
            lines.append(f"  bits first part at {self.first}")
        if self.margin is not None:
            lines.append(f"  top-2 logit margin there (alone): {self.margin:.3g}")
        if self.contamination is not None:
            lines.append(f"  changing only the neighbours changes this row at {self.contamination}")
        elif self.first is not None:
            lines.append("  changing only the neighbours leaves this row's bits as they are: "
                         "rounding, not a leak")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return H.pre(repr(self))


def compare_batched(sess, request, neighbours, *, sampling=None, names=None) -> BatchDivergence:
    """Run ``request`` alone, beside ``neighbours`` and beside perturbed neighbours in ``sess``
    and say whether and why its bits change (see the module docstring). ``request`` and each
    neighbour: a prompt or a (prompt, SamplingParams) pair; ``sampling`` applies to those
    without. ``sess`` must be idle; it is reset before each run, and left reset (also when a run
    fails or is interrupted)."""
    items = _items([request], sampling)
    others = _items(list(neighbours), sampling) if neighbours else []
    if not others:
        raise InvalidRequestError("compare_batched: no neighbours given; a batch needs at least one "
                                  "other request")
    busy = [r.id for r in sess.requests if not r.is_done]
    if busy:
        raise InvalidRequestError(f"compare_batched: the session still runs requests {busy}; finish or "
                                  f"abort them first (the session is reset before each run)")
    names = hooks.resolve_names("*" if names is None else names, sess.model_config.num_hidden_layers)
    mine = sess._prepare(*items[0])
    theirs = [sess._prepare(p, sp) for p, sp in others]
    vocab = sess.model_config.vocab_size
    shifted = [(_shift(ids, vocab), None, sp) for ids, _, sp in theirs]
    for ids, _, sp in shifted:
        sess._prepare(ids, sp)                 # a shifted prompt must be as valid as its original
    try:
        alone, cap_alone, runs = _three_runs(sess, mine, theirs, shifted, names)
    except BaseException:                      # a failed run, or Ctrl-C: leave the session reset, as promised
        with contextlib.suppress(Exception):
            sess.reset()
        raise
    tokens = [list(alone.output_token_ids)]
    (batched_req, cap_batched, _), (perturbed_req, cap_perturbed, _) = runs
    vs_batched = _diff(cap_alone, cap_batched, [alone], [batched_req], names, 0.0, 0.0, tokens)
    vs_perturbed = _diff(cap_batched, cap_perturbed, [batched_req], [perturbed_req], names, 0.0, 0.0, tokens)
    verdict = ("identical" if not vs_batched.diverged
               else "contamination" if vs_perturbed.diverged else "rounding")
    return BatchDivergence(verdict, vs_batched.first, _margin(cap_alone, alone, vs_batched.first, names),
                           vs_perturbed.first, vs_batched, vs_perturbed, len(others))


def _three_runs(sess, mine, theirs, shifted, names):
    """Alone, batched, perturbed (module docstring), each after a reset; the session left reset."""
    sess.reset()
    alone = sess._add(*mine)
    cap_alone = _run(sess, [alone], names)
    lone_tokens = list(alone.output_token_ids)
    runs = []
    for neighbour_prompts, forced_neighbours in ((theirs, False), (shifted, True)):
        sess.reset()
        req = sess._add(*mine)
        near = [sess._add(*p) for p in neighbour_prompts]
        forced = {req.id: lone_tokens}
        if forced_neighbours:
            forced.update({r.id: t for r, t in zip(near, runs[0][2])})
        cap = _run(sess, [req], names, forced, also=near,
                   too_long=lambda rid, n: f"compare_batched: request {rid} runs longer than the {n} tokens "
                                           f"it produced before")
        runs.append((req, cap, [list(r.output_token_ids) for r in near]))
    sess.reset()
    return alone, cap_alone, runs


def _shift(ids: list[int], vocab: int) -> list[int]:
    """Every token moved to another id (by 1 + its index, wrapping): the same length, other data."""
    return [(t + 1 + i) % vocab for i, t in enumerate(ids)]


def _margin(cap, req, first: Divergence | None, names) -> float | None:
    """Top-1 minus top-2 logit of ``req`` at the first logits row at or after ``first.position``."""
    if first is None or "logits" not in names:
        return None
    positions = cap.positions(req, "logits")
    later = [i for i, p in enumerate(positions) if p >= first.position]
    if not later:
        return None
    top = torch.topk(cap.stack("logits", req)[later[0]].float(), 2).values
    return float(top[0] - top[1])


__all__ = ["VERDICTS", "BatchDivergence", "compare_batched"]
