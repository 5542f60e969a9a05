"""Direct logit attribution: how much each head, MLP and the embedding write straight into one
logit (or a logit difference) at one position of one request.

The residual stream before the final norm is a sum of what every part wrote::

    r = embed + sum_layers( sum_heads z_h @ O_h^T  +  mlp.out )      O_h: o_proj columns of head h

and the logit of token t is W_U[t] . (w * r / rms(r)) with w the final norm's weight. Freezing
rms(r) at its value for this position makes that linear, so each part gets

    dla(part) = (W_U[t] - W_U[b]) . (w * part / rms(r))          (b: the baseline token, if any)

and the parts sum to the actual logit difference (``total`` vs ``actual``; float32). Needs a
capture of "embed", "layers.*.attn.z", "layers.*.mlp.out" and the last layer's "residual" that
covers the position: ``sess.capture(DLA_NAMES)``.
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import InvalidRequestError
from ..inspect import html as H
from ..model.qwen3 import dense_weight

DLA_NAMES = ("embed", "layers.*.attn.z", "layers.*.mlp.out", "layers.*.residual")


@dataclasses.dataclass(frozen=True)
class LogitAttribution:
    """Direct contributions to ``logit[target] - logit[baseline]`` at one position (float32, host)."""

    request_id: int
    position: int
    target: int
    baseline: int | None
    embed: float
    heads: torch.Tensor          # [layers, heads]
    mlp: torch.Tensor            # [layers]
    actual: float                # the logit difference the model produced from r
    metric: str = ""             # "logit[t 'text'] - logit[b 'text']" (``metric_name``)

    @property
    def attn(self) -> torch.Tensor:
        """[layers] the heads of each layer together."""
        return self.heads.sum(-1)

    @property
    def total(self) -> float:
        return self.embed + float(self.heads.sum()) + float(self.mlp.sum())

    def table(self) -> list[tuple[str, float]]:
        """(part, contribution) for the embedding and each layer's attention and MLP, forward order."""
        rows = [("embed", self.embed)]
        for i in range(self.mlp.shape[0]):
            rows += [(f"layers.{i}.attn", float(self.attn[i])), (f"layers.{i}.mlp", float(self.mlp[i]))]
        return rows

    def plot(self):
        """Heat map layers x heads of the per-head contributions (diverging, centred on 0)."""
        from ..inspect.plots import NotebookFigure
        lim = float(self.heads.abs().max()) or 1.0
        fig = NotebookFigure(figsize=(1.5 + 0.5 * self.heads.shape[1], 0.9 + 0.35 * self.heads.shape[0]),
                             layout="constrained")
        ax = fig.subplots()
        im = ax.imshow(self.heads.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(self.heads.shape[1]))
        ax.set_yticks(range(self.heads.shape[0]))
        fig.colorbar(im, ax=ax, label="direct logit contribution")
        fig.suptitle(f"request {self.request_id}, position {self.position}: {self._what()}", fontsize=10)
        return fig

    def _what(self) -> str:
        return self.metric or metric_name(None, self.target, self.baseline)

    def __repr__(self) -> str:
        h = self.heads
        flat = [(abs(float(h[i, j])), i, j) for i in range(h.shape[0]) for j in range(h.shape[1])]
        top = ", ".join(f"L{i}H{j} {float(h[i, j]):+.3f}" for _, i, j in sorted(flat, reverse=True)[:4])
        lines = [f"LogitAttribution(request {self.request_id}, position {self.position}, {self._what()}: "
                 f"parts sum to {self.total:+.4f}, model {self.actual:+.4f}; largest heads {top})",
                 H.text_table(["part", "contribution"], [(n, f"{v:+.4f}") for n, v in self.table()])]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = [(H.esc(n), H.esc(f"{v:+.4f}")) for n, v in self.table()]
        return H.view(f"Direct logit attribution: {self._what()}", H.table(["part", "contribution"], rows),
                      subtitle=f"request {self.request_id}, position {self.position}; parts sum to "
                               f"{self.total:+.4f}, model {self.actual:+.4f}")


def direct_logit_attribution(sess, cap, request, target: int, baseline: int | None = None, *,
                             position: int = -1) -> LogitAttribution:
    """Per-head and per-MLP direct contributions (see module docstring) from ``cap``."""
    from ..parallel.group import refuse_with_ranks
    refuse_with_ranks(sess._engine, "direct_logit_attribution (it reads every head's o_proj)")
    model, c = sess.model, sess.model_config
    rid = getattr(request, "id", request)
    for t in (target, baseline):
        if t is not None and (not isinstance(t, int) or not 0 <= t < c.vocab_size):
            raise InvalidRequestError(f"direct_logit_attribution: token {t!r} is outside the vocabulary "
                                      f"[0, {c.vocab_size})")
    last = f"layers.{c.num_hidden_layers - 1}.residual"
    needed = ["embed", last] + [f"layers.{i}.{p}" for i in range(c.num_hidden_layers)
                                for p in ("attn.z", "mlp.out")]
    missing = [n for n in needed if n not in cap.names]
    if missing:
        raise InvalidRequestError(f"direct_logit_attribution needs a capture of {list(DLA_NAMES)}; "
                                  f"this one lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    have = cap.positions(rid, last)
    pos = have[position] if position < 0 and -len(have) <= position else position
    if pos not in have:
        raise InvalidRequestError(f"position {position} of request {rid} is not in the capture "
                                  f"(it holds {have})")

    def at(name):
        return cap.stack(name, rid)[cap.positions(rid, name).index(pos)].float().to(model.device)

    r = at(last)                                                               # [hidden]
    rms = torch.sqrt(r.pow(2).mean() + c.rms_norm_eps)
    direction = model.lm_head[target].float()
    if baseline is not None:
        direction = direction - model.lm_head[baseline].float()
    d = direction * model.norm.float() / rms                                   # [hidden]
    heads, mlp = [], []
    hd = c.head_dim
    for i, layer in enumerate(model.layers):
        z = at(f"layers.{i}.attn.z")                                           # [heads, hd]
        o = dense_weight(layer.o).float().reshape(c.hidden_size, c.num_attention_heads, hd)  # [hidden, heads, hd]
        heads.append(torch.einsum("hd,nhd,n->h", z, o, d))
        mlp.append(at(f"layers.{i}.mlp.out") @ d)
    actual = float(unembed_diff(model, r, target, baseline))
    return LogitAttribution(rid, pos, target, baseline, float(at("embed") @ d), torch.stack(heads).cpu(),
                            torch.stack(mlp).cpu(), actual, metric_name(sess.tokenizer, target, baseline))


def metric_name(tokenizer, target: int, baseline: int | None) -> str:
    """``logit[t] - logit[b]``, each id followed by its text where a tokenizer can decode it."""
    def logit(token: int) -> str:
        text = f" {tokenizer.decode([token])!r}" if tokenizer is not None else ""
        return f"logit[{token}{text}]"
    return logit(target) + (f" - {logit(baseline)}" if baseline is not None else "")


def unembed_diff(model, r: torch.Tensor, target: int, baseline: int | None) -> torch.Tensor:
    from .lens import unembed
    logits = unembed(model, r[None])[0]
    return logits[target] - (logits[baseline] if baseline is not None else 0)
