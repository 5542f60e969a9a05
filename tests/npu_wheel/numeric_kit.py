"""A stand-in for torch_npu that computes what each op's documentation says it computes.

``BehavingStandIn`` records every call like ``StandIn``, binds it against the wheel's signature
and applies every rule (values included: block ids, slots), then answers with real numbers on
the CPU, each output's shape and dtype checked against the wheel's meta registration:

    npu_scatter_pa_kv_cache          ND caches (cache_mode "Norm"), in place; slot -1 skipped
    npu_fused_infer_attention_score  TND, sparse_mode 3 (bottom-right causal, the mask True above
                                     the diagonal); paged: reads blocks through block_table and
                                     refuses an id outside the cache (the op does not check);
                                     unpaged: cumulative kv lengths over the given key/value
    _npu_paged_attention             one query per row over context_lens (a host tensor), into out
    npu_rms_norm, npu_add_rms_norm   float32 normalisation, (y, rstd[, x1 + x2])
    npu_apply_rotary_pos_emb         functional: rotated copies, the inputs unchanged

The formulas are written here from the documentation, not taken from the reference kernels, so a
kernel that calls an op wrongly (or drops its results) disagrees with the reference.
"""
from __future__ import annotations

import math

import torch
from rules_kit import check_call
from standin_kit import Call, StandIn

CAUSAL_2048 = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


class StandInError(AssertionError):
    pass


def _attend(q, k, v, scale, visible):
    """q [L, H, D], k/v [S, KV, D], visible [L, S] -> [L, H, D], float32 softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.float(), k) * scale
    probs = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
    v = torch.where(visible.any(0)[:, None, None], v, torch.zeros_like(v))   # unread slots may be NaN
    return torch.einsum("hls,shd->lhd", probs, v).to(q.dtype)


def _causal(q_len, kv_len):
    """Token i of the query sees positions <= kv_len - q_len + i (rightDownCausal)."""
    return torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]


def _blocks(op, table_row, kv_len, block_size, num_blocks):
    ids = table_row[:math.ceil(kv_len / block_size)].long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise StandInError(f"{op}: block id outside the cache read for a length of {kv_len}: {ids.tolist()}")
    return ids


def scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, cache_mode, **_):
    keep = slot_mapping >= 0
    for src, cache in ((key, key_cache), (value, value_cache)):
        cache.view(-1, *cache.shape[2:])[slot_mapping[keep].long()] = src[keep]


def fused_infer_attention_score(query, key, value, *, atten_mask, block_table, actual_seq_lengths,
                                actual_seq_lengths_kv, num_key_value_heads, scale, block_size, **_):
    op = "npu_fused_infer_attention_score"
    if not torch.equal(atten_mask.reshape(2048, 2048).bool().cpu(), CAUSAL_2048):
        raise StandInError(f"{op}: sparse_mode 3 takes the 2048x2048 mask True above the diagonal")
    out = torch.empty_like(query)
    q_start = kv_start = 0
    for b, q_end in enumerate(actual_seq_lengths):
        q = query[q_start:q_end]
        if block_table is None:                                    # cumulative kv lengths
            kv_end = actual_seq_lengths_kv[b]
            k, v = key[kv_start:kv_end], value[kv_start:kv_end]
            kv_start = kv_end
        else:
            kv_len = actual_seq_lengths_kv[b]
            ids = _blocks(op, block_table[b], kv_len, block_size, key.shape[0])
            shape = (-1, num_key_value_heads, query.shape[2])
            k = key[ids].reshape(shape)[:kv_len]
            v = value[ids].reshape(shape)[:kv_len]
        if q.shape[0]:
            out[q_start:q_end] = _attend(q, k, v, scale, _causal(q.shape[0], k.shape[0]))
        q_start = q_end
    return out, torch.empty(0, dtype=torch.float32)


def paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                    context_lens, out, **_):
    for row, n in enumerate(context_lens.tolist()):
        ids = _blocks("_npu_paged_attention", block_table[row], n, key_cache.shape[1], key_cache.shape[0])
        k, v = key_cache[ids].flatten(0, 1)[:n], value_cache[ids].flatten(0, 1)[:n]
        out[row:row + 1] = _attend(query[row:row + 1], k, v, scale_value, torch.ones(1, n, dtype=torch.bool))


def rms_norm(self, gamma, epsilon=1e-6):       # the wheel's schema calls x "self"
    x = self
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + epsilon)
    return gamma * (x.float() * rstd).to(x.dtype), rstd


def add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    summed = x1 + x2
    y, rstd = rms_norm(summed, gamma, epsilon)
    return y, rstd, summed


def apply_rotary_pos_emb(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    return rotate(query), rotate(key)


OPS = {"npu_scatter_pa_kv_cache": scatter_pa_kv_cache,
       "npu_fused_infer_attention_score": fused_infer_attention_score,
       "_npu_paged_attention": paged_attention, "npu_rms_norm": rms_norm,
       "npu_add_rms_norm": add_rms_norm, "npu_apply_rotary_pos_emb": apply_rotary_pos_emb}


class BehavingStandIn(StandIn):
    """A torch_npu whose ops compute (see the module docstring); every call is bound and checked
    against the wheel first, and each output's shape and dtype is the wheel's meta answer."""

    def __init__(self, meta, signatures, support=None):
        super().__init__(meta, support)
        self._signatures = signatures

    def __getattr__(self, op):
        if op.startswith("__"):
            raise AttributeError(op)
        if op not in OPS:
            raise StandInError(f"the stand-in has no {op}")

        def call(*args, **kwargs):
            recorded = Call(op, args, dict(kwargs), None)
            bound = check_call(self._signatures, recorded, values=True)
            result = OPS[op](**bound)
            if op in self._meta.registered:
                self._same_outputs(op, result, self._meta.run(op, *args, **kwargs))
            recorded.result = result
            self.calls.append(recorded)
            return result
        return call

    @staticmethod
    def _same_outputs(op, got, want):
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        shapes = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in got]
        wanted = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in want]
        if shapes != wanted:
            raise StandInError(f"{op}: the stand-in answered {shapes}, the wheel's meta function says {wanted}")
