"""On-device sampling: greedy, temperature, top-k and top-p, seeded per request.

Nothing here synchronises with the host: per-row parameters travel host-to-device as small
tensors (through pinned host buffers on an accelerator, ``pinned.py``), and the
result stays on the device until the session copies the token ids at its named boundary.

Sampling uses the exponential-race trick: ``argmax(p / q)`` with ``q ~ Exp(1)`` picks index i
with probability ``p_i``, so no cumulative search (and no sync) is needed. The noise of every row
is made in one batch of device ops, whatever the number of rows: each sampled row draws one
64-bit key from its request's own generator (a host ``torch.Generator``, so the draw launches
nothing on the device), and ``exponential_noise`` hashes (key, token id) into Exp(1) noise.
Because each request's key comes from its own generator, its samples do not depend on the rest
of the batch, and a copied generator (a fork) continues the same stream.
"""
from __future__ import annotations

import torch

from ..kernels.reference import greedy_word, health_codes
from .request import SamplingParams

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B                      # a 32-bit multiplicative hash constant; products stay < 2**63


def new_generator(device: torch.device, seed: int) -> torch.Generator:
    """The generator of a sampled request. It lives on the host whatever ``device`` is: it only
    draws the row's key per sampled token (the noise is made on ``device`` from the key)."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def copy_generator(g: torch.Generator) -> torch.Generator:
    """An independent generator on ``g``'s device that continues exactly where ``g`` is."""
    copy = new_generator(g.device, 0)
    copy.set_state(g.get_state())
    return copy


def to_device(host: torch.Tensor, device: torch.device, pinned, name: str) -> torch.Tensor:
    """``host`` on ``device``: through the spare set of ``pinned`` (a ``PinnedCopies``) without
    blocking on an accelerator, a plain ``.to`` where there is none (the CPU)."""
    return pinned.put(host, name) if pinned is not None else host.to(device)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           greedy_ids: torch.Tensor | None = None, pinned=None) -> tuple[torch.Tensor, int]:
    """Pick one token per row of ``logits`` [rows, vocab] -> (token ids [rows] int64 on device, h2d bytes).

    ``generators[r]`` must be set for every non-greedy row. ``greedy_ids``: ``logits.argmax(-1)``
    when the caller already has it (a kernel set's fused ``greedy_health``). ``pinned``: the
    step's ``PinnedCopies`` for the per-row parameters (a plain ``.to(device)`` without one).
    Only the sampled rows are scaled, masked and given noise; a row's token depends on its own
    logits, parameters and generator only, never on which rows share the batch.
    """
    greedy = [p.temperature == 0.0 for p in params]                       # temperature 0: argmax
    if all(greedy):
        return (logits.argmax(dim=-1) if greedy_ids is None else greedy_ids), 0

    def put(t, name):
        return to_device(t, logits.device, pinned, name)
    vocab = logits.shape[1]
    rows = [i for i, g in enumerate(greedy) if not g]                    # only these make noise
    some = len(rows) < len(params)
    keys = torch.cat([torch.randint(2 ** 62, (1,), generator=generators[i]) for i in rows])  # one draw each
    per_row = torch.tensor([[params[i].temperature, params[i].top_p if params[i].top_p < 1.0 else float("inf")]
                            for i in rows], dtype=torch.float32)                       # [sampled, 2]
    ints = torch.stack((torch.tensor(rows, dtype=torch.int64),
                        torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab for i in rows]),
                        keys), 1)                                                      # [sampled, 3]
    h2d = per_row.nbytes + ints.nbytes
    per_row, ints = put(per_row, "sample.floats"), put(ints, "sample.ints")
    x = (logits.index_select(0, ints[:, 0]) if some else logits).float() / per_row[:, :1]   # [sampled, vocab]
    if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in rows):
        x = mask_top_k_top_p(x, ints[:, 1], per_row[:, 1])
    probs = torch.softmax(x, dim=-1)
    sampled = (probs / exponential_noise(ints[:, 2], vocab)).argmax(dim=-1)
    if not some:
        return sampled, h2d
    if greedy_ids is None:
        greedy_ids = logits.argmax(dim=-1)                              # [rows]
    return greedy_ids.index_copy(0, ints[:, 0], sampled), h2d


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] float32, a pure function of each row's int64 key and the token id.

    Two rounds of a 32-bit integer hash (in int64, masked, so no product overflows) mix the token
    id with the key's low and then high half; ``exp1`` turns the hash into the noise.
    """
    lo, hi = keys & _M32, (keys >> 32) & _M32                          # [rows]
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    return exp1(_mix(_mix(ids[None, :] ^ lo[:, None]) ^ hi[:, None]))  # hashes [rows, vocab] in [0, 2**32)


def exp1(h: torch.Tensor) -> torch.Tensor:
    """Exp(1) values of 32-bit hashes ``h`` (int64 in [0, 2**32)): v = (h + 0.5) / 2**32 is uniform
    in (0, 1), capped at 1 - 2**-24 where float32 rounds it up to 1, and the value is
    ``-log1p(-v)``: finite and positive for every hash (about 1.2e-10 to 16.6), with float32's
    full resolution near 0, where the tokens that win the race draw their noise. A token of
    probability 0 therefore never wins (0 / noise is 0), and none of probability p > 0 is left out.
    """
    v = ((h.float() + 0.5) * 2.0 ** -32).clamp_(max=1.0 - 2.0 ** -24)
    return -torch.log1p(-v)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A widely published 32-bit integer hash: xor-shift by 16, multiply by 0x45d9f3b, twice, and a
    last xor-shift (each output bit depends on every input bit; its statistics are in docs/npu.md)."""
    x = (((x >> 16) ^ x) * _MIX) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    return (x >> 16) ^ x


def mask_top_k_top_p(x: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
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


def pack(ids: torch.Tensor, logits: torch.Tensor, ks: list[int | None], codes: torch.Tensor | None = None,
         words: torch.Tensor | None = None):
    """What one step's sample copies to the host, packed on the device: per row the token id with
    the row's health code (0 healthy, 1 non-finite, 2 all zero, 3 all equal) in its upper 32 bits,
    widened to ``2 + k`` int64 with log-probabilities when a row asks (``logprobs.py``).

    Returns (packed [rows] or [rows, 2 + k] on the device, ``unpack(host) -> (token ids, health
    codes, TokenLogprob or None per row)``, lists of one entry per row). ``codes``:
    ``health_codes(logits)`` when the caller already has them; ``words``: those words already
    packed (the forward's, ``pack_greedy``), when ``ids`` are the rows' argmax they carry."""
    packed = words if words is not None else greedy_word(ids, health_codes(logits) if codes is None else codes)
    if all(k is None for k in ks):
        def unpack(host):
            return (*split_words(host.tolist()), [None] * len(ks))
        return packed, unpack
    from . import logprobs
    packed = logprobs.attach(packed, logits, ids, logprobs.width(ks, logits.shape[-1]))

    def unpack_logprobs(host):
        return (*split_words(host[:, 0].tolist()), logprobs.unpack(host, ks))
    return packed, unpack_logprobs


def split_words(words: list[int]) -> tuple[list[int], list[int]]:
    """(token ids, health codes) of ``greedy_word`` words read on the host."""
    return [w & _M32 for w in words], [w >> 32 for w in words]


def mask_early_stops(logits: torch.Tensor, reqs, pinned=None) -> tuple[torch.Tensor, int]:
    """``logits`` [rows, vocab] with every row still under its ``min_new_tokens`` unable to pick
    a stop token id (set to -inf in a device copy); returns (logits, h2d bytes). The input is
    returned unchanged (no copy) when no row needs it. ``pinned``: as for ``sample``."""
    rows, cols = [], []
    for r, req in enumerate(reqs):
        if req.sampling.min_new_tokens and len(req.output_token_ids) < req.sampling.min_new_tokens:
            for t in sorted(req.stop_token_ids):
                rows.append(r)
                cols.append(t)
    if not rows:
        return logits, 0
    index = torch.tensor([rows, cols], dtype=torch.int64)               # [2, masked entries]
    dev = to_device(index, logits.device, pinned, "sample.stops")
    out = logits.clone()
    out[dev[0], dev[1]] = float("-inf")
    return out, index.nbytes
