"""The Qwen3 decoder with paged attention.

Depends only on ``config`` and ``kernels``: attention metadata (positions, slot mapping, block
tables, sequence lengths, query start offsets) arrives as an explicit argument, and the KV
cache tensors are handed in per call. Per layer::

    x ─ rms_norm ─ qkv_proj ─┬─ q ─ q_norm ─┐
                             ├─ k ─ k_norm ─┴─ rope ─ write_kv(k, v) ─ paged_attention ─ o_proj ─ + ─┐
                             └─ v ──────────────────┘                                           (residual)
    ┌──────────────────────────────────────────────────────────────────────────────────────────────┘
    └─ rms_norm ─ gate_up_proj ─ silu(gate) * up ─ down_proj ─ + (residual)

q/k/v and gate/up projections are fused into one matrix each at load time (a view when the
loader placed them back to back, as it does on the CPU; a copy otherwise). The LM head runs
only for the token rows that need a next token. A kernel set may bring fused ``qk_norm_rope``
(q_norm, k_norm and RoPE in one call; used only when no hook is set, so hooks see the pre-RoPE
tensors), ``silu_mul`` and ``gate_up_silu`` (the gate|up product and silu_mul in one pass; no
hook point lies between them), and ``decoder_layers`` (every layer's calls in one, the same bits;
used only without a hook and tensor parallelism, and where it declines the model makes the calls
one by one); without them the model makes the separate calls.

Each hook point (``hooks.py``) is one call on the forward's tap (below) that returns the tensor to go on
with, ``x = tap(name, x)``; without a hook the tap hands every tensor back unchanged.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels import onednn, panels, reference
from ..kernels.invariant import BatchInvariant
from ..kernels.metadata import AttentionMetadata
from .arena import concat_rows
from .hooks import ForwardHook, LayerPoints
from .scores import attention_scores

Hook = ForwardHook        # what ``forward(hook=...)`` takes; the points and their semantics: ``hooks.py``


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor   # [hidden]
    qkv: torch.Tensor          # [q_size + 2 * kv_size, hidden]
    q_norm: torch.Tensor       # [head_dim]
    k_norm: torch.Tensor       # [head_dim]
    o: torch.Tensor            # [hidden, q_size]
    post_norm: torch.Tensor    # [hidden]
    gate_up: torch.Tensor      # [2 * intermediate, hidden]
    down: torch.Tensor         # [hidden, intermediate]


class Qwen3Model:
    """Qwen3ForCausalLM forward over a paged KV cache; stateless between calls."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], kernels, *,
                 max_positions: int | None = None, consume: bool = False,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 full_config: ModelConfig | None = None):
        """``weights`` by Hugging Face name (``loader.load_checkpoint``). A kernel set with a
        ``prepare_weight`` holds the matrices (q|k|v, o, gate|up, down, the LM head) in its own
        form, made here once; ``layers[i].o`` and the like are then that form (``dense_weight``
        gives the plain matrix), while ``embed`` and ``lm_head`` stay plain for the embedding
        lookup and the research tools (a reordered LM head is a second copy: ``head``).
        ``consume``: take each matrix out of ``weights`` as its layer is built, so that a plain
        matrix whose prepared form exists is freed before the next layer is prepared.
        ``all_reduce``: with tensor parallelism (``parallel/``), ``config`` is one rank's share
        (its heads, its MLP columns), the weights its slices, and the partial sums after o_proj
        and down_proj are summed over the ranks by this call; ``full_config`` is the checkpoint's
        shape (``config`` without it)."""
        self.config = config
        self.full_config = full_config or config
        self.all_reduce = all_reduce
        self.kernels = kernels
        c = config
        prepare = getattr(kernels, "prepare_weight", None)
        take = weights.pop if consume else weights.__getitem__

        def matrix(*names: str) -> torch.Tensor:
            plain = concat_rows([take(n) for n in names]) if len(names) > 1 else take(names[0])
            return plain if prepare is None else prepare(plain)

        self.embed = weights["model.embed_tokens.weight"]               # [vocab, hidden]
        self.lm_head = weights["lm_head.weight"]                          # [vocab, hidden]
        self.head = self.lm_head if prepare is None else prepare(self.lm_head)   # what the LM head multiplies by
        self.norm = weights["model.norm.weight"]
        self.layers: list[LayerWeights] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(LayerWeights(
                input_norm=weights[p + "input_layernorm.weight"],
                qkv=matrix(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                q_norm=weights[p + "self_attn.q_norm.weight"],
                k_norm=weights[p + "self_attn.k_norm.weight"],
                o=matrix(p + "self_attn.o_proj.weight"),
                post_norm=weights[p + "post_attention_layernorm.weight"],
                gate_up=matrix(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=matrix(p + "mlp.down_proj.weight"),
            ))
        self.points = [LayerPoints.of_layer(i) for i in range(c.num_hidden_layers)]
        self.scale = c.head_dim ** -0.5
        self.qkv_sizes = (c.q_size, c.kv_size, c.kv_size)                 # how qkv_proj's output splits
        self.qkv_heads = (c.num_attention_heads, c.num_key_value_heads, c.num_key_value_heads)   # ... by heads
        self.qkv_rows = sum(self.qkv_heads)
        self.cos, self.sin = rope_tables(c.head_dim, c.rope_theta, max_positions or c.max_position_embeddings,
                                         self.embed.device)          # [positions, head_dim] float32

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_index: torch.Tensor, *,
                logits_out: torch.Tensor | None = None, hidden_out: torch.Tensor | None = None,
                greedy_out: torch.Tensor | None = None, hook: Hook | None = None) -> torch.Tensor:
        """Compute one step and return the logits of the tokens in ``logits_index``.

        input_ids [tokens] (int64); logits_index [rows_out] indices into the step's tokens;
        kv_caches: per layer (key_cache, value_cache). The K/V of every token is written at
        ``meta.slot_mapping`` before attention reads it. ``logits_out`` [rows_out, vocab] and
        ``hidden_out`` [rows_out, hidden] are optional preallocated outputs (written in place).
        ``greedy_out`` [2, rows_out] int64, optional: each row's argmax and, packed with it, its
        health code (``kernels.reference.greedy_health``, laid out by ``pack_greedy``) of the
        logits returned; a kernel set with ``lm_head`` makes them as it writes ``logits_out``,
        without reading the logits again.
        """
        k_ = self.kernels
        linear = getattr(k_, "linear", _linear)      # a kernel set may bring its own (F.linear's contract)
        qk_norm_rope = getattr(k_, "qk_norm_rope", None) if hook is None else None   # hooks see pre-RoPE q/k
        silu_mul = getattr(k_, "silu_mul", _silu_mul)
        gate_up_silu = getattr(k_, "gate_up_silu", None)   # silu_mul(linear(h, gate_up)) in one pass, or None
        # every layer's calls below made in one, where the set can and nothing must see inside a layer
        decoder_layers = getattr(k_, "decoder_layers", None) if hook is None and self.all_reduce is None else None
        c = self.config
        t = input_ids.shape[0]
        eps = c.rms_norm_eps
        tap = tap_for(hook, k_.rms_norm, eps)           # one call per hook point; a no-op without a hook
        invariant = isinstance(k_, BatchInvariant)     # then the scores hook point is built per token too
        x = tap("embed", F.embedding(input_ids, self.embed))              # [tokens, hidden]
        cos, sin = self.cos[meta.positions], self.sin[meta.positions]     # [tokens, head_dim]
        residual = None
        made = None if decoder_layers is None else decoder_layers(
            x, self.layers, kv_caches, meta=meta, cos=cos, sin=sin, heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads, eps=eps, scale=self.scale)
        if made is not None:                           # made: the same bits as the calls below
            x, residual = made
        for i, layer in enumerate(self.layers if made is None else ()):
            p = self.points[i]
            if residual is None:
                residual, h = x, k_.rms_norm(x, layer.input_norm, eps)
            else:
                h, residual = k_.add_rms_norm(x, residual, layer.input_norm, eps)
            residual, h = tap.stream(p.resid_pre, residual, h, layer.input_norm)
            h = tap(p.attn_in, h)
            qkv = linear(h, layer.qkv).reshape(t, self.qkv_rows, c.head_dim)  # [tokens, heads + 2 kv_heads, hd]
            q, k, v = qkv.split_with_sizes(self.qkv_heads, dim=1)            # [tokens, heads | kv_heads, hd]
            if qk_norm_rope is not None:                                       # only without a hook
                q, k = qk_norm_rope(q, k, layer.q_norm, layer.k_norm, eps, cos, sin)
            else:
                q = tap(p.q_pre_rope, k_.rms_norm(q, layer.q_norm, eps))
                k = tap(p.k_pre_rope, k_.rms_norm(k, layer.k_norm, eps))
                q, k = k_.rope(q, k, cos, sin)                               # [tokens, heads, hd]
            q, k, v = tap(p.q, q), tap(p.k, k), tap(p.v, v)
            key_cache, value_cache = kv_caches[i]
            k_.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
            attn = k_.paged_attention(q, key_cache, value_cache, meta, self.scale)   # [tokens, heads, hd]
            tap.read(p.scores, attention_scores, q, key_cache, meta, self.scale, invariant)   # only when wanted
            attn = tap(p.z, attn)
            x = linear(attn.reshape(t, self.qkv_sizes[0]), layer.o)                  # [tokens, hidden]
            if self.all_reduce is not None:
                x = self.all_reduce(x)                 # this rank's heads' share, summed over ranks
            x = tap(p.attn_out, x)
            h, residual = k_.add_rms_norm(x, residual, layer.post_norm, eps)
            residual, h = tap.stream(p.resid_mid, residual, h, layer.post_norm)
            h = tap(p.mlp_in, h)
            act = gate_up_silu(h, layer.gate_up) if gate_up_silu is not None else None
            if act is None:
                act = silu_mul(linear(h, layer.gate_up))
            act = tap(p.mlp_act, act)                                          # [tokens, intermediate]
            x = linear(act, layer.down)                                          # [tokens, hidden]
            if self.all_reduce is not None:
                x = self.all_reduce(x)
            x = tap(p.mlp_out, x)
            x, residual = tap.residual(p.residual, x, residual)   # with a hook: the stream made whole
        x, residual = x[logits_index], residual[logits_index]               # [rows_out, hidden]
        h, _ = k_.add_rms_norm(x, residual, self.norm, eps)
        h = tap("final_norm", h)
        if hidden_out is not None:
            hidden_out.copy_(h)
        lm_head = getattr(k_, "lm_head", None) if greedy_out is not None and logits_out is not None else None
        greedy = lm_head(h, self.head, logits_out) if lm_head is not None else None   # logits + argmax, one pass
        if greedy is not None:
            logits = logits_out
        elif (logits_out is not None and logits_out.dtype == h.dtype and self.head.dim() == 2
                and not self.head.is_mkldnn and not invariant):    # torch.mm rounds rows by their number
            logits = torch.mm(h, self.head.t(), out=logits_out)             # [rows_out, vocab]
        else:
            logits = linear(h, self.head)
            if logits_out is not None:
                logits = logits_out.copy_(logits)
        edited = tap("logits", logits)
        if edited is not logits:
            logits = logits_out.copy_(edited) if logits_out is not None else edited
            greedy = None
        if greedy_out is not None:
            if greedy is None:               # a set's own read of the logits where it has one, else torch's
                greedy = getattr(k_, "greedy_health", reference.greedy_health)(logits) or reference.greedy_health(logits)
            getattr(k_, "pack_greedy", reference.pack_greedy)(greedy[0], greedy[1], greedy_out)
        return logits

    __call__ = forward


class Tap:
    """A ``ForwardHook`` bound for one forward; ``rms_norm`` and ``eps`` re-run a norm after an
    edit of the residual stream."""

    __slots__ = ("eps", "hook", "rms_norm")

    def __init__(self, hook: ForwardHook, rms_norm: Callable, eps: float):
        self.hook, self.rms_norm, self.eps = hook, rms_norm, eps

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The tensor the forward goes on with at ``name``."""
        if not self.hook.wants(name):
            return x
        y = self.hook(name, x)
        return x if y is None else y

    def stream(self, name: str, residual: torch.Tensor, h: torch.Tensor,
               weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual, its norm) after the hook at a residual-stream point; an edit re-runs the norm."""
        if not self.hook.wants(name):
            return residual, h
        y = self.hook(name, residual)
        if y is None:
            return residual, h
        return y, self.rms_norm(y, weight, self.eps)

    def read(self, name: str, build: Callable[..., torch.Tensor], *args) -> None:
        """Show ``build(*args)`` at ``name``, built only when wanted; read only."""
        if self.hook.wants(name):
            self.hook(name, build(*args))

    def residual(self, name: str, x: torch.Tensor,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) after a layer: the stream materialised (a zero x, x + residual) and shown."""
        return torch.zeros_like(x), self(name, x + residual)


class NoTap:
    """The tap of a forward without a hook: every call returns its tensors unchanged."""

    __slots__ = ()

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x

    def stream(self, name: str, residual: torch.Tensor, h: torch.Tensor,
               weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return residual, h

    def read(self, name: str, build: Callable[..., torch.Tensor], *args) -> None:
        return None

    def residual(self, name: str, x: torch.Tensor,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, residual


NO_TAP = NoTap()


def tap_for(hook: ForwardHook | None, rms_norm: Callable, eps: float) -> Tap | NoTap:
    return NO_TAP if hook is None else Tap(hook, rms_norm, eps)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` for a kernel set without its own ``linear``; takes a weight another set
    reordered too (a model forwarded with other kernels, as ``research.attention`` does)."""
    if weight.is_mkldnn:
        return onednn.linear(x, weight)
    return F.linear(x, dense_weight(weight))


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """The plain [out, in] matrix of a model weight, whatever form the kernel set holds it in
    (a copy, bit for bit, where the set reordered it, ``weight.is_mkldnn``, or packed it into
    16-column panels, ``kernels.panels.is_packed``)."""
    if weight.is_mkldnn:
        return weight.to_dense()
    return panels.unpack(weight) if weight.dim() == 3 else weight    # panels: the only 3-D matrices


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[tokens, 2 * intermediate] -> silu(gate) * up [tokens, intermediate], for kernel sets without one."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_tables(head_dim: int, theta: float, max_positions: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] in float32, exactly as Hugging Face computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]                              # [positions, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)
