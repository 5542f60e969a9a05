"""Log-probabilities of sampled tokens, computed on the device, riding on the token-id copy.

A step's sample already copies one int64 per row to the host (token id | health code << 32).
When a row asks for ``SamplingParams(logprobs=k)`` that copy widens to ``2 + k`` int64 per row
(``k`` = the largest request of the step), still one copy::

    column   0                      1                  2 .. 2+k-1
             token id | health<<32  bits(logprob)      bits(top logprob) << 32 | top token id

``bits`` is the float32 bit pattern (sign-extended in column 1). Log-probabilities are those of
the model's own distribution — ``log_softmax`` of the float32 logits, before temperature,
top-k/top-p or ``min_new_tokens`` masking — so they compare directly with a dense forward.
"""
from __future__ import annotations

import dataclasses

import torch

LOW32 = 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated (or teacher-forced) token: its log-probability and the k most likely tokens."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()     # (token id, logprob), most likely first

    def __repr__(self) -> str:
        top = ", ".join(f"{t}: {lp:.4f}" for t, lp in self.top)
        return f"TokenLogprob({self.token_id}: {self.logprob:.4f}" + (f"; top {top})" if top else ")")


def width(ks: list[int | None], vocab_size: int) -> int | None:
    """The k all rows of a step share (the largest asked), or None when no row asks."""
    asked = [k for k in ks if k is not None]
    return min(max(asked), vocab_size) if asked else None


def attach(packed: torch.Tensor, logits: torch.Tensor, token_ids: torch.Tensor,
           k: int | None) -> torch.Tensor:
    """Widen ``packed`` [rows] int64 to [rows, 2 + k] with log-probabilities (device, no sync).

    ``logits`` [rows, vocab]; ``token_ids`` [rows] int64, the tokens appended (sampled or forced).
    Returns ``packed`` unchanged when ``k`` is None.
    """
    if k is None:
        return packed
    lp = torch.log_softmax(logits.float(), dim=-1)                     # [rows, vocab]
    cols = [packed[:, None], _bits(lp.gather(1, token_ids[:, None]))]  # [rows, 1] each
    if k > 0:
        values, ids = lp.topk(k, dim=-1)                               # [rows, k]
        cols.append((_bits(values) << 32) | ids)
    return torch.cat(cols, dim=1)                                      # [rows, 2 + k]


def unpack(host: torch.Tensor, ks: list[int | None]) -> list[TokenLogprob | None]:
    """Per row the TokenLogprob its request asked for (``ks[r]`` alternatives), else None."""
    if host.dim() == 1:
        return [None] * len(ks)
    tokens = (host[:, 0] & LOW32).tolist()
    chosen = _floats(host[:, 1]).tolist()
    top = host[:, 2:]
    top_lp, top_ids = _floats(top >> 32).tolist(), (top & LOW32).tolist()
    out: list[TokenLogprob | None] = []
    for r, k in enumerate(ks):
        if k is None:
            out.append(None)
            continue
        alts = tuple(zip(top_ids[r][:k], top_lp[r][:k]))
        out.append(TokenLogprob(tokens[r], chosen[r], alts))
    return out


def _bits(x: torch.Tensor) -> torch.Tensor:
    """float32 -> its bit pattern as int64 (sign-extended), same shape."""
    return x.contiguous().view(torch.int32).to(torch.int64)


def _floats(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 (sign-extended float32 bits) -> float32."""
    return x.to(torch.int32).view(torch.float32)
