"""Top-k next tokens of a step's logits rows, with probabilities.

The softmax normaliser and the top-k run on the device; per row only ``k`` probabilities and
``k`` token ids cross to the host, and those bytes are added to the step's ``transfers``::

    logits [rows, vocab] (device) ─logsumexp─> [rows] ─┐
                                  ─topk(k)───> values, ids [rows, k] ─> probs = exp(values - lse)
                                                                        └─> host: 2 * rows * k numbers
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class TopK:
    step: int
    request_ids: tuple[int, ...]
    token_ids: tuple[tuple[int, ...], ...]         # [rows][k]
    probs: tuple[tuple[float, ...], ...]           # [rows][k]
    texts: tuple[tuple[str, ...], ...] | None      # decoded tokens, when a tokenizer was given

    def row(self, request_id: int) -> list[tuple[int, float]]:
        i = self.request_ids.index(request_id)
        return list(zip(self.token_ids[i], self.probs[i]))

    def __repr__(self) -> str:
        from .record_views import topk_text
        return topk_text(self)

    def _repr_html_(self) -> str:
        from .record_views import topk_html
        return topk_html(self)


def topk(step, k: int = 5, decode: Callable[[list[int]], str] | None = None) -> TopK:
    """The ``k`` most likely next tokens of every logits row of ``step``.

    Raises InvalidRequestError when the step has no logits or they went stale (clone them first).
    """
    if not isinstance(k, int) or k < 1:
        raise InvalidRequestError(f"k={k!r} must be an int >= 1")
    logits = step.logits
    if logits is None:
        raise InvalidRequestError(f"step {step.index} produced no logits (no row reached the end of its tokens)")
    if logits.is_stale:
        raise InvalidRequestError(f"the logits of step {step.index} are stale: a later step reused their device "
                                  f"buffer (clone them before running another step to keep them)")
    k = min(k, logits.shape[1])
    with torch.no_grad():
        t = logits.tensor.float()                                      # [rows, vocab] on the device
        values, ids = t.topk(k, dim=-1)                                # [rows, k]
        probs = (values - t.logsumexp(dim=-1, keepdim=True)).exp()    # [rows, k]
        probs_h, ids_h = probs.cpu(), ids.cpu()
    step.transfers["d2h"] = step.transfers.get("d2h", 0) + probs_h.nbytes + ids_h.nbytes
    id_rows = tuple(tuple(int(x) for x in row) for row in ids_h.tolist())
    texts = tuple(tuple(decode([i]) for i in row) for row in id_rows) if decode is not None else None
    return TopK(step.index, tuple(step.logits_request_ids), id_rows,
                tuple(tuple(float(f"{p:.4g}") for p in row) for row in probs_h.tolist()), texts)
