"""Matplotlib figures of a session's history and cache. Each function returns a new Figure and
never calls ``plt.show``; the figure is not registered with pyplot (no global state, nothing left
open), a notebook shows it as PNG, and ``fig.savefig(path)`` writes it.

    plot_cache_occupancy(sess)      used / cached / free blocks after every step (stacked areas)
    plot_rows_per_step(sess)        active and padding rows per step, with the max_batch line
    plot_step_timings(sess)         seconds per step, stacked by phase (schedule, forward, ...)
    plot_topk(step, request_id)     top-k next-token probabilities of one logits row (bars)
    plot_kv_norms(sess, request)    |K| and |V| by layer and position of one request (images)

``history`` arguments accept a Session (its ``history``) or any sequence of StepResults.
"""
from __future__ import annotations

import functools
import io

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..errors import InvalidRequestError
from . import html as h

PHASES = ("schedule", "check", "prepare", "forward", "bookkeeping", "sample")
STATE_COLORS = {"used": "#0969da", "cached": h.CACHED_BG, "free": "#f6f8fa"}


class NotebookFigure(Figure):
    """A Figure outside pyplot's registry that a notebook shows as PNG without any magic."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100)
        return buf.getvalue()


MISSING_GLYPH = "\u25a1"       # a white square, drawn for a character the plot font cannot show


def token_label(text: str, *, quotes: bool = True) -> str:
    """A token's text for a plot label: escaped like repr (a newline reads ``\\n``), quoted unless
    ``quotes=False``, each character the plot font has no glyph for drawn as a white square
    (never as an escaped code point such as ``\\ufffd``)."""
    shown = repr(text) if quotes else repr(text)[1:-1]
    return "".join(c if c in "'\\" or c.isprintable() and _has_glyph(c) else MISSING_GLYPH for c in shown)


_GLYPHS: dict[str, bool] = {}


def _has_glyph(char: str) -> bool:
    """Does matplotlib's default font draw ``char``? (Cached; ASCII always does.)"""
    if char.isascii():
        return True
    if char not in _GLYPHS:
        _GLYPHS[char] = _default_font().get_char_index(ord(char)) != 0
    return _GLYPHS[char]


@functools.cache
def _default_font():
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font
    return FT2Font(font_manager.findfont(font_manager.FontProperties()))


def _figure(width: float = 7.0, height: float = 3.0, ncols: int = 1):
    fig = NotebookFigure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(1, ncols)


def _legend(ax, **kw) -> None:
    """The legend right of the axes, where it never hides a bar."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kw)


def _steps(history) -> list:
    steps = list(history.history if hasattr(history, "history") else history)
    if not steps:
        raise InvalidRequestError("nothing to plot: no step has run yet")
    return steps


def plot_cache_occupancy(history):
    """Blocks used, cached and free after each step (from ``StepResult.cache_usage``)."""
    steps = [s for s in _steps(history) if getattr(s, "cache_usage", None)]
    if not steps:
        raise InvalidRequestError("these steps carry no cache_usage to plot")
    fig, ax = _figure()
    x = [s.index for s in steps]
    names = ("used", "cached", "free")
    ys = [[s.cache_usage.get(n, 0) for s in steps] for n in names]
    ax.stackplot(x, *ys, labels=names, colors=[STATE_COLORS[n] for n in names], step="mid",
                 edgecolor="#57606a", linewidth=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("blocks")
    ax.set_title("KV cache occupancy after each step")
    ax.set_ylim(0, sum(y[0] for y in ys))
    _legend(ax)
    return fig


def plot_rows_per_step(history, max_batch: int | None = None):
    """Rows dispatched per step: active rows (by kind) and replicate-padding rows on top."""
    steps = _steps(history)
    if max_batch is None and hasattr(history, "config"):
        max_batch = history.config.max_batch
    fig, ax = _figure()
    x = [s.index for s in steps]
    active = [s.num_active for s in steps]
    padding = [s.batch_size - s.num_active for s in steps]
    palette = {"prefill": "#0969da", "decode": "#1a7f37", "mixed": "#8250df"}
    colors = [palette.get(s.kind, "#1a7f37") for s in steps]
    ax.bar(x, active, color=colors)
    handles = [Patch(color="#0969da", label="prefill rows"), Patch(color="#1a7f37", label="decode rows")]
    if any(s.kind == "mixed" for s in steps):
        handles.append(Patch(color="#8250df", label="mixed steps (decode + prefill rows)"))
    padded = [i for i, n in enumerate(padding) if n]
    if padded:
        handles.append(ax.bar([x[i] for i in padded], [padding[i] for i in padded],
                              bottom=[active[i] for i in padded], color="#ffebe9", edgecolor="#cf222e",
                              hatch="///", label="padding rows"))
    if max_batch:
        handles.append(ax.axhline(max_batch, color="#57606a", linestyle="--", linewidth=1,
                                  label=f"max_batch {max_batch}"))
    _legend(ax, handles=handles)
    ax.set_xlabel("step")
    ax.set_ylabel("rows")
    ax.set_title("Rows per step (a partial decode batch dispatches fewer rows)")
    return fig


def plot_step_timings(history, phases=PHASES):
    """Seconds per step, one stacked bar per step, split by phase."""
    steps = _steps(history)
    fig, ax = _figure()
    x = [s.index for s in steps]
    bottom = [0.0] * len(steps)
    seen = [p for p in phases if any(p in s.timings for s in steps)]
    seen += sorted({k for s in steps for k in s.timings} - set(seen))
    cmap = ["#8ecae6", "#ffb703", "#90be6d", "#0969da", "#b8a1e3", "#f9844a", "#4cc9a0", "#e9c46a"]
    for i, phase in enumerate(seen):
        vals = [1e3 * s.timings.get(phase, 0.0) for s in steps]
        ax.bar(x, vals, bottom=bottom, label=phase, color=cmap[i % len(cmap)])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("step")
    ax.set_ylabel("milliseconds")
    ax.set_title("Time per step by phase")
    _legend(ax)
    return fig


def plot_topk(step, request_id: int | None = None, k: int = 10, decode=None):
    """Top-k next-token probabilities of one logits row of ``step`` (default: its first row)."""
    from .topk import topk
    t = topk(step, k, decode)
    rid = t.request_ids[0] if request_id is None else int(request_id)
    if rid not in t.request_ids:
        raise InvalidRequestError(f"request {rid} has no logits row in step {step.index} "
                                  f"(rows: {list(t.request_ids)})")
    r = t.request_ids.index(rid)
    labels = [f"{tok} {token_label(t.texts[r][j])}" if t.texts else str(tok) for j, tok in enumerate(t.token_ids[r])]
    fig, ax = _figure(6.0, 0.6 + 0.28 * len(labels))
    ax.barh(range(len(labels)), t.probs[r], color=h.owner_color(rid))
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("probability")
    ax.set_xlim(0, max(1e-9, max(t.probs[r])) * 1.1)
    ax.set_title(f"Step {step.index}, request {rid}: top-{len(labels)} next tokens")
    return fig


def kv_norms(sess, request) -> tuple[torch.Tensor, torch.Tensor]:
    """|K| and |V| [layers, positions] of a request's computed tokens (float32, on the host).

    Norms are taken over kv heads x head_dim on the device; only ``2 * layers * positions`` numbers
    cross to the host.
    """
    req = sess.request(getattr(request, "id", request))
    engine = sess.state.engine
    bs = sess.config.block_size
    table = engine.manager.block_table(req.id)
    n = min(req.num_computed_tokens, len(table) * bs)
    if n == 0:
        raise InvalidRequestError(f"request {req.id} has no K/V in the cache (status {req.status}, "
                                  f"{req.num_computed_tokens} computed tokens)")
    slots = [table[p // bs] * bs + p % bs for p in range(n)]
    with torch.no_grad():
        k, v = engine.kv_rows(range(engine.kv_cache.num_layers), slots)      # [layers, n, kv_heads, hd]
        return k.float().flatten(2).norm(dim=-1).cpu(), v.float().flatten(2).norm(dim=-1).cpu()


def plot_kv_norms(sess, request):
    """Two heat maps, |K| and |V| by layer (rows) and position (columns), for one request."""
    k, v = kv_norms(sess, request)
    rid = getattr(request, "id", request)
    fig, axes = _figure(7.0, 1.2 + 0.5 * k.shape[0], ncols=2)
    for ax, data, name in zip(axes, (k, v), ("|K|", "|V|")):
        im = ax.imshow(data.numpy(), aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_xlabel("position")
        ax.set_ylabel("layer")
        ax.set_title(f"request {rid}: {name}")
        fig.colorbar(im, ax=ax, shrink=0.8)
    return fig
