"""Logit lens: the final norm and the LM head applied to any captured residual-stream tensor.

    lens = logit_lens(sess, cap, request, names="layers.*.residual", k=5)
    lens.logits("layers.1.residual")      # [positions, vocab] float32: what layer 1 "predicts"
    lens.top_ids, lens.top_probs          # [names, positions, k]
    lens.prob(token), lens.rank(token)    # [names, positions]

Every position the capture holds for the request counts, prompt positions too (capture the
prefill). The norm is the model's final RMSNorm with its kernels and the head its LM head, so
the lens of the last layer's "residual" at a row's last token is exactly that row's logits.
Any [tokens, hidden] point works: "embed", "layers.{i}.resid_pre", ".resid_mid", ".residual",
".attn.out", ".mlp.out".
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..errors import InvalidRequestError
from ..inspect import html as H
from . import hooks


def unembed(model, resid: torch.Tensor) -> torch.Tensor:
    """[..., hidden] -> [..., vocab] float32: final RMSNorm then LM head, as the forward does."""
    x = resid.to(device=model.device, dtype=model.dtype)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    h = model.kernels.rms_norm(flat, model.norm, model.config.rms_norm_eps)
    return F.linear(h, model.lm_head).float().reshape(*x.shape[:-1], -1)


@dataclasses.dataclass(frozen=True)
class LogitLens:
    """The lens of one request (see module docstring); tensors on the host."""

    request_id: int
    names: tuple[str, ...]
    positions: tuple[int, ...]
    tokens: tuple[str, ...]              # the token at each position (string, or id without a tokenizer)
    top_ids: torch.Tensor                # [names, positions, k] int64
    top_probs: torch.Tensor              # [names, positions, k] float32 (softmax of the lens logits)
    residuals: torch.Tensor              # [names, positions, hidden] as captured
    _model: object = dataclasses.field(repr=False, compare=False)
    _labels: object = dataclasses.field(repr=False, compare=False)

    def logits(self, name: str) -> torch.Tensor:
        """[positions, vocab] float32 lens logits of one name."""
        return unembed(self._model, self.residuals[self._index(name)]).cpu()

    def _index(self, name: str) -> int:
        if name not in self.names:
            raise InvalidRequestError(f"{name!r} is not in this lens (names {list(self.names)})")
        return self.names.index(name)

    def prob(self, token: int) -> torch.Tensor:
        """[names, positions] probability the lens gives ``token``."""
        return torch.stack([torch.softmax(self.logits(n), -1)[:, token] for n in self.names])

    def rank(self, token: int) -> torch.Tensor:
        """[names, positions] rank of ``token`` (0 = the lens' top prediction)."""
        out = []
        for n in self.names:
            lg = self.logits(n)
            out.append((lg > lg[:, token:token + 1]).sum(-1))
        return torch.stack(out)

    def plot(self, token: int | None = None):
        """Heat map names x positions of the top-1 probability (or of ``token``'s), labelled with
        the top-1 token; a matplotlib Figure."""
        from ..inspect.plots import NotebookFigure, token_label
        vals = self.top_probs[..., 0] if token is None else self.prob(token)
        fig = NotebookFigure(figsize=(min(1.0 + 0.55 * len(self.positions), 14), 0.8 + 0.35 * len(self.names)),
                             layout="constrained")
        ax = fig.subplots()
        im = ax.imshow(vals.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        for i in range(len(self.names)):
            for j in range(len(self.positions)):
                ax.text(j, i, token_label(self._labels(int(self.top_ids[i, j, 0])), quotes=False), ha="center", va="center", fontsize=6,
                        color="white" if vals[i, j] < 0.5 else "black")
        ax.set_yticks(range(len(self.names)), self.names, fontsize=7)
        ax.set_xticks(range(len(self.positions)), [f"{p}:{token_label(t, quotes=False)}" for p, t in zip(self.positions, self.tokens)],
                      rotation=90, fontsize=7)
        fig.colorbar(im, ax=ax, label="top-1 probability" if token is None else f"p(token {token})")
        fig.suptitle(f"request {self.request_id}: logit lens", fontsize=10)
        return fig

    def _rows(self, k: int = 3):
        for i, n in enumerate(self.names):
            for j, p in enumerate(self.positions):
                tops = ", ".join(f"{self._labels(int(t))!r} {float(q):.2f}"
                                 for t, q in zip(self.top_ids[i, j, :k], self.top_probs[i, j, :k]))
                yield n, f"{p}:{self.tokens[j]!r}", tops

    def __repr__(self) -> str:
        rows = list(self._rows())
        head = (f"LogitLens(request {self.request_id}: {len(self.names)} names x {len(self.positions)} positions, "
                f"top {self.top_ids.shape[-1]})")
        shown = rows[:24]
        more = f"\n  ... and {len(rows) - 24} more rows" if len(rows) > 24 else ""
        return head + "\n" + H.text_table(["name", "position", "top predictions"], shown) + more

    def _repr_html_(self) -> str:
        rows = [(H.esc(n), H.esc(p), H.esc(t)) for n, p, t in list(self._rows())[:64]]
        return H.view(f"Logit lens of request {self.request_id}", H.table(["name", "position", "top predictions"], rows),
                      subtitle=f"{len(self.names)} names x {len(self.positions)} positions")


def logit_lens(sess, cap, request, *, names="layers.*.residual", positions=None, k: int = 5) -> LogitLens:
    """The lens of ``request`` over the [tokens, hidden] points ``names`` that ``cap`` captured."""
    rid = getattr(request, "id", request)
    names = [n for n in hooks.resolve_names(names, sess.model_config.num_hidden_layers) if n in cap.names]
    wide = [n for n in names if n in hooks.ROW_NAMES or ".attn." in n and not n.endswith(".out")
            or n.endswith(".mlp.act") or n.endswith(".mlp.in")]
    if wide or not names:
        raise InvalidRequestError(f"logit_lens needs captured residual-stream points ([tokens, hidden]: embed, "
                                  f"resid_pre, resid_mid, residual, attn.out, mlp.out); got {wide or 'none captured'}")
    if not isinstance(k, int) or k < 1:
        raise InvalidRequestError(f"logit_lens: k={k!r}, choose an int >= 1")
    common = sorted(set.intersection(*(set(cap.positions(rid, n)) for n in names)))
    if positions is None:
        chosen = common
    else:
        chosen = sorted({positions} if isinstance(positions, int) else set(positions))
    missing = sorted(set(chosen) - set(common))
    if missing or not chosen:
        raise InvalidRequestError(f"positions {missing or chosen} of request {rid} are not in the capture "
                                  f"(it holds {common})")
    resid = torch.stack([_rows(cap, n, rid, chosen) for n in names])         # [names, positions, hidden]
    logits = unembed(sess.model, resid)
    probs, ids = torch.softmax(logits, -1).topk(min(k, logits.shape[-1]), dim=-1)
    tok = sess.tokenizer
    labels = (lambda t: tok.token_str(t)) if tok is not None else str
    token_ids = sess.request(rid).all_token_ids
    return LogitLens(rid, tuple(names), tuple(chosen), tuple(labels(token_ids[p]) for p in chosen),
                     ids.cpu(), probs.cpu(), resid, sess.model, labels)


def _rows(cap, name: str, rid: int, chosen: list[int]) -> torch.Tensor:
    have = cap.positions(rid, name)
    index = [have.index(p) for p in chosen]
    return cap.stack(name, rid)[index]
