"""Ascend NPU kernels: the reference contract (README.md) on torch_npu's fused ops.

torch_npu is loaded through ``qwen_npu.device.npu_runtime.load_torch_npu`` at the first call that needs it,
never at import, so ``import qwen_npu.kernels.npu`` works on any machine. Each function checks
whether its fused op can express the call; where it cannot (tensors not on an npu, float32 where
the op wants fp16/bf16, a block size or head_dim the op does not take, ...) it runs the reference
kernel instead and says so with a RuntimeWarning ONCE per (function, reason). The limits are the
ones torch-npu's own documentation states (docs/npu.md quotes each one).

    function         fused op                                   falls back when
    write_kv         _npu_reshape_and_cache (ATB)               cache not fp16/bf16
    paged_attention  decode: _npu_paged_attention (ATB)         dtype not fp16/bf16,
                                                                  block_size % 16, head_dim % 16,
                                                                  head_dim > 256
                     prefill chunks: npu_fused_infer_attention_  the same, and block_size not a
                       score, TND layout, sparse_mode=3 (causal)  multiple of 128 up to 512, more
                                                                  than 64 query heads per kv head,
                                                                  kv_heads * head_dim > 65535,
                                                                  empty rows
    rms_norm         npu_rms_norm                               weight dtype != x dtype, x not 2-8-D
    add_rms_norm     npu_add_rms_norm                           (same)
    rope             npu_apply_rotary_pos_emb, BSND, "half"     head_dim not 64 or 128

Host data only comes from the host copies in AttentionMetadata (no device-to-host sync).
"""
from __future__ import annotations

import functools
import itertools

import torch

from qwen_npu.errors import warn
from qwen_npu.device.npu_runtime import load_torch_npu

from . import reference
from .metadata import AttentionMetadata

NAME = "npu"

HALF_DTYPES = (torch.float16, torch.bfloat16)
NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MASK_SIZE = 2048   # sparse_mode=3 takes one compressed [2048, 2048] causal mask for any length
DEVICE_TYPE = "npu"   # the device type the fused ops run on
ROPE_HEAD_DIMS = (64, 128)          # npu_apply_rotary_pos_emb on A2/A3: D must be 128 or 64
PAGED_PREFILL_BLOCK_SIZES = range(128, 513, 128)   # the fused op's paged prefill: 128..512, x128
MAX_HEADS_PER_KV_HEAD = 64
MAX_KV_HIDDEN = 65535               # (blocks, block_size, kv_heads * head_dim) cache layout limit


@functools.cache
def warn_fallback(op: str, reason: str) -> None:
    """Say once per (op, reason) that ``op`` runs the reference kernel (``cache_clear`` re-arms)."""
    warn(f"qwen_npu.kernels.npu.{op}: {reason}; running the reference kernel instead", RuntimeWarning)


def _unsupported(tensors: tuple[torch.Tensor, ...], dtypes: tuple[torch.dtype, ...]) -> str | None:
    first = tensors[0]
    if first.device.type != DEVICE_TYPE:
        return f"tensors are on {first.device.type}, not an npu"
    if first.dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        return f"dtype {str(first.dtype).removeprefix('torch.')} is not supported by the fused op ({names})"
    if any(t.dtype != first.dtype for t in tensors[1:]):
        return "mixed dtypes (" + ", ".join(str(t.dtype).removeprefix("torch.") for t in tensors) + ")"
    return None


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Reference contract; slot -1 is never written.

    ``_npu_reshape_and_cache`` may not skip negative slots, and dropping those tokens would need
    their count on the host. So every skipped token is redirected to re-write a donor
    (``reference.redirect_skipped_slots``): the first kept token's slot with that token's own
    K/V, or, when nothing is kept, slot 0 with its current contents. The op then writes only
    values a slot already gets, and the cache ends exactly as if the skipped tokens were absent.
    """
    reason = _unsupported((key_cache, value_cache), HALF_DTYPES)
    if reason is not None:
        warn_fallback("write_kv", reason)
        return reference.write_kv(key, value, key_cache, value_cache, slot_mapping)
    if slot_mapping.shape[0] == 0:
        return None
    slots, k, v = reference.redirect_skipped_slots(key, value, key_cache, value_cache, slot_mapping)
    # slot argument positional: its keyword was renamed (slot_mapping -> slot_indices) in CANN 9.1
    load_torch_npu()._npu_reshape_and_cache(k.contiguous(), v.contiguous(), key_cache, value_cache,
                                            slots.to(torch.int32))
    return None


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Reference contract. Decode rows use ATB paged attention; prefill chunks (and decode with
    block_size * head_dim > 128 * 128) use the fused infer-attention op with a causal mask."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    decode = meta.is_decode and block_size * head_dim <= 128 * 128
    reason = _unsupported((query, key_cache, value_cache), HALF_DTYPES)
    if reason is None and block_size % 16:
        reason = f"block_size {block_size} is not a multiple of 16"
    if reason is None and (head_dim % 16 or head_dim > 256):
        reason = f"head_dim {head_dim} is not a multiple of 16 up to 256"
    if reason is None and not decode:
        reason = _prefill_unsupported(query, meta, block_size, num_kv_heads, head_dim)
    if reason is not None:
        warn_fallback("paged_attention", reason)
        return reference.paged_attention(query, key_cache, value_cache, meta, scale)
    if decode:
        return _decode(query, key_cache, value_cache, meta, scale)
    return _prefill(query, key_cache, value_cache, meta, scale)


def _prefill_unsupported(query, meta, block_size, num_kv_heads, head_dim) -> str | None:
    """Why npu_fused_infer_attention_score cannot take this paged call (None when it can)."""
    if block_size not in PAGED_PREFILL_BLOCK_SIZES:
        return f"block_size {block_size} is not a multiple of 128 up to 512 (paged prefill)"
    if query.shape[1] % num_kv_heads or query.shape[1] // num_kv_heads > MAX_HEADS_PER_KV_HEAD:
        return f"{query.shape[1]} query heads over {num_kv_heads} kv heads is not a group of at most 64"
    if num_kv_heads * head_dim > MAX_KV_HIDDEN:
        return f"kv_heads * head_dim = {num_kv_heads * head_dim} is above {MAX_KV_HIDDEN}"
    if 0 in meta.query_lens_host:
        return "a prefill row computes no token"
    return None


def _decode(query, key_cache, value_cache, meta, scale):
    _, _, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)                                  # [rows, heads, head_dim]
    # ATB reads the context lengths on the host: build them from the host copy (no sync).
    context_lens = torch.tensor(meta.seq_lens_host, dtype=torch.int32)          # [rows] cpu
    load_torch_npu()._npu_paged_attention(
        query=query.contiguous(), key_cache=key_cache, value_cache=value_cache,
        num_kv_heads=num_kv_heads, num_heads=query.shape[1], scale_value=float(scale),
        block_table=meta.block_tables[:meta.num_rows].to(torch.int32), context_lens=context_lens,
        out=out)
    return out


def _prefill(query, key_cache, value_cache, meta, scale):
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    key = key_cache.view(num_blocks, block_size, num_kv_heads * head_dim)    # paged BSH view
    value = value_cache.view(num_blocks, block_size, num_kv_heads * head_dim)
    # TND: actual_seq_lengths are the CUMULATIVE query lengths, actual_seq_lengths_kv the per-row
    # context lengths. sparse_mode=3 aligns the causal mask bottom-right: token i of a row with
    # q_len tokens and ctx context sees positions <= ctx - q_len + i (the reference rule).
    out, _ = load_torch_npu().npu_fused_infer_attention_score(
        query=query.contiguous(), key=key, value=value, atten_mask=_causal_mask(query.device),
        block_table=meta.block_tables[:meta.num_rows].to(torch.int32), input_layout="TND",
        block_size=block_size, actual_seq_lengths=list(itertools.accumulate(meta.query_lens_host)),
        actual_seq_lengths_kv=list(meta.seq_lens_host), num_key_value_heads=num_kv_heads,
        num_heads=query.shape[1], scale=float(scale), sparse_mode=3)
    return out                                                     # [tokens, heads, head_dim]


@functools.lru_cache(maxsize=8)
def _causal_mask(device: torch.device) -> torch.Tensor:
    """[2048, 2048] bool, True above the diagonal (= masked), built once per device."""
    return torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device), diagonal=1)


def _norm_rank(x: torch.Tensor) -> str | None:
    return None if 2 <= x.dim() <= 8 else f"x is {x.dim()}-D (the fused norm takes 2-D to 8-D)"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference contract. torch-npu does not document the op's rounding order; expect about one
    bf16 step from the reference (docs/npu.md)."""
    reason = _unsupported((x, weight), NORM_DTYPES) or _norm_rank(x)
    if reason is not None:
        warn_fallback("rms_norm", reason)
        return reference.rms_norm(x, weight, eps)
    return load_torch_npu().npu_rms_norm(x, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference contract: (rms_norm(x + residual), x + residual)."""
    reason = _unsupported((x, residual, weight), NORM_DTYPES) or _norm_rank(x)
    if reason is not None:
        warn_fallback("add_rms_norm", reason)
        return reference.add_rms_norm(x, residual, weight, eps)
    y, _, summed = load_torch_npu().npu_add_rms_norm(x, residual, weight, eps)
    return y, summed


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference contract. The fused op rotates in place and wants 4-D BSND tensors, so q and k
    are copied into [1, T, heads, D] buffers first (the caller's tensors are left unchanged)."""
    tokens, num_heads, head_dim = q.shape
    reason = _unsupported((q, k), NORM_DTYPES)
    if reason is None and head_dim not in ROPE_HEAD_DIMS:
        reason = f"head_dim {head_dim} is not 64 or 128"
    if reason is not None:
        warn_fallback("rope", reason)
        return reference.rope(q, k, cos, sin)
    q4 = q.reshape(1, tokens, num_heads, head_dim).clone(memory_format=torch.contiguous_format)
    k4 = k.reshape(1, tokens, k.shape[1], head_dim).clone(memory_format=torch.contiguous_format)
    cos4 = cos.to(q.dtype).reshape(1, tokens, 1, head_dim).contiguous()      # [1, T, 1, D]
    sin4 = sin.to(q.dtype).reshape(1, tokens, 1, head_dim).contiguous()
    load_torch_npu().npu_apply_rotary_pos_emb(q4, k4, cos4, sin4, layout="BSND", rotary_mode="half")
    return q4.view(tokens, num_heads, head_dim), k4.view(tokens, k.shape[1], head_dim)
