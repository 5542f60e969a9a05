"""On-device sampling: greedy, temperature, top-k and top-p, seeded per request.

Nothing here synchronises with the host: per-row parameters travel host-to-device as small
tensors, the noise comes from each request's own ``torch.Generator`` on the device, and the
result stays on the device until the session copies the token ids at its named boundary.

Sampling uses the exponential-race trick: ``argmax(p / q)`` with ``q ~ Exp(1)`` picks index i
with probability ``p_i``, so no cumulative search (and no sync) is needed. Because each request
draws its noise from its own generator, its samples do not depend on the rest of the batch.
"""
from __future__ import annotations

import torch

from .request import SamplingParams


def new_generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def copy_generator(g: torch.Generator) -> torch.Generator:
    """An independent generator on ``g``'s device that continues exactly where ``g`` is."""
    copy = new_generator(g.device, 0)
    copy.set_state(g.get_state())
    return copy


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           greedy_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Pick one token per row of ``logits`` [rows, vocab] -> (token ids [rows] int64 on device, h2d bytes).

    ``generators[r]`` must be set for every non-greedy row. ``greedy_ids``: ``logits.argmax(-1)``
    when the caller already has it (a kernel set's fused ``greedy_health``).
    """
    if greedy_ids is None:
        greedy_ids = logits.argmax(dim=-1)                              # [rows]
    greedy = [p.temperature == 0.0 for p in params]                       # temperature 0: argmax
    if all(greedy):
        return greedy_ids, 0
    device = logits.device
    rows, vocab = logits.shape
    temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32)
    is_greedy = torch.tensor(greedy)
    h2d = temps.nbytes + is_greedy.nbytes
    x = logits.float() / temps.to(device)[:, None]                       # [rows, vocab]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], dtype=torch.int64)
        ps = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], dtype=torch.float32)
        h2d += ks.nbytes + ps.nbytes
        x = _mask_top_k_top_p(x, ks.to(device), ps.to(device))
    probs = torch.softmax(x, dim=-1)
    noise = torch.empty_like(probs)
    for r, (row_greedy, gen) in enumerate(zip(greedy, generators)):
        if row_greedy:
            noise[r].fill_(1.0)
        else:
            noise[r].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(is_greedy.to(device), greedy_ids, sampled), h2d


def _mask_top_k_top_p(x: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside a row's top-k and outside its top-p nucleus.

    The most likely token always survives. x [rows, vocab] float32.
    """
    sorted_x, order = x.sort(dim=-1, descending=True)                    # [rows, vocab]
    ranks = torch.arange(x.shape[-1], device=x.device)
    drop = ranks[None, :] >= ks[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    before = probs.cumsum(dim=-1) - probs                                # mass strictly above each token
    drop = before >= ps[:, None]                                         # top_p 1 arrives as inf
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)


def pack(ids: torch.Tensor, logits: torch.Tensor, ks: list[int | None], codes: torch.Tensor | None = None):
    """What one step's sample copies to the host, packed on the device: per row the token id with
    the row's health code (0 healthy, 1 non-finite, 2 all zero, 3 all equal) in its upper 32 bits,
    widened to ``2 + k`` int64 with log-probabilities when a row asks (``logprobs.py``).

    Returns (packed [rows] or [rows, 2 + k] on the device, ``unpack(host) -> (token ids [rows],
    health codes, TokenLogprob or None per row)``). ``codes``: ``health_codes(logits)`` when the
    caller already has them."""
    packed = ids | ((health_codes(logits) if codes is None else codes) << 32)
    if all(k is None for k in ks):
        def unpack(host):
            return host & 0xFFFFFFFF, (host >> 32).tolist(), [None] * len(ks)
        return packed, unpack
    from . import logprobs
    packed = logprobs.attach(packed, logits, ids, logprobs.width(ks, logits.shape[-1]))

    def unpack_logprobs(host):
        first = host[:, 0]
        return first & 0xFFFFFFFF, (first >> 32).tolist(), logprobs.unpack(host, ks)
    return packed, unpack_logprobs


def health_codes(logits: torch.Tensor) -> torch.Tensor:
    """Per row: 0 healthy, 1 non-finite, 2 all zero, 3 all equal (int64, on the device)."""
    hi, lo = logits.amax(dim=-1), logits.amin(dim=-1)                   # [rows]
    if logits.is_cpu:
        # torch's CPU max/min propagate NaN, so a row holds a NaN or an inf exactly when its max or
        # min is not finite: two passes over the logits instead of four
        nonfinite = ~(torch.isfinite(hi) & torch.isfinite(lo))
    else:
        nonfinite = ~torch.isfinite(logits).all(dim=-1)
    equal = hi == lo
    zero = equal & (hi == 0)
    code = torch.where(zero, 2, torch.where(equal, 3, 0))
    return torch.where(nonfinite, 1, code).to(torch.int64)


def mask_early_stops(logits: torch.Tensor, reqs) -> tuple[torch.Tensor, int]:
    """``logits`` [rows, vocab] with every row still under its ``min_new_tokens`` unable to pick
    a stop token id (set to -inf in a device copy); returns (logits, h2d bytes). The input is
    returned unchanged (no copy) when no row needs it."""
    rows, cols = [], []
    for r, req in enumerate(reqs):
        if len(req.output_token_ids) < req.sampling.min_new_tokens:
            for t in sorted(req.stop_token_ids):
                rows.append(r)
                cols.append(t)
    if not rows:
        return logits, 0
    index = torch.tensor([rows, cols], dtype=torch.int64)               # [2, masked entries]
    dev = index.to(logits.device)
    out = logits.clone()
    out[dev[0], dev[1]] = float("-inf")
    return out, index.nbytes
