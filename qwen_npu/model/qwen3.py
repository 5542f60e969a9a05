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
tensors) and ``silu_mul``; without them the model makes the separate calls.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels.metadata import AttentionMetadata
from .arena import concat_rows
from .scores import attention_scores

# A hook sees (name, tensor) at a named point of the forward and returns a tensor to use
# instead, or None to keep it. The points, in the order a layer reaches them (see
# ``capture_names``; "tokens" = the step's tokens, "rows_out" = the rows that get logits):
#
#   embed                     [tokens, hidden]         token embeddings
#   layers.{i}.resid_pre      [tokens, hidden]         the residual stream entering the layer
#   layers.{i}.attn.in        [tokens, hidden]         input_layernorm output (what q/k/v project)
#   layers.{i}.attn.q_pre_rope [tokens, heads, hd]     after q_norm, before RoPE
#   layers.{i}.attn.k_pre_rope [tokens, kv_heads, hd]  after k_norm, before RoPE
#   layers.{i}.attn.q         [tokens, heads, hd]      after RoPE: what attention sees
#   layers.{i}.attn.k         [tokens, kv_heads, hd]   after RoPE: what is written to the cache
#   layers.{i}.attn.v         [tokens, kv_heads, hd]   what is written to the cache
#   layers.{i}.attn.scores    [tokens, heads, keys]    q.k * scale before softmax (float32), keys
#                                                      0..the step's longest row; -inf where masked
#   layers.{i}.attn.z         [tokens, heads, hd]      attention output per head, before o_proj
#   layers.{i}.attn.out       [tokens, hidden]         after o_proj
#   layers.{i}.resid_mid      [tokens, hidden]         the stream after the attention's residual add
#   layers.{i}.mlp.in         [tokens, hidden]         post_attention_layernorm output
#   layers.{i}.mlp.act        [tokens, intermediate]   silu(gate) * up, before down_proj
#   layers.{i}.mlp.out        [tokens, hidden]         after down_proj
#   layers.{i}.residual       [tokens, hidden]         the residual stream after the layer
#   final_norm                [rows_out, hidden]       the final norm of the rows that get logits
#   logits                    [rows_out, vocab]        float32 logits of those rows
#
# With a hook the residual stream is materialised after every layer (x + residual, then a zero
# x); the sum is the one the fused add_rms_norm would form, so the numbers do not change.
# "resid_pre" and "resid_mid" are the residual add_rms_norm returns; an edit there re-runs the
# norm on the edited stream. "attn.scores" is built from q and the paged keys (scores.py) only
# when the hook asks for it: a hook with a ``wants(name)`` method is called only at the points it
# wants; scores are read only (what the hook returns for them is not used).
Hook = Callable[[str, torch.Tensor], "torch.Tensor | None"]

ATTN_POINTS = ("in", "q_pre_rope", "k_pre_rope", "q", "k", "v", "scores", "z", "out")
MLP_POINTS = ("in", "act", "out")


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


def capture_names(num_layers: int) -> list[str]:
    """Every hook point of the forward, in the order they are reached."""
    names = ["embed"]
    for i in range(num_layers):
        names += [f"layers.{i}.resid_pre"] + [f"layers.{i}.attn.{p}" for p in ATTN_POINTS]
        names += [f"layers.{i}.resid_mid"] + [f"layers.{i}.mlp.{p}" for p in MLP_POINTS] + [f"layers.{i}.residual"]
    return names + ["final_norm", "logits"]


class Qwen3Model:
    """Qwen3ForCausalLM forward over a paged KV cache; stateless between calls."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], kernels, *,
                 max_positions: int | None = None):
        self.config = config
        self.kernels = kernels
        c = config
        self.embed = weights["model.embed_tokens.weight"]               # [vocab, hidden]
        self.lm_head = weights["lm_head.weight"]                          # [vocab, hidden]
        self.norm = weights["model.norm.weight"]
        self.layers: list[LayerWeights] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(LayerWeights(
                input_norm=weights[p + "input_layernorm.weight"],
                qkv=concat_rows([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                q_norm=weights[p + "self_attn.q_norm.weight"],
                k_norm=weights[p + "self_attn.k_norm.weight"],
                o=weights[p + "self_attn.o_proj.weight"],
                post_norm=weights[p + "post_attention_layernorm.weight"],
                gate_up=concat_rows([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]),
                down=weights[p + "mlp.down_proj.weight"],
            ))
        self.scale = c.head_dim ** -0.5
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
                hook: Hook | None = None) -> torch.Tensor:
        """Compute one step and return the logits of the tokens in ``logits_index``.

        input_ids [tokens] (int64); logits_index [rows_out] indices into the step's tokens;
        kv_caches: per layer (key_cache, value_cache). The K/V of every token is written at
        ``meta.slot_mapping`` before attention reads it. ``logits_out`` [rows_out, vocab] and
        ``hidden_out`` [rows_out, hidden] are optional preallocated outputs (written in place).
        """
        k_ = self.kernels
        linear = getattr(k_, "linear", F.linear)     # a kernel set may bring its own (F.linear's contract)
        qk_norm_rope = getattr(k_, "qk_norm_rope", None) if hook is None else None   # hooks see pre-RoPE q/k
        silu_mul = getattr(k_, "silu_mul", _silu_mul)
        c = self.config
        t = input_ids.shape[0]
        eps = c.rms_norm_eps
        x = F.embedding(input_ids, self.embed)                              # [tokens, hidden]
        if hook is not None:
            x = _hooked(hook, "embed", x)
        cos, sin = self.cos[meta.positions], self.sin[meta.positions]     # [tokens, head_dim]
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual, h = x, k_.rms_norm(x, layer.input_norm, eps)
            else:
                h, residual = k_.add_rms_norm(x, residual, layer.input_norm, eps)
            if hook is not None:
                residual, h = _hooked_stream(hook, f"layers.{i}.resid_pre", residual, h, k_, layer.input_norm, eps)
                h = _hooked(hook, f"layers.{i}.attn.in", h)
            qkv = linear(h, layer.qkv)                                         # [tokens, q + 2 kv]
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = q.reshape(t, c.num_attention_heads, c.head_dim)               # [tokens, heads, hd]
            k = k.reshape(t, c.num_key_value_heads, c.head_dim)               # [tokens, kv_heads, hd]
            v = v.reshape(t, c.num_key_value_heads, c.head_dim)               # [tokens, kv_heads, hd]
            if qk_norm_rope is not None:
                q, k = qk_norm_rope(q, k, layer.q_norm, layer.k_norm, eps, cos, sin)
            else:
                q, k = k_.rms_norm(q, layer.q_norm, eps), k_.rms_norm(k, layer.k_norm, eps)
                if hook is not None:
                    q = _hooked(hook, f"layers.{i}.attn.q_pre_rope", q)
                    k = _hooked(hook, f"layers.{i}.attn.k_pre_rope", k)
                q, k = k_.rope(q, k, cos, sin)                               # [tokens, heads, hd]
            if hook is not None:
                q = _hooked(hook, f"layers.{i}.attn.q", q)
                k = _hooked(hook, f"layers.{i}.attn.k", k)
                v = _hooked(hook, f"layers.{i}.attn.v", v)
            key_cache, value_cache = kv_caches[i]
            k_.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
            attn = k_.paged_attention(q, key_cache, value_cache, meta, self.scale)   # [tokens, heads, hd]
            if hook is not None:
                name = f"layers.{i}.attn.scores"
                if _wants(hook, name):
                    hook(name, attention_scores(q, key_cache, meta, self.scale))      # read only
                attn = _hooked(hook, f"layers.{i}.attn.z", attn)
            x = linear(attn.reshape(t, c.q_size), layer.o)                     # [tokens, hidden]
            if hook is not None:
                x = _hooked(hook, f"layers.{i}.attn.out", x)
            h, residual = k_.add_rms_norm(x, residual, layer.post_norm, eps)
            if hook is not None:
                residual, h = _hooked_stream(hook, f"layers.{i}.resid_mid", residual, h, k_, layer.post_norm, eps)
                h = _hooked(hook, f"layers.{i}.mlp.in", h)
            act = silu_mul(linear(h, layer.gate_up))                          # [tokens, intermediate]
            if hook is not None:
                act = _hooked(hook, f"layers.{i}.mlp.act", act)
            x = linear(act, layer.down)                                        # [tokens, hidden]
            if hook is not None:
                x = _hooked(hook, f"layers.{i}.mlp.out", x)
                # materialise the residual stream so the hook sees (and may edit) it whole
                residual = _hooked(hook, f"layers.{i}.residual", x + residual)
                x = torch.zeros_like(x)
        x, residual = x[logits_index], residual[logits_index]               # [rows_out, hidden]
        h, _ = k_.add_rms_norm(x, residual, self.norm, eps)
        if hook is not None:
            h = _hooked(hook, "final_norm", h)
        if hidden_out is not None:
            hidden_out.copy_(h)
        if logits_out is not None and logits_out.dtype == h.dtype:
            logits = torch.mm(h, self.lm_head.t(), out=logits_out)          # [rows_out, vocab]
        else:
            logits = linear(h, self.lm_head)
            if logits_out is not None:
                logits = logits_out.copy_(logits)
        if hook is not None:
            edited = hook("logits", logits)
            if edited is not None:
                logits = logits_out.copy_(edited) if logits_out is not None else edited
        return logits

    __call__ = forward


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[tokens, 2 * intermediate] -> silu(gate) * up [tokens, intermediate], for kernel sets without one."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _hooked(hook: Hook, name: str, x: torch.Tensor) -> torch.Tensor:
    if not _wants(hook, name):
        return x
    y = hook(name, x)
    return x if y is None else y


def _wants(hook: Hook, name: str) -> bool:
    wants = getattr(hook, "wants", None)
    return True if wants is None else wants(name)


def _hooked_stream(hook: Hook, name: str, residual: torch.Tensor, h: torch.Tensor, k_, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual, its norm) after the hook at a residual-stream point; an edit re-runs the norm."""
    if not _wants(hook, name):
        return residual, h
    y = hook(name, residual)
    if y is None:
        return residual, h
    return y, k_.rms_norm(y, weight, eps)


def rope_tables(head_dim: int, theta: float, max_positions: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] in float32, exactly as Hugging Face computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]                              # [positions, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)
