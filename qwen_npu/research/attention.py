"""``sess.attention(request, layer)``: softmax attention probabilities over the paged cache.

The engine never materialises attention weights (the kernels fuse them away), and queries are
not cached. So the probabilities are rebuilt from two sources::

    queries  a side forward of the request's computed tokens 0..n-1 through layers 0..layer with
             the reference kernels over a scratch cache of its own (stopped right after the
             layer's q and k, so later layers cost nothing)
    keys     read from the SESSION's paged cache through the request's block table
             (position p -> slot table[p // block_size] * block_size + p % block_size)

    probs[h, i, j] = softmax_j(q[positions[i], h] . k[j, h // group] * scale),  j <= positions[i]

so each row sums to 1 over the keys a query may see, and a key the cache lost or corrupted shows
up in the pattern. ``cache_max_diff`` also reports max |K in the cache - K recomputed| for the
layer. A request run under an edit (``sess.intervene`` before the final norm) is refused: its
queries cannot be rebuilt from its tokens alone; capture "layers.{i}.attn.scores" inside the
edit's block instead (the pre-softmax scores of the edited run, from the same paged keys). Nothing of the session changes: cache, ledger, step counter, history and requests stay
as they were.
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from ..errors import InvalidRequestError
from ..inspect import html as H
from ..kernels import get_kernels
from ..kernels.metadata import AttentionMetadata


class _Stop(Exception):
    """Ends the side forward once the wanted layer's q and k are known."""


@dataclasses.dataclass(frozen=True)
class AttentionPattern:
    """Attention probabilities of one request at one layer: ``probs`` [heads, queries, keys] on the host."""

    request_id: int
    layer: int
    heads: tuple[int, ...]
    positions: tuple[int, ...]          # the query positions (rows of each head's matrix)
    token_ids: tuple[int, ...]          # the request's computed tokens = the keys (columns)
    tokens: tuple[str, ...]             # axis labels: token strings, or ids without a tokenizer
    probs: torch.Tensor                 # [heads, queries, keys] float32; 0 beyond each query's position
    cache_max_diff: float               # max |K cached - K recomputed| of this layer

    @property
    def query_tokens(self) -> tuple[str, ...]:
        return tuple(self.tokens[p] for p in self.positions)

    def top(self, k: int = 3, head: int | None = None, query: int = -1) -> list[tuple[int, str, float]]:
        """The ``k`` most attended keys (position, token, probability) of one query of one head."""
        i = self.heads.index(head) if head is not None else 0
        row = self.probs[i, query]
        vals, idx = row.topk(min(k, row.shape[0]))
        return [(int(j), self.tokens[int(j)], float(v)) for v, j in zip(vals, idx)]

    def plot(self, heads=None, *, max_labels: int = 40):
        """A heatmap per head (queries down, keys across); returns a matplotlib Figure (shown as a
        PNG in a notebook, never registered with pyplot)."""
        from ..inspect.plots import NotebookFigure, token_label
        heads = self.heads if heads is None else [heads] if isinstance(heads, int) else list(heads)
        missing = [h for h in heads if h not in self.heads]
        if missing:
            raise InvalidRequestError(f"heads {missing} are not in this pattern (heads {list(self.heads)})")
        n = len(heads)
        cols = min(n, 4)
        rows = -(-n // cols)
        q, k = len(self.positions), len(self.tokens)
        fig = NotebookFigure(figsize=(min(3.2 * cols, 14), 0.4 + min(3.0, 0.25 * q + 1.2) * rows), layout="constrained")
        axes = fig.subplots(rows, cols, squeeze=False)
        for ax in axes.flat[n:]:
            ax.set_axis_off()
        for ax, h in zip(axes.flat, heads):
            im = ax.imshow(self.probs[self.heads.index(h)].numpy(), vmin=0.0, vmax=1.0, cmap="viridis",
                           aspect="auto", interpolation="nearest")
            ax.set_title(f"layer {self.layer} head {h}", fontsize=9)
            if k <= max_labels:
                ax.set_xticks(range(k), [token_label(t, quotes=False) for t in self.tokens], rotation=90, fontsize=7)
            if q <= max_labels:
                ax.set_yticks(range(q), [f"{p}:{token_label(t, quotes=False)}" for p, t in zip(self.positions, self.query_tokens)],
                              fontsize=7)
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="probability")
        fig.suptitle(f"request {self.request_id}: attention at layer {self.layer}", fontsize=10)
        return fig

    def __repr__(self) -> str:
        h, q, k = self.probs.shape
        heads = f"heads {self.heads[0]}..{self.heads[-1]}" if h > 1 else f"head {self.heads[0]}"
        lines = [f"AttentionPattern(request {self.request_id}, layer {self.layer}, {heads}: {q} queries x {k} keys; "
                 f"K cached vs recomputed max|diff| {self.cache_max_diff:.1e})"]
        last = self.positions[-1]
        for head in self.heads[:8]:
            tops = ", ".join(f"{j} {t!r} {p:.2f}" for j, t, p in self.top(3, head))
            lines.append(f"  head {head}, query {last} {self.tokens[last]!r} attends to: {tops}")
        if h > 8:
            lines.append(f"  ... and {h - 8} more heads")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return H.pre(repr(self))


def attention_pattern(sess, request, layer: int, head=None, positions=None) -> AttentionPattern:
    """See the module docstring; arguments are checked before anything runs."""
    from ..parallel.group import refuse_with_ranks
    refuse_with_ranks(sess._engine, "sess.attention (a side forward on rank 0)",
                      f"capture 'layers.{layer}.attn.scores' during a step instead: it is gathered from every rank")
    mc = sess.model_config
    req = sess.request(getattr(request, "id", request))
    manager = sess.state.manager
    n = req.num_computed_tokens
    if not manager.has(req.id) or n == 0:
        raise InvalidRequestError(f"request {req.id} is {req.status} and holds no computed K/V in the cache; "
                                  f"call attention while it is prefilling or decoding")
    edited = manager.private_reason(req.id)
    if edited is not None:
        raise InvalidRequestError(
            f"sess.attention cannot rebuild the queries of request {req.id}: {edited}, and a side forward "
            f"from its tokens would miss the edit; capture 'layers.{layer}.attn.scores' inside the "
            f"intervene block instead (softmax over its last axis is the pattern)")
    if not isinstance(layer, int) or not 0 <= layer < mc.num_hidden_layers:
        raise InvalidRequestError(f"layer={layer!r}: choose an int in 0..{mc.num_hidden_layers - 1}")
    heads = tuple(range(mc.num_attention_heads)) if head is None else (
        (head,) if isinstance(head, int) else tuple(head))
    if not heads or any(not isinstance(h, int) or not 0 <= h < mc.num_attention_heads for h in heads):
        raise InvalidRequestError(f"head={head!r}: choose ints in 0..{mc.num_attention_heads - 1} (or None)")
    positions = tuple(range(n)) if positions is None else (
        (positions,) if isinstance(positions, int) else tuple(positions))
    if not positions or any(not isinstance(p, int) or not 0 <= p < n for p in positions):
        raise InvalidRequestError(f"positions={positions!r}: request {req.id} has K/V for positions 0..{n - 1}")
    token_ids = req.all_token_ids[:n]
    q, k_dense = _side_forward(sess.model, token_ids, layer)           # [n, heads, hd], [n, kv_heads, hd]
    key_cache = sess.state.kv_cache.keys[layer]
    bs = key_cache.shape[1]
    table = manager.block_table(req.id)
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)], dtype=torch.int64)
    k = key_cache.view(-1, *key_cache.shape[2:]).index_select(0, slots.to(key_cache.device))  # [n, kv_heads, hd]
    group = mc.num_attention_heads // mc.num_key_value_heads
    pos = torch.tensor(positions, dtype=torch.int64, device=q.device)
    qs = q[pos][:, list(heads)].float()                                 # [queries, heads, hd]
    ks = k[:, [h // group for h in heads]].float()                      # [n, heads, hd]
    scores = torch.einsum("qhd,khd->hqk", qs, ks) * sess.model.scale     # [heads, queries, n]
    mask = torch.arange(n, device=q.device)[None, :] > pos[:, None]     # [queries, n] future keys
    probs = torch.softmax(scores.masked_fill(mask[None], float("-inf")), dim=-1)
    diff = (k.float() - k_dense.float()).abs().max()
    tok = sess.tokenizer
    labels = tuple(tok.token_str(t) if tok is not None else str(t) for t in token_ids)
    return AttentionPattern(req.id, layer, heads, positions, tuple(token_ids), labels,
                            probs.cpu(), float(diff.cpu()))


def _side_forward(model, token_ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, heads, hd] and k [n, kv_heads, hd] (after RoPE) of ``layer`` for tokens 0..n-1.

    One prefill row with the reference kernels over a scratch cache (one block of n slots per
    layer below ``layer``); the forward is stopped at the layer's "attn.v" point.
    """
    c = model.config
    n, device = len(token_ids), model.device
    dense = copy.copy(model)
    dense.kernels = get_kernels("reference")
    shape = (1, n, c.num_key_value_heads, c.head_dim)
    scratch = [(torch.zeros(shape, dtype=model.dtype, device=device),
                torch.zeros(shape, dtype=model.dtype, device=device)) for _ in range(layer)]
    pos = torch.arange(n, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        positions=pos, slot_mapping=pos, block_tables=torch.zeros((1, 1), dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        query_lens_host=(n,), seq_lens_host=(n,), is_decode=False)
    got: dict[str, torch.Tensor] = {}
    want_q, want_k, stop = (f"layers.{layer}.attn.{p}" for p in ("q", "k", "v"))

    def hook(name, x):
        if name == want_q or name == want_k:
            got[name] = x
        elif name == stop:
            raise _Stop
    hook.wants = (want_q, want_k, stop).__contains__       # the forward skips every other point

    try:
        with torch.no_grad():
            dense(torch.tensor(token_ids, dtype=torch.int64, device=device), meta, scratch,
                  torch.zeros(0, dtype=torch.int64, device=device), hook=hook)
    except _Stop:
        pass
    return got[want_q], got[want_k]
