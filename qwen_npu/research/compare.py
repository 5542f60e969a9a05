"""``qwen_npu.compare(a, b, requests)``: where do two sessions first compute different numbers?

Both sessions run the same requests with captures on (every hook point unless ``names`` says
otherwise). ``a`` runs first with the requests' own sampling; ``b`` is then teacher-forced onto
a's tokens, so every position of b sees the same inputs as in a and every activation stays
comparable even after the two would have picked different tokens. Then, per request, per hook
point and per position computed in both::

    diverges  where  |a - b| > atol + rtol * |b|   (NaN on either side diverges too)

The first divergence is the earliest in a's order of computation: a's step, then the hook point
in forward order (embed, layer 0 ..., final_norm, logits), then request, then position. Since a
layer only depends on earlier layers and earlier positions, that is where to look for the bug.

Typical pairs: NPU kernels vs the reference, batch 16 vs one request at a time (``max_batch``),
bfloat16 vs float32 (raise ``atol``), prefix cache on vs off (positions served from the cache
are not computed and are skipped). Both sessions must be idle; the requests stay in them, finished.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from ..engine.request import PREFILLING, WAITING, SamplingParams
from ..engine.step import check_not_pending
from ..errors import InvalidRequestError
from ..inspect import html as H
from . import hooks
from .capture import Capture


@dataclasses.dataclass(frozen=True)
class Divergence:
    """One place where a and b differ beyond the tolerance."""

    name: str
    layer: int | None
    request: int              # index into the ``requests`` given to compare
    position: int
    step_a: int
    step_b: int
    max_abs_diff: float
    index: tuple[int, ...]    # where in that position's tensor the difference is largest
    a_value: float
    b_value: float

    def __str__(self) -> str:
        where = f"layer {self.layer}, " if self.layer is not None else ""
        return (f"step {self.step_a} (b: step {self.step_b}), {where}{self.name}, request {self.request} position "
                f"{self.position}: max|a-b| = {self.max_abs_diff:.3g} at {list(self.index)} "
                f"(a={self.a_value:.6g}, b={self.b_value:.6g})")


@dataclasses.dataclass(frozen=True)
class DivergenceReport:
    """What ``compare`` found: ``.diverged``, ``.first``, per-name maxima, token disagreements."""

    first: Divergence | None
    firsts: tuple[Divergence, ...]           # the first divergence of every (request, name) that has one
    max_diffs: dict                          # name -> max |a - b| over every compared position
    token_mismatches: tuple[tuple[int, int, int, int], ...]   # (request, position, a's argmax, b's argmax)
    atol: float
    rtol: float
    num_requests: int
    num_positions: int                       # positions compared per name, summed over requests
    skipped_positions: int                   # computed in only one of the two (e.g. prefix-cache hits)
    tokens: tuple[tuple[int, ...], ...]      # a's output tokens per request (b was forced onto them)

    @property
    def diverged(self) -> bool:
        return self.first is not None

    def by_layer(self) -> dict:
        """Largest |a - b| per layer ("embed", 0, 1, ..., "final"): where the error grows."""
        out: dict = {}
        for name, d in self.max_diffs.items():
            layer = _layer(name)
            key = layer if layer is not None else ("embed" if name == "embed" else "final")
            out[key] = max(out.get(key, 0.0), d)
        return out

    def __repr__(self) -> str:
        tol = f"atol={self.atol:g}" + (f", rtol={self.rtol:g}" if self.rtol else "")
        if self.first is None:
            name, worst = max(self.max_diffs.items(), key=lambda kv: kv[1], default=("-", 0.0))
            head = f"DivergenceReport: no divergence beyond {tol} (largest |a-b| {worst:.3g} at {name})"
        else:
            head = f"DivergenceReport: first divergence beyond {tol} at {self.first}"
        layers = ", ".join(f"{k if isinstance(k, str) else 'layer ' + str(k)} {v:.2g}"
                           for k, v in self.by_layer().items())
        lines = [head, f"  compared {self.num_requests} requests, {self.num_positions} positions x "
                       f"{len(self.max_diffs)} names" + (f" ({self.skipped_positions} positions computed in only "
                                                          f"one session, skipped)" if self.skipped_positions else ""),
                 f"  max|a-b| by layer: {layers}"]
        if self.token_mismatches:
            r, p, ta, tb = self.token_mismatches[0]
            lines.append(f"  b's own greedy token differs at {len(self.token_mismatches)} positions; first: request "
                         f"{r} position {p} (a {ta}, b {tb})")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return H.pre(repr(self))


def _layer(name: str) -> int | None:
    m = re.match(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def compare(a, b, requests, *, sampling=None, atol: float = 1e-4, rtol: float = 0.0, names=None) -> DivergenceReport:
    """Run ``requests`` (prompts, or (prompt, SamplingParams) pairs) through sessions ``a`` and
    ``b`` and report where they first differ (see the module docstring)."""
    if atol < 0 or rtol < 0:
        raise InvalidRequestError(f"compare: atol={atol} and rtol={rtol} must be >= 0")
    if a.model_config.num_hidden_layers != b.model_config.num_hidden_layers:
        raise InvalidRequestError(f"compare: a has {a.model_config.num_hidden_layers} layers, b "
                                  f"{b.model_config.num_hidden_layers}: not the same model")
    names = hooks.resolve_names("*" if names is None else names, a.model_config.num_hidden_layers)
    items = _items(requests, sampling)
    for s, which in ((a, "a"), (b, "b")):
        check_not_pending(s.last_step, f"compare (session {which})")
        busy = [r.id for r in s.requests if not r.is_done]
        if busy:
            raise InvalidRequestError(f"compare: session {which} still runs requests {busy}; finish or abort "
                                      f"them first (they would share batches with the compared requests)")
    prepared = [[s._prepare(p, sp) for p, sp in items] for s in (a, b)]
    reqs_a = [a._add(*p) for p in prepared[0]]
    cap_a = _run(a, reqs_a, names)
    tokens = [list(r.output_token_ids) for r in reqs_a]
    reqs_b = [b._add(*p) for p in prepared[1]]
    index = {r.id: k for k, r in enumerate(reqs_b)}
    cap_b = _run(b, reqs_b, names, {r.id: t for r, t in zip(reqs_b, tokens)},
                 too_long=lambda rid, n: f"compare: request {index[rid]} runs longer in b than the {n} tokens it "
                                         f"produced in a")
    return _diff(cap_a, cap_b, reqs_a, reqs_b, names, atol, rtol, tokens)


def _items(requests, sampling):
    if isinstance(requests, (str, torch.Tensor)) or (requests and isinstance(requests[0], int)):
        requests = [requests]
    items = []
    for item in requests:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], (SamplingParams, dict)):
            items.append(item)
        else:
            items.append((item, sampling))
    if not items:
        raise InvalidRequestError("compare: no requests given")
    return items


def _run(sess, reqs, names, forced: dict | None = None, *, also=(), too_long=None) -> Capture:
    """Step ``sess`` until ``reqs`` (captured, ``names``) and ``also`` (run beside them, not
    captured) finish. ``forced``: request id -> the tokens that request must take, in order (the
    others sample their own); ``too_long(request id, n)`` words the error when a forced request
    outgrows its ``n`` tokens."""
    everyone = [*reqs, *also]
    with Capture(sess, names, requests=reqs) as cap:
        while not all(r.is_done for r in everyone):
            if any(r.status in (WAITING, PREFILLING) for r in everyone):
                try:
                    step = sess.prefill()
                except InvalidRequestError:          # nothing admissible now: decode makes room
                    step = sess.decode_step()
            else:
                step = sess.decode_step()
            if step.logits is None:
                continue
            force = {}
            for rid in step.logits_request_ids:
                want = (forced or {}).get(rid)
                if want is None:
                    continue
                done = len(sess.request(rid).output_token_ids)
                if done >= len(want):
                    raise InvalidRequestError(too_long(rid, len(want)))
                force[rid] = want[done]
            sess.sample(step, force=force or None)
    return cap


def _diff(cap_a, cap_b, reqs_a, reqs_b, names, atol, rtol, tokens) -> DivergenceReport:
    order = {n: i for i, n in enumerate(names)}
    firsts, max_diffs, mismatches = [], {n: 0.0 for n in names}, []
    num_positions = skipped = 0
    for k, (ra, rb) in enumerate(zip(reqs_a, reqs_b)):
        for name in names:
            try:
                pa, pb = cap_a.positions(ra, name), cap_b.positions(rb, name)
            except InvalidRequestError:
                continue                                 # nothing of this name computed for k
            common = sorted(set(pa) & set(pb))
            if name == names[0]:
                num_positions += len(common)
                skipped += len(set(pa) ^ set(pb))
            if not common:
                continue
            ia, ib = [pa.index(p) for p in common], [pb.index(p) for p in common]
            xa = cap_a.stack(name, ra)[ia].float()                        # [positions, ...]
            xb = cap_b.stack(name, rb)[ib].float()
            d = (xa - xb).abs().flatten(1)                                # [positions, elements]
            bad = ~(d <= atol + rtol * xb.abs().flatten(1))               # NaN counts as bad
            d = torch.nan_to_num(d, nan=float("inf"))
            per_pos = d.amax(dim=1).cpu()
            max_diffs[name] = max(max_diffs[name], float(per_pos.max()))
            if name == "logits":
                ta, tb = xa.argmax(dim=-1).tolist(), xb.argmax(dim=-1).tolist()
                mismatches += [(k, p, x, y) for p, x, y in zip(common, ta, tb) if x != y]
            rows = bad.any(dim=1).nonzero().flatten().tolist()
            if rows:
                j = rows[0]
                flat = int(d[j].argmax())
                idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), xa.shape[1:]))
                firsts.append(Divergence(
                    name, _layer(name), k, common[j], cap_a.steps_of(ra, name)[ia[j]],
                    cap_b.steps_of(rb, name)[ib[j]], float(d[j, flat]), idx,
                    float(xa[j].flatten()[flat]), float(xb[j].flatten()[flat])))
    firsts.sort(key=lambda f: (f.step_a, order[f.name], f.request, f.position))
    return DivergenceReport(firsts[0] if firsts else None, tuple(firsts), max_diffs, tuple(mismatches),
                            float(atol), float(rtol), len(reqs_a), num_positions, skipped,
                            tuple(tuple(t) for t in tokens))
