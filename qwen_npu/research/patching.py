"""Activation patching: which activation, at which position (and head), carries the difference
between a clean and a corrupted prompt?

    res = activation_patching(sess, clean, corrupted, target=t, baseline=b, names="layers.*.residual")
    res.effects          # [names, positions] (or [names, heads, positions]) metric of each patched run
    res.restored         # (effect - corrupted) / (clean - corrupted): 1 = the patch restores the clean answer
    res.table(), res.plot()

The metric is ``logit[target] - logit[baseline]`` (or ``logit[target]``) at the prompt's last
position. Steps: run the clean prompt once with a capture of ``names``; run the corrupted prompt
once; then for each name, position (and head, with ``heads=True`` on a per-head point: attn.q,
k, v, z, q_pre_rope, k_pre_rope) run the corrupted prompt again with that one slice replaced by
its clean value (``sess.intervene``). The prompts must have the same length. Each run is one
request of ``max_new_tokens=1`` prefilled on its own (other requests of the session wait); the
prefix cache reuses the corrupted prompt's K/V before the patched position and never keeps a
patched run's K/V (see intervene.py).
"""
from __future__ import annotations

import dataclasses

import torch

from ..engine.request import SamplingParams
from ..engine.step import check_not_pending
from ..errors import InvalidRequestError
from ..inspect import html as H
from . import hooks
from .attribution import metric_name

HEAD_POINTS = ("attn.q", "attn.k", "attn.v", "attn.z", "attn.q_pre_rope", "attn.k_pre_rope")


@dataclasses.dataclass(frozen=True)
class PatchingResult:
    """The metric of every patched run (see module docstring); tensors on the host."""

    names: tuple[str, ...]
    positions: tuple[int, ...]
    heads: tuple[int, ...] | None
    effects: torch.Tensor                 # [names, positions] or [names, heads, positions]
    clean_metric: float
    corrupted_metric: float
    metric: str

    @property
    def restored(self) -> torch.Tensor:
        """Fraction of the clean-vs-corrupted gap each patch restores (same shape as ``effects``)."""
        gap = self.clean_metric - self.corrupted_metric
        return (self.effects - self.corrupted_metric) / (gap if gap != 0 else float("nan"))

    def table(self) -> list[tuple[str, int | None, int, float, float]]:
        """(name, head or None, position, metric, restored) of every patched run."""
        rows, rest = [], self.restored
        for i, n in enumerate(self.names):
            for h in (self.heads or [None]):
                for j, p in enumerate(self.positions):
                    idx = (i, j) if self.heads is None else (i, self.heads.index(h), j)
                    rows.append((n, h, p, float(self.effects[idx]), float(rest[idx])))
        return rows

    def plot(self):
        """Heat map of ``restored``: names (or name/head) down, positions across."""
        from ..inspect.plots import NotebookFigure
        grid = self.restored if self.heads is None else self.restored.flatten(0, 1)
        labels = (list(self.names) if self.heads is None
                  else [f"{n} h{h}" for n in self.names for h in self.heads])
        fig = NotebookFigure(figsize=(min(1.6 + 0.45 * len(self.positions), 14), 0.9 + 0.3 * len(labels)),
                             layout="constrained")
        ax = fig.subplots()
        im = ax.imshow(grid.numpy(), cmap="RdBu_r", vmin=-1.0, vmax=1.0, aspect="auto")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xticks(range(len(self.positions)), [str(p) for p in self.positions], fontsize=7)
        ax.set_xlabel("patched position")
        fig.colorbar(im, ax=ax, label="restored fraction", shrink=0.9)
        fig.suptitle(f"activation patching: {self.metric}", fontsize=10)
        return fig

    def _top(self, n: int = 12):
        return sorted(self.table(), key=lambda r: -abs(r[4]) if r[4] == r[4] else 0)[:n]

    def __repr__(self) -> str:
        runs = self.effects.numel()
        head = (f"PatchingResult({self.metric}: clean {self.clean_metric:+.3f}, corrupted {self.corrupted_metric:+.3f}; "
                f"{runs} patched runs over {len(self.names)} names x {len(self.positions)} positions"
                f"{f' x {len(self.heads)} heads' if self.heads else ''})")
        rows = [(n, "" if h is None else h, p, f"{m:+.3f}", f"{r:+.3f}") for n, h, p, m, r in self._top()]
        return head + "\n" + H.text_table(["name", "head", "position", "metric", "restored"], rows)

    def _repr_html_(self) -> str:
        rows = [(H.esc(n), H.esc("" if h is None else h), H.esc(p), H.esc(f"{m:+.3f}"), H.esc(f"{r:+.3f}"))
                for n, h, p, m, r in self._top()]
        return H.view("Activation patching", H.table(["name", "head", "position", "metric", "restored"], rows),
                      subtitle=f"{self.metric}: clean {self.clean_metric:+.3f}, corrupted {self.corrupted_metric:+.3f}"
                               f"; largest {len(rows)} of {self.effects.numel()} runs")


def activation_patching(sess, clean, corrupted, target: int, baseline: int | None = None, *,
                        names="layers.*.residual", positions=None, heads: bool = False) -> PatchingResult:
    """Patch each of ``names`` (x ``positions``, x heads) from the clean run into the corrupted one."""
    check_not_pending(sess.last_step, "patch activations")
    clean_ids, _, _ = sess._prepare(clean, SamplingParams(max_new_tokens=1))
    bad_ids, _, _ = sess._prepare(corrupted, SamplingParams(max_new_tokens=1))
    if len(clean_ids) != len(bad_ids):
        raise InvalidRequestError(f"activation_patching: the clean prompt has {len(clean_ids)} tokens and the "
                                  f"corrupted one {len(bad_ids)}; patching needs equal lengths")
    vocab = sess.model_config.vocab_size
    for t in (target, baseline):
        if t is not None and (not isinstance(t, int) or not 0 <= t < vocab):
            raise InvalidRequestError(f"activation_patching: token {t!r} is outside the vocabulary "
                                      f"[0, {vocab})")
    names = hooks.resolve_names(names, sess.model_config.num_hidden_layers)
    odd = [n for n in names if n in hooks.ROW_NAMES or n.endswith(".attn.scores")]
    if odd:
        raise InvalidRequestError(f"activation_patching patches per-token points; {odd[0]!r} is not one")
    per_head = [n for n in names if n.split(".", 2)[-1] in HEAD_POINTS]
    if heads and len(per_head) != len(names):
        raise InvalidRequestError(f"heads=True needs per-head points ({', '.join(HEAD_POINTS)}); "
                                  f"{sorted(set(names) - set(per_head))[:3]} are not")
    n = len(clean_ids)
    if positions is None:
        positions = list(range(n))
    positions = [positions] if isinstance(positions, int) else list(positions)
    if not positions or any(not isinstance(p, int) or not 0 <= p < n for p in positions):
        raise InvalidRequestError(f"activation_patching: positions={positions!r}; choose ints in 0..{n - 1}")

    def prefill_metric(req) -> float:
        """Prefill ``req`` to its logits; the metric of its last position."""
        step = sess.prefill(requests=[req])
        while step.logits is None or req.id not in step.logits_request_ids:
            step = sess.prefill(requests=[req])
        row = step.logits.tensor[step.logits_request_ids.index(req.id)].float()
        return float(row[target] - (row[baseline] if baseline is not None else 0))

    def run(ids, edit=None):
        req = sess.add_request(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))
        ctx = sess.intervene(edit[0], edit[1], requests=[req], positions=[edit[2]]) if edit else None
        if ctx is not None:
            ctx.__enter__()
        try:
            value = prefill_metric(req)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
            if sess.last_step is not None and not sess.last_step.sampled:
                sess.sample()
            if not req.is_done:
                sess.abort(req)
        return value, req

    req = sess.add_request(clean_ids, SamplingParams(max_new_tokens=1, ignore_eos=True))
    with sess.capture(names, requests=[req]) as cap:
        clean_metric = prefill_metric(req)
        sess.sample()
    stacks = {name: cap.stack(name, req) for name in names}
    corrupted_metric, _ = run(bad_ids)
    head_ids = tuple(range(sess.model_config.num_attention_heads)) if heads else None
    effects = []
    for name in names:
        clean_x = stacks[name]
        per = []
        for h in (head_ids or [None]):
            row_vals = []
            for p in positions:
                row_vals.append(run(bad_ids, (name, _patch(clean_x[p], h), p))[0])
            per.append(row_vals)
        effects.append(per if heads else per[0])
    return PatchingResult(tuple(names), tuple(positions), head_ids, torch.tensor(effects, dtype=torch.float32),
                          clean_metric, corrupted_metric, metric_name(sess.tokenizer, target, baseline))


def _patch(value: torch.Tensor, head: int | None):
    """An edit that puts the clean ``value`` (one position) in place, whole or for one head."""
    def patch_(x):
        v = value.to(device=x.device, dtype=x.dtype)
        if head is None:
            x[:] = v
        else:
            x[:, head] = v[head]
    return patch_
