"""``sess.audit(request)``: recompute one request's K/V from its tokens and compare with its slots.

The request's computed tokens ``0..n-1`` run through the model again in ONE prefill row over a
scratch cache of their own (a fresh KVCache whose block table is simply ``[0, 1, 2, ...]``)::

    session cache   table [7, 2, 9]   pos 0..3 -> slots 28..31, pos 4..7 -> 8..11, pos 8.. -> 36..
    scratch cache   table [0, 1, 2]   pos p    -> slot p

so every K/V it produces depends only on the tokens, never on what the session's cache holds.
Then, per layer and per position, ``max |cached - recomputed|`` over heads and dims, for K and for
V, is compared with a tolerance. The session's cache, ledger, step counter and history are not
touched; the scratch cache lives only for the call.

Tolerance: ``tol * max(1, max |recomputed|)`` per layer and K/V, with ``tol`` 1e-5 in float32
(chunked prefill, decode and one-pass prefill sum in different orders; on the tiny test models
they agree to about 1e-6) and 8 machine epsilons in lower precision (0.0625 in bfloat16, about
0.008 in float16), where every operation rounds to 8 or 11 bits. A lost or torn write (zeros,
NaN, another token's K/V) is off by the size of the values themselves, far above either.
"""
from __future__ import annotations

import dataclasses

import torch

from ..cache.kv_cache import KVCache
from ..engine.recompute import recompute_kv
from ..errors import InvalidRequestError

SHOWN = 20


def default_tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype in (torch.float32, torch.float64) else 8 * torch.finfo(dtype).eps


@dataclasses.dataclass(frozen=True)
class LayerAudit:
    """One layer: the largest |cached - recomputed| over the request's positions, for K and V."""

    layer: int
    key_max_diff: float
    value_max_diff: float
    key_tol: float
    value_tol: float
    worst_position: int        # where the larger excess over its tolerance is

    @property
    def ok(self) -> bool:
        return self.key_max_diff <= self.key_tol and self.value_max_diff <= self.value_tol


@dataclasses.dataclass(frozen=True)
class AuditMismatch:
    """One cached token that disagrees with the recomputation beyond tolerance."""

    layer: int
    kind: str                  # "key" | "value"
    position: int
    slot: int
    block: int
    offset: int
    max_diff: float            # inf when the cached or recomputed value is not finite
    tol: float

    def __str__(self) -> str:
        return (f"layer {self.layer} {self.kind}, position {self.position}: slot {self.slot} (block {self.block}, "
                f"offset {self.offset}) differs from the recomputation by {self.max_diff:.3g} (tolerance "
                f"{self.tol:.3g})")


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """``.ok``, ``.layers`` (per-layer max |diff|), ``.mismatches`` (sorted by position, layer, K before V)."""

    request_id: int
    num_tokens: int
    dtype: str
    layers: tuple[LayerAudit, ...]
    mismatches: tuple[AuditMismatch, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def first(self) -> AuditMismatch | None:
        """The earliest corrupted token (lowest position, then layer): where to look first."""
        return self.mismatches[0] if self.mismatches else None

    @property
    def problems(self) -> tuple[str, ...]:
        return tuple(f"request {self.request_id}: {m}" for m in self.mismatches)

    @property
    def max_diff(self) -> float:
        return max((max(l.key_max_diff, l.value_max_diff) for l in self.layers), default=0.0)

    def _lines(self) -> list[str]:
        state = "ok" if self.ok else f"{len(self.mismatches)} mismatches"
        lines = [f"AuditReport(request {self.request_id}, {self.num_tokens} tokens, {self.dtype}): {state}"]
        for l in self.layers:
            mark = "ok " if l.ok else "BAD"
            lines.append(f"  {mark} layer {l.layer}: max|dK| {l.key_max_diff:.3g} (tol {l.key_tol:.2g}), "
                         f"max|dV| {l.value_max_diff:.3g} (tol {l.value_tol:.2g})")
        lines += [f"  - {m}" for m in self.mismatches[:SHOWN]]
        if len(self.mismatches) > SHOWN:
            lines.append(f"  ... and {len(self.mismatches) - SHOWN} more (see .mismatches)")
        return lines

    def __repr__(self) -> str:
        return "\n".join(self._lines())

    def _repr_html_(self) -> str:
        from .report_views import audit_html
        return audit_html(self)


def audit_request(kv, model, request, tol: float | None = None) -> AuditReport:
    """Audit a running ``request`` (Request or id) of the cache behind ``kv`` (a KVView).

    Refuses, with InvalidRequestError and before any work, a request that holds no computed token.
    """
    req = kv._request(request)
    n = req.num_computed_tokens
    if not n:
        raise InvalidRequestError(f"request {req.id} is {req.status} with no computed tokens: nothing to audit")
    kv.slot_of(req, n - 1)                               # refuses requests whose blocks were freed
    engine = kv._engine
    if engine.parallel is not None:
        return audit_parallel(engine, model, req.id, req.all_token_ids[:n], engine.manager.block_table(req.id), tol)
    return audit_kv(model, engine.kv_cache, req.id, req.all_token_ids[:n], engine.manager.block_table(req.id), tol)


def audit_parallel(engine, model, request_id: int, token_ids: list[int], block_table: list[int],
                   tol: float | None = None) -> AuditReport:
    """``audit_kv`` across the ranks of a tensor-parallel engine: every rank recomputes the
    prompt on its shard in lockstep (the recomputation's collectives join them), and the cached
    and recomputed K/V of every rank's heads are compared as one model's."""
    group, kv_cache, bs = engine.parallel, engine.kv_cache, engine.kv_cache.block_size
    slots = [block_table[p // bs] * bs + p % bs for p in range(len(token_ids))]
    with group.exchange("audit"):                 # the ranks recompute in lockstep: whole or not at all
        group.send_all("audit", (list(token_ids), bs))
        try:
            scratch = recompute_kv(model, token_ids, bs)
        except Exception as e:
            raise group.lost_during(f"the recomputation of request {request_id} for its audit", e) from e
        theirs = group.collect("audit")
    k0, v0 = scratch.rows(range(scratch.num_layers), range(len(token_ids)))
    want = (torch.cat([k0.cpu()] + [t[0] for t in theirs], dim=2), torch.cat([v0.cpu()] + [t[1] for t in theirs], dim=2))
    got = engine.kv_rows(range(kv_cache.num_layers), slots)
    return compare_kv(request_id, got, want, slots, bs, kv_cache.keys[0].dtype, tol)


def audit_kv(model, kv_cache: KVCache, request_id: int, token_ids: list[int], block_table: list[int],
             tol: float | None = None) -> AuditReport:
    """Compare the cached K/V of ``token_ids`` (held in ``block_table``) with a recomputation."""
    n, bs = len(token_ids), kv_cache.block_size
    slots = [block_table[p // bs] * bs + p % bs for p in range(n)]
    scratch = recompute_kv(model, token_ids, bs)
    layers = range(kv_cache.num_layers)
    return compare_kv(request_id, kv_cache.rows(layers, slots), scratch.rows(layers, range(n)), slots, bs,
                      kv_cache.keys[0].dtype, tol)


def compare_kv(request_id: int, got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
               slots: list[int], bs: int, dtype: torch.dtype, tol: float | None) -> AuditReport:
    """The AuditReport of cached (``got``) against recomputed (``want``) K/V, each (k, v)
    [layers, n, kv_heads, head_dim], of the positions held in ``slots``."""
    tol = default_tolerance(dtype) if tol is None else float(tol)
    cached, ref = torch.cat(got).float(), torch.cat(want).float().to(got[0].device)   # [2 * layers, n, kvh, hd]
    d = torch.nan_to_num((cached - ref).abs().flatten(2).amax(dim=2), nan=float("inf"))   # [2 * layers, n]
    d_host = d.cpu()
    s_host = ref.abs().flatten(1).amax(dim=1).cpu()                                       # [2 * layers]
    num_layers = got[0].shape[0]
    layers, found = [], []
    for layer in range(num_layers):
        tols = [tol * max(1.0, float(s_host[layer + k * num_layers])) for k in (0, 1)]
        rows = [d_host[layer + k * num_layers] for k in (0, 1)]
        excess = torch.stack([rows[k] - tols[k] for k in (0, 1)]).amax(dim=0)  # [n]
        layers.append(LayerAudit(layer, float(rows[0].max()), float(rows[1].max()), tols[0], tols[1],
                                 int(excess.argmax())))
        for k, kind in enumerate(("key", "value")):
            for p in (rows[k] > tols[k]).nonzero().flatten().tolist():
                s = slots[p]
                found.append(AuditMismatch(layer, kind, p, s, s // bs, s % bs, float(rows[k][p]), tols[k]))
    found.sort(key=lambda m: (m.position, m.layer, m.kind != "key"))
    return AuditReport(request_id, len(slots), str(dtype).removeprefix("torch."), tuple(layers), tuple(found))
