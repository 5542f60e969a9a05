"""Ascend NPU kernels: the reference contract (README.md) on torch_npu's fused ops, the KV write,
attention and norms called the way vllm-ascend calls them on A2/A3 (rope is not: vllm-ascend
calls npu_apply_rotary_pos_emb only on 310P; docs/npu.md has the reference and the wheel's words).

torch_npu is loaded through ``qwen_npu.device.npu_runtime.load_torch_npu`` at the first call that
needs it, never at import, so ``import qwen_npu.kernels.npu`` works on any machine. Each function
checks whether its fused op can express the call; where it cannot (tensors not on an npu,
float32 where the op wants fp16/bf16, a block size or head_dim the op does not take, an op the
installed stack lacks, ...) it runs the reference kernel instead and says so with a
RuntimeWarning ONCE per (function, reason).

    function         fused op                                       falls back when
    write_kv         npu_scatter_pa_kv_cache, cache_mode="Norm"     cache not fp16/bf16/fp32
                       (ND cache; the op skips slot -1)
    paged_attention  npu_fused_infer_attention_score (FIA), TND,    dtype not fp16/bf16,
                       sparse_mode=3, 2048x2048 causal mask:        head_dim % 16, > 64 query
                       all-fresh batch: unpaged (K/V by position)   heads per kv head,
                       otherwise paged, decode included             paged: block_size not 128..512
                                                                    in 128s, kv_heads * D > 65535,
                                                                    a row with no token
                     decode where FIA cannot: _npu_paged_attention  (ATB: block_size % 16,
                       (ATB, when the stack has NNAL; all-fresh       block_size * D > 128 * 128)
                       one-token rows included)
    rms_norm         npu_rms_norm                                   weight dtype != x dtype, x not 2-8-D
    add_rms_norm     npu_add_rms_norm                               (same)
    rope             npu_apply_rotary_pos_emb, BSND, "half"         head_dim not 64 or 128

No custom op ever gets an empty tensor: a call with no rows returns its empty result without the
op. Block tables reach the ops padded with block 0, never -1 (``npu_step``). The results of a
functional op (its schema returns tensors) are what the kernel returns. Host data only comes from
the host copies in AttentionMetadata (no device-to-host sync).
"""
from __future__ import annotations

import functools

import torch

from qwen_npu.device.npu_runtime import installed_op_support, load_torch_npu
from qwen_npu.errors import warn

from . import reference
from .metadata import AttentionMetadata
from .npu_step import step_inputs

NAME = "npu"

HALF_DTYPES = (torch.float16, torch.bfloat16)
NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)    # npu_scatter_pa_kv_cache's float types
MASK_SIZE = 2048   # sparse_mode=3 takes one compressed [2048, 2048] causal mask for any length
DEVICE_TYPE = "npu"   # the device type the fused ops run on (the CPU stand-in tests point it at "cpu")
ROPE_HEAD_DIMS = (64, 128)          # npu_apply_rotary_pos_emb on A2/A3: D must be 128 or 64
PAGED_BLOCK_SIZES = range(128, 513, 128)   # FIA with a paged cache: 128..512, in steps of 128
MAX_HEADS_PER_KV_HEAD = 64
MAX_KV_HIDDEN = 65535               # (blocks, block_size, kv_heads * head_dim) cache layout limit
FIA, ATB_DECODE = "npu_fused_infer_attention_score", "_npu_paged_attention"


@functools.cache
def warn_fallback(op: str, reason: str) -> None:
    """Say once per (op, reason) that ``op`` runs the reference kernel (``cache_clear`` re-arms)."""
    warn(f"qwen_npu.kernels.npu.{op}: {reason}; running the reference kernel instead", RuntimeWarning)


def op_support() -> dict[str, str | None]:
    """{op: None where the installed stack runs it, else why not} (``npu_runtime.op_support``)."""
    return installed_op_support()


def _missing(op: str) -> str | None:
    return op_support().get(op, f"torch_npu is not loaded, so {op} is unavailable")


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
    """Reference contract. ``npu_scatter_pa_kv_cache`` with the ND cache layout
    (``cache_mode="Norm"``; the op's default is the NZ layout) skips slot -1 itself, as
    vllm-ascend's tests of the op assert, so skipped tokens go to the op as they are."""
    reason = _unsupported((key_cache, value_cache), KV_DTYPES) or _missing("npu_scatter_pa_kv_cache")
    if reason is not None:
        warn_fallback("write_kv", reason)
        return reference.write_kv(key, value, key_cache, value_cache, slot_mapping)
    if slot_mapping.shape[0] == 0:
        return None                                     # no empty tensor to the op
    load_torch_npu().npu_scatter_pa_kv_cache(
        key=key.to(key_cache.dtype).contiguous(), value=value.to(value_cache.dtype).contiguous(),
        key_cache=key_cache, value_cache=value_cache,
        slot_mapping=slot_mapping.to(torch.int32).contiguous(), cache_mode="Norm")
    return None


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Reference contract. A batch of only fresh prompts (nothing cached before) runs FIA
    unpaged on the step's own K/V (each position read through the block table, as the
    reference reads it); every other batch, pure decode included, runs FIA over the paged
    cache; a decode FIA cannot take (all-fresh or not) runs ATB paged attention where the stack
    has it."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    reason = _unsupported((query, key_cache, value_cache), HALF_DTYPES)
    if reason is None and head_dim % 16:
        reason = f"head_dim {head_dim} is not a multiple of 16"
    if reason is None and (query.shape[1] % num_kv_heads or query.shape[1] // num_kv_heads > MAX_HEADS_PER_KV_HEAD):
        reason = f"{query.shape[1]} query heads over {num_kv_heads} kv heads is not a group of at most 64"
    if reason is not None:
        warn_fallback("paged_attention", reason)
        return reference.paged_attention(query, key_cache, value_cache, meta, scale)
    if query.shape[0] == 0:
        return torch.empty_like(query)                  # no empty tensor to the op
    inputs = step_inputs(meta, block_size, query.device)
    if inputs.all_fresh:
        reason = _missing(FIA)
        if reason is None:
            return _fia_unpaged(query, key_cache, value_cache, inputs, scale)
    else:
        reason = _missing(FIA) or _paged_unsupported(meta, block_size, num_kv_heads, head_dim)
        if reason is None:
            return _fia_paged(query, key_cache, value_cache, inputs, scale)
    if meta.is_decode:                                  # all-fresh one-token rows included
        atb = _missing(ATB_DECODE) or _atb_unsupported(block_size, head_dim)
        if atb is None:
            return _atb_decode(query, key_cache, value_cache, inputs, scale)
        reason = f"{reason}, and {ATB_DECODE} cannot either: {atb}"
    warn_fallback("paged_attention", reason)
    return reference.paged_attention(query, key_cache, value_cache, meta, scale)


def _paged_unsupported(meta, block_size, num_kv_heads, head_dim) -> str | None:
    """Why FIA cannot take this call over the paged cache (None when it can)."""
    if block_size not in PAGED_BLOCK_SIZES:
        return f"block_size {block_size} is not a multiple of 128 up to 512 (paged FIA)"
    if num_kv_heads * head_dim > MAX_KV_HIDDEN:
        return f"kv_heads * head_dim = {num_kv_heads * head_dim} is above {MAX_KV_HIDDEN}"
    if 0 in meta.query_lens_host:
        return "a row computes no token"
    return None


def _atb_unsupported(block_size, head_dim) -> str | None:
    if block_size % 16:
        return f"block_size {block_size} is not a multiple of 16"
    if head_dim > 256 or block_size * head_dim > 128 * 128:
        return f"block_size * head_dim = {block_size * head_dim} is above 128 * 128 (or head_dim above 256)"
    return None


def _fia_paged(query, key_cache, value_cache, inputs, scale):
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    # TND: actual_seq_lengths are the CUMULATIVE query lengths, actual_seq_lengths_kv the per-row
    # context lengths. sparse_mode=3 aligns the causal mask bottom-right: token i of a row with
    # q_len tokens and ctx context sees positions <= ctx - q_len + i (the reference rule).
    out, _ = load_torch_npu().npu_fused_infer_attention_score(
        query=query.contiguous(), key=key_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
        value=value_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
        atten_mask=_causal_mask(query.device), block_table=inputs.block_table, input_layout="TND",
        block_size=block_size, actual_seq_lengths=inputs.query_ends, actual_seq_lengths_kv=inputs.seq_lens,
        num_key_value_heads=num_kv_heads, num_heads=query.shape[1], scale=float(scale), sparse_mode=3)
    return out                                                     # [tokens, heads, head_dim]


def _fia_unpaged(query, key_cache, value_cache, inputs, scale):
    """Every row is a whole fresh prompt: its context is the step's own positions, read through
    the block table in token order (``inputs.fresh_slots``, built once per step), as the
    reference reads them; TND, kv lengths = query lengths, both cumulative in the unpaged form."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    slots = inputs.fresh_slots
    key = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)      # [tokens, kv, D]
    value = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
    out, _ = load_torch_npu().npu_fused_infer_attention_score(
        query=query.contiguous(), key=key, value=value, atten_mask=_causal_mask(query.device),
        input_layout="TND", actual_seq_lengths=inputs.query_ends, actual_seq_lengths_kv=inputs.query_ends,
        num_key_value_heads=num_kv_heads, num_heads=query.shape[1], scale=float(scale), sparse_mode=3)
    return out


def _atb_decode(query, key_cache, value_cache, inputs, scale):
    out = torch.empty_like(query)                                  # [rows, heads, head_dim]
    load_torch_npu()._npu_paged_attention(
        query=query.contiguous(), key_cache=key_cache, value_cache=value_cache,
        num_kv_heads=key_cache.shape[2], num_heads=query.shape[1], scale_value=float(scale),
        block_table=inputs.block_table, context_lens=inputs.context_lens, out=out)
    return out


@functools.lru_cache(maxsize=8)
def _causal_mask(device: torch.device) -> torch.Tensor:
    """[2048, 2048] bool, True above the diagonal (= masked), built once per device."""
    return torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device), diagonal=1)


def _norm_unsupported(tensors, op) -> str | None:
    x = tensors[0]
    reason = _unsupported(tensors, NORM_DTYPES) or _missing(op)
    if reason is None and not 2 <= x.dim() <= 8:
        reason = f"x is {x.dim()}-D (the fused norm takes 2-D to 8-D)"
    return reason


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference contract. torch-npu does not document the op's rounding order; expect about one
    bf16 step from the reference (docs/npu.md)."""
    reason = _norm_unsupported((x, weight), "npu_rms_norm")
    if reason is not None:
        warn_fallback("rms_norm", reason)
        return reference.rms_norm(x, weight, eps)
    if x.numel() == 0:
        return torch.empty_like(x)                      # no empty tensor to the op
    return load_torch_npu().npu_rms_norm(x, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference contract: (rms_norm(x + residual), x + residual). The final norm of a step whose
    tokens need no logits has no rows: then no op runs."""
    reason = _norm_unsupported((x, residual, weight), "npu_add_rms_norm")
    if reason is not None:
        warn_fallback("add_rms_norm", reason)
        return reference.add_rms_norm(x, residual, weight, eps)
    if x.numel() == 0:
        return torch.empty_like(x), x + residual        # no empty tensor to the op
    y, _, summed = load_torch_npu().npu_add_rms_norm(x, residual, weight, eps)
    return y, summed


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference contract. The op wants 4-D BSND tensors and returns the rotated pair; its
    schema is functional while its docstring says it updates its inputs in place, so it gets
    [1, T, heads, D] copies (the caller's tensors stay unchanged either way) and the kernel
    returns what the op returns."""
    tokens, num_heads, head_dim = q.shape
    reason = _unsupported((q, k), NORM_DTYPES) or _missing("npu_apply_rotary_pos_emb")
    if reason is None and head_dim not in ROPE_HEAD_DIMS:
        reason = f"head_dim {head_dim} is not 64 or 128"
    if reason is not None:
        warn_fallback("rope", reason)
        return reference.rope(q, k, cos, sin)
    if tokens == 0:
        return torch.empty_like(q), torch.empty_like(k)  # no empty tensor to the op
    q4 = q.reshape(1, tokens, num_heads, head_dim).clone(memory_format=torch.contiguous_format)
    k4 = k.reshape(1, tokens, k.shape[1], head_dim).clone(memory_format=torch.contiguous_format)
    cos4 = cos.to(q.dtype).reshape(1, tokens, 1, head_dim).contiguous()      # [1, T, 1, D]
    sin4 = sin.to(q.dtype).reshape(1, tokens, 1, head_dim).contiguous()
    q_out, k_out = load_torch_npu().npu_apply_rotary_pos_emb(q4, k4, cos4, sin4, layout="BSND",
                                                             rotary_mode="half")
    return q_out.view(tokens, num_heads, head_dim), k_out.view(tokens, k.shape[1], head_dim)
