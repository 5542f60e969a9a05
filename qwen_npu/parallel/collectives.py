"""The collectives of one rank's forward, and the hook that shows sharded points whole.

Every rank runs the same forward on its shard, so every rank makes the same collectives in the
same order: two all-reduces per layer (``Collectives.all_reduce``), and, at each hook point the
step's hooks want, a gather of the sharded tensor and a broadcast of rank 0's edit
(``GatheringHook``). Every wait is bounded by the process group's timeout (``group.py``), and a
peer that exits breaks its connections, which fails the wait at once on gloo.

Which points are sharded, and along which dimension (the rest are the same on every rank)::

    attn.q_pre_rope, attn.k_pre_rope, attn.q, attn.k, attn.v, attn.z, attn.scores    heads (dim 1)
    mlp.act                                                                           columns (dim -1)

``final_norm`` and ``logits`` exist on rank 0 only (the other ranks make no logits rows): the
hook runs there without any collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InvalidRequestError

HEAD_SHARDED = ("attn.q_pre_rope", "attn.k_pre_rope", "attn.q", "attn.k", "attn.v", "attn.z", "attn.scores")
RANK0_POINTS = ("final_norm", "logits")     # only rank 0 makes logits: no collective at these


class TensorParallelError(InvalidRequestError):
    """A rank failed, disagreed about a step's plan, or did not answer in time."""


def shard_dim(name: str) -> int | None:
    """The dimension hook point ``name`` is split along across ranks, or None where every rank
    holds the whole tensor."""
    point = name.split(".", 2)[-1] if name.startswith("layers.") else name
    if point in HEAD_SHARDED:
        return 1
    if point == "mlp.act":
        return -1
    return None


class Collectives:
    """One rank's collectives on the device group (``torch.distributed``)."""

    def __init__(self, rank: int, size: int, group=None):
        self.rank, self.size, self.group = rank, size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of every rank's partial product (in place; returned)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_edit(self, edited: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
        """Rank 0's edit of a hook point (or None) on every rank; ``like`` gives its shape."""
        flag = torch.tensor([0 if edited is None else 1], dtype=torch.int64, device=like.device)
        dist.broadcast(flag, src=0, group=self.group)
        if not int(flag.item()):
            return None
        out = edited.to(like.dtype).contiguous() if self.rank == 0 else torch.empty_like(like)
        dist.broadcast(out, src=0, group=self.group)
        return out


class GatheringHook:
    """The forward hook of one rank in a tensor-parallel step: at each wanted point every rank
    joins the gather, rank 0's hook (``inner``; None on the other ranks) sees the whole tensor,
    and its edit comes back to every rank as that rank's slice.

    An exception from ``inner`` does not leave the other ranks waiting in a collective: it is
    kept (``error``), the point goes on unedited, and the runner raises it once the forward has
    ended on every rank."""

    def __init__(self, inner, wanted: frozenset[str], comms: Collectives):
        self.inner, self.wanted, self.comms = inner, wanted, comms
        self.error: BaseException | None = None

    def wants(self, name: str) -> bool:
        return name in self.wanted

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        if name in RANK0_POINTS:             # rank 0's rows that get logits; the others have none
            return self._inner(name, x)
        dim = shard_dim(name)
        whole = x if dim is None else self.comms.all_gather(x, dim)
        edited = self.comms.broadcast_edit(self._inner(name, whole), whole)
        if edited is None or dim is None:
            return edited
        n = x.shape[dim]
        return edited.narrow(dim, self.comms.rank * n, n).contiguous()

    def _inner(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0's hook at ``name``, its exception kept for after the forward; None elsewhere."""
        if self.inner is None or self.error is not None:
            return None
        try:
            edited = self.inner(name, x)
        except Exception as e:              # raised after the forward, on rank 0
            self.error = e
            return None
        if edited is not None and edited.shape != x.shape:
            self.error = TensorParallelError(f"the hook at {name!r} returned shape {tuple(edited.shape)} for "
                                             f"a tensor of shape {tuple(x.shape)}; a hook returns the same shape")
            return None
        return edited

    def private_requests(self) -> dict[int, str]:
        return self.inner.private_requests() if self.inner is not None else {}
