"""Sampling a step that verifies drafts: acceptance, the kept prefix and the rollback.

A verification row with drafts ``d1..dk`` has k + 1 logits rows; row i (position ``t-1+i``)
tests draft ``d(i+1)`` and the last one gives a bonus token. Per logits row one token ``y_i`` is
drawn on the device:

* greedy: ``y_i = argmax``; draft ``d(i+1)`` is accepted when ``y_i == d(i+1)``, so the tokens
  kept are exactly the ones decoding without drafts would pick (the same logits, up to the
  rounding of a wider forward; bit for bit with ``deterministic=True``).
* temperature > 0 (speculative sampling, the drafter's proposal being one token for sure):
  accept ``d`` with probability ``p_i(d)``; else ``y_i`` is drawn from ``p_i`` without ``d``
  (renormalised), which is ``max(0, p_i - q)`` normalised for ``q`` the point mass on ``d``.
  Each kept token then has exactly the distribution plain sampling gives it. ``p_i`` is the
  sampler's distribution: temperature, top-k and top-p applied as in ``sampler.sample``.

On the host, per row: stage ``y_0``; while ``y_i == d(i+1)`` (accepted) and the request goes on,
stage ``y_(i+1)``. With ``a`` drafts kept the request has computed ``t + a`` tokens; ``rollback``
books them (publishing only blocks full of kept tokens) and truncates the block table to what
those tokens need, so the blocks that held only rejected drafts go back to the pool. Their slots
still hold the rejected K/V (the ledger says who wrote them), but no request counts them as live.
Everything happens on the step's draft: nothing live changes before the commit.
"""
from __future__ import annotations

import itertools
import time

import torch

from ..cache.block_table import blocks_needed
from . import sampler
from .transaction import fault_point


def tested_drafts(plan) -> list[int]:
    """Per logits row of ``plan``: the draft its token is tested against (-1: none)."""
    out = []
    for row_index, group in itertools.groupby(plan.logits_rows):
        drafts = plan.rows[row_index].drafts
        n = len(list(group))
        out += [drafts[i] if i < len(drafts) else -1 for i in range(n)]
    return out


def sample_with_drafts(logits: torch.Tensor, params: list, generators: list, tested: list[int],
                       pinned) -> tuple[torch.Tensor, int]:
    """One token per logits row [rows] on the device (see the module doc), and the h2d bytes.
    Rows that test no draft, and greedy rows, are sampled as ``sampler.sample`` samples them.
    ``tested``: per row the draft it tests (-1: none); ``pinned``: as for ``sampler.sample``."""
    ids, h2d = sampler.sample(logits, params, generators, None, pinned)
    rows = [j for j, (p, d) in enumerate(zip(params, tested)) if d >= 0 and not p.greedy]
    if not rows:
        return ids, h2d
    vocab = logits.shape[1]
    keys = [torch.randint(2 ** 62, (2,), generator=generators[j]) for j in rows]     # uniform, noise
    ints = torch.tensor([[j, tested[j], params[j].top_k if params[j].top_k > 0 else vocab,
                          int(u), int(e)] for j, (u, e) in zip(rows, keys)], dtype=torch.int64)  # [n, 5]
    floats = torch.tensor([[params[j].temperature, params[j].top_p if params[j].top_p < 1.0 else float("inf")]
                           for j in rows], dtype=torch.float32)                                  # [n, 2]
    h2d += ints.nbytes + floats.nbytes
    ints = sampler.to_device(ints, logits.device, pinned, "verify.ints")
    floats = sampler.to_device(floats, logits.device, pinned, "verify.floats")
    x = logits.index_select(0, ints[:, 0]).float() / floats[:, :1]                   # [n, vocab]
    if any(params[j].top_k > 0 or params[j].top_p < 1.0 for j in rows):
        x = sampler.mask_top_k_top_p(x, ints[:, 2], floats[:, 1])
    p = torch.softmax(x, dim=-1)
    d = ints[:, 1:2]                                                                # [n, 1]
    u = torch.exp(-sampler.exponential_noise(ints[:, 3], 1))[:, 0]                  # uniform in (0, 1)
    accept = u < p.gather(1, d)[:, 0]
    residual = p.scatter(1, d, 0.0)
    other = (residual / sampler.exponential_noise(ints[:, 4], vocab)).argmax(dim=-1)
    return ids.index_copy(0, ints[:, 0], torch.where(accept, d[:, 0], other)), h2d


def sample_verified(step, draft, generators: dict, buffers) -> dict:
    """Sample every logits row of a step that carries drafts, stage the kept tokens on ``draft``
    and roll every verification row back to its kept prefix. Returns the fields of
    ``step.Sampled`` (``health`` as (request id, code); ``accepted``: request id -> drafts kept)."""
    t0 = time.perf_counter()
    plan = step.plan
    reqs = [draft.of(draft.requests[i]) for i in step.logits_request_ids]
    logits = step.logits.view_unchecked()                                          # [rows, vocab]
    pinned = buffers.staging("sample")
    with buffers.writing("sample"):
        allowed, h2d_mask = sampler.mask_early_stops(logits, reqs, pinned)
        gens = [draft.generator(r.id, generators) for r in reqs]
        ids, h2d = sample_with_drafts(allowed, [r.sampling for r in reqs], gens, tested_drafts(plan), pinned)
        fault_point("sampled")
    packed, unpack = sampler.pack(ids, logits, [r.sampling.logprobs for r in reqs])
    host = packed.cpu()
    fault_point("d2h")
    tokens, codes, lps = unpack(host)
    accepted, j = {}, 0
    for row_index, group in itertools.groupby(plan.logits_rows):
        n = len(list(group))
        row, req = plan.rows[row_index], reqs[j]
        ys, lp = tokens[j:j + n], lps[j]
        j += n
        if req.is_done:                          # aborted between the forward and this sample
            continue
        draft.stage_token(req, ys[0], lp)
        if not row.drafts:
            continue
        kept = 0
        while kept < len(row.drafts) and ys[kept] == row.drafts[kept] and not req.is_done:
            kept += 1
            draft.stage_token(req, ys[kept])
        rollback(draft, req, row, kept)
        accepted[req.id] = kept
    fault_point("staged")
    health, seen = [], set()                      # (request id, health code), once per request
    for r, c in zip(reqs, codes):
        if c and r.id not in seen:
            seen.add(r.id)
            health.append((r.id, c))
    given_back = tuple(s for slots in plan.rolled_back(accepted).values() for s in slots)
    return {"tokens": tokens, "ids": ids, "health": health,
            "h2d": h2d + h2d_mask, "d2h": host.nbytes, "seconds": time.perf_counter() - t0, "accepted": accepted,
            "rolled_back": given_back}


def rollback(draft, req, row, kept: int) -> None:
    """Book the ``kept`` drafts of ``row`` as computed and give the rest back (module doc)."""
    computed = row.start + 1 + kept
    req.num_computed_tokens = computed
    req.spec_stats = req.spec_stats.add(len(row.drafts), kept)
    m = draft.manager
    if m.has(req.id):                            # a request that just finished holds no blocks
        m.commit(req.id, req.token_ids, computed)
        m.truncate(req.id, blocks_needed(computed, m.block_size))
