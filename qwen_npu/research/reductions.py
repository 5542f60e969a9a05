"""Reductions a capture applies on the device before it keeps anything: ``reduce=`` of ``sess.capture``.

A reduction is any callable ``fn(x) -> tensor`` over the chosen tokens of one hook call,
``x [tokens, ...] -> [tokens, ...]`` (the first axis stays the tokens, so each position keeps its
own reduced row). It runs where the activation lives, before any copy to the host::

    norm()              [tokens, ...] -> [tokens] or [tokens, heads]: L2 norm of the last axis (float32)
    topk_logits(k)      [tokens, vocab] -> [tokens, k, 2]: (logit, token id) of the k largest (float32;
                        ids up to 2**24 are exact)
    mean_positions()    one [...] per request and name: the mean over every position captured,
                        summed in float32 on the device (read with ``cap.mean(name, request)``)
"""
from __future__ import annotations

import torch


class MeanPositions:
    """The mean over positions of each request (see module docstring); kept as a running sum."""

    accumulate = True
    __name__ = "mean_positions"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()

    def __repr__(self) -> str:
        return "mean_positions()"


def mean_positions() -> MeanPositions:
    """Keep one mean per request and name instead of one row per position."""
    return MeanPositions()


def norm():
    """The L2 norm of each token's last axis, in float32."""
    def norm_(x):
        return torch.linalg.vector_norm(x.float(), dim=-1)
    return norm_


def topk_logits(k: int = 10):
    """The ``k`` largest entries of each token's last axis as (value, index) pairs: [tokens, k, 2]."""
    if not isinstance(k, int) or k < 1:
        from ..errors import InvalidRequestError
        raise InvalidRequestError(f"topk_logits(k={k!r}): k must be an int >= 1")

    def topk_logits_(x):
        vals, idx = x.float().topk(min(k, x.shape[-1]), dim=-1)
        return torch.stack([vals, idx.float()], dim=-1)
    return topk_logits_
