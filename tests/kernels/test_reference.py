"""The reference kernels against naive dense formulas written independently here.

Tolerances (README.md): float32 atol = rtol = 1e-5; bfloat16 atol = rtol = 2e-2, both against a
float64 computation from the same (rounded) inputs.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from qwen_npu.kernels import AttentionMetadata
from qwen_npu.kernels import reference as ref
from torch.overrides import TorchFunctionMode

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = list(TOL)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern, so NaN == NaN and -0.0 != 0.0 when comparing caches."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


# --- a paged case built by hand ---------------------------------------------------------------

def build_case(rows, block_size, kv_heads, gqa, head_dim, dtype, seed=0, poison=float("nan"),
               pad_cols=2):
    """rows: [(tokens computed before, query_len)]. Every row owns distinct random blocks; block 0
    is owned by nobody and, like every slot outside a context, holds ``poison``. The K/V of the
    whole context (prefix + this chunk) is already in the cache, as the contract requires."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(done + q) // block_size) for done, q in rows]
    num_blocks = sum(need) + 3
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    kc = torch.full((num_blocks, block_size, kv_heads, head_dim), poison, dtype=dtype)
    vc = torch.full_like(kc, poison)
    bt = torch.full((len(rows), max(need) + pad_cols), -1, dtype=torch.int32)
    dense, positions, slots = [], [], []
    for r, ((done, q), table) in enumerate(zip(rows, tables)):
        bt[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(done + q, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(done + q, kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(done + q):
            kc[table[p // block_size], p % block_size] = k[p]
            vc[table[p // block_size], p % block_size] = v[p]
        dense.append((k, v))
        positions += range(done, done + q)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(done, done + q)]
    qlens = tuple(q for _, q in rows)
    seqs = tuple(done + q for done, q in rows)
    meta = AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=bt,
        seq_lens=torch.tensor(seqs, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32),
        query_lens_host=qlens, seq_lens_host=seqs, is_decode=all(q == 1 for q in qlens))
    query = torch.randn(sum(qlens), kv_heads * gqa, head_dim, generator=gen).to(dtype)
    return meta, query, kc, vc, dense, tables


def naive_attention(query, rows, dense, gqa, scale):
    """Token by token, head by head: softmax over positions 0..(its own position), in float64."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    t = 0
    for (done, q), (k, v) in zip(rows, dense):
        for i in range(q):
            visible = done + i + 1                     # its cached prefix + its chunk up to itself
            for h in range(query.shape[1]):
                kh = h // gqa
                s = (k[:visible, kh].double() @ query[t, h].double()) * scale
                out[t, h] = torch.softmax(s, 0) @ v[:visible, kh].double()
            t += 1
    return out


PREFILL_ROWS = [(0, 5), (7, 3), (16, 16), (3, 1), (30, 2)]   # fresh, mid-context, full blocks
DECODE_ROWS = [(5, 1), (15, 1), (31, 1), (0, 1), (63, 1)]     # contexts 6, 16, 32, 1, 64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [1, 2, 5])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("rows", [PREFILL_ROWS, DECODE_ROWS], ids=["prefill", "decode"])
def test_paged_attention_matches_dense(rows, block_size, gqa, dtype):
    meta, query, kc, vc, dense, _ = build_case(rows, block_size, 2, gqa, 8, dtype)
    scale = 8 ** -0.5
    out = ref.paged_attention(query, kc, vc, meta, scale)
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), naive_attention(query, rows, dense, gqa, scale), **TOL[dtype])


def test_decode_and_prefill_paths_agree_on_single_token_rows():
    meta, query, kc, vc, _, _ = build_case(DECODE_ROWS, 4, 2, 2, 8, torch.float32)
    as_prefill = dataclasses.replace(meta, is_decode=False)
    torch.testing.assert_close(ref.paged_attention(query, kc, vc, meta, 0.3),
                               ref.paged_attention(query, kc, vc, as_prefill, 0.3), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("poison", [float("nan"), 1e30, float("inf")])
@pytest.mark.parametrize("is_decode", [True, False])
def test_a_row_never_reads_another_rows_blocks(poison, is_decode):
    meta, query, kc, vc, _, tables = build_case(DECODE_ROWS, 4, 2, 2, 8, torch.float32, pad_cols=3)
    meta = dataclasses.replace(meta, is_decode=is_decode)
    base = ref.paged_attention(query, kc, vc, meta, 0.35)
    assert torch.isfinite(base).all()
    for row, table in enumerate(tables):
        kp, vp = kc.clone(), vc.clone()
        others = [b for b in range(kc.shape[0]) if b not in table]
        kp[others] = poison
        vp[others] = poison
        out = ref.paged_attention(query, kp, vp, meta, 0.35)
        assert torch.equal(out[row], base[row]), f"row {row} changed when other rows' blocks changed"


# --- write_kv ---------------------------------------------------------------------------------

def naive_write(kc, vc, key, value, slots):
    kc, vc = kc.clone(), vc.clone()
    bs = kc.shape[1]
    for t, s in enumerate(slots):
        if s >= 0:
            kc[s // bs, s % bs] = key[t].to(kc.dtype)
            vc[s // bs, s % bs] = value[t].to(vc.dtype)
    return kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slots", [[5, -1, 9, -1, 0], [-1, -1, -1], [-1, 3], [7], []],
                         ids=["mixed", "all-skipped", "skip-first", "one", "empty"])
def test_write_kv_skips_negative_slots_and_leaves_the_rest_bit_identical(slots, dtype):
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(3, 4, 2, 8, generator=gen).to(dtype)
    kc[0, 0, 0, 0] = float("nan")                 # slot 0 is a donor target when all are skipped
    vc = torch.randn(3, 4, 2, 8, generator=gen).to(dtype)
    key = torch.randn(len(slots), 2, 8, generator=gen).to(dtype)
    value = torch.randn(len(slots), 2, 8, generator=gen).to(dtype)
    want_k, want_v = naive_write(kc, vc, key, value, slots)
    ref.write_kv(key, value, kc, vc, torch.tensor(slots, dtype=torch.int64))
    assert torch.equal(bits(kc), bits(want_k)) and torch.equal(bits(vc), bits(want_v))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_write_kv_property(data):
    num_slots = data.draw(st.integers(1, 24))
    written = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=num_slots))
    slots = written + [-1] * data.draw(st.integers(0, 4))
    slots = data.draw(st.permutations(slots))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    kc = torch.randn(num_slots, 1, 3, 4, generator=gen)
    vc = torch.randn(num_slots, 1, 3, 4, generator=gen)
    key, value = torch.randn(2, len(slots), 3, 4, generator=gen)
    want_k, want_v = naive_write(kc, vc, key, value, slots)
    ref.write_kv(key, value, kc, vc, torch.tensor(slots, dtype=torch.int64))
    assert torch.equal(bits(kc), bits(want_k)) and torch.equal(bits(vc), bits(want_v))


def test_write_kv_casts_into_the_cache_dtype():
    kc = torch.zeros(2, 2, 1, 4, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    key = torch.randn(1, 1, 4)
    ref.write_kv(key, key * 2, kc, vc, torch.tensor([3]))
    assert torch.equal(kc[1, 1], key[0].bfloat16()) and torch.equal(vc[1, 1], (key[0] * 2).bfloat16())


# --- norms and rope ---------------------------------------------------------------------------

def naive_rms_norm(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_add_rms_norm_match_the_formula(dtype):
    gen = torch.Generator().manual_seed(2)
    x, res = (torch.randn(2, 6, 32, generator=gen) * 3).to(dtype)
    w = (torch.rand(32, generator=gen) + 0.5).to(dtype)
    y = ref.rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y.double(), naive_rms_norm(x, w, 1e-6), **TOL[dtype])
    y2, summed = ref.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(summed, x + res)
    torch.testing.assert_close(y2.double(), naive_rms_norm(x + res, w, 1e-6), **TOL[dtype])


def cos_sin(positions, head_dim, theta=1_000_000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = positions.double()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), -1)                           # [T, D]
    return emb.cos().float(), emb.sin().float()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_halves(dtype):
    gen = torch.Generator().manual_seed(3)
    t, d = 5, 16
    q = torch.randn(t, 4, d, generator=gen).to(dtype)
    k = torch.randn(t, 2, d, generator=gen).to(dtype)
    cos, sin = cos_sin(torch.tensor([0, 1, 7, 100, 4095]), d)
    rq, rk = ref.rope(q, k, cos, sin)
    for x, got in ((q, rq), (k, rk)):
        want = torch.empty(x.shape, dtype=torch.float64)
        for j in range(d // 2):      # pair (j, j + d/2) rotates by the angle of frequency j
            a, b = x[..., j].double(), x[..., j + d // 2].double()
            c, s = cos[:, None, j].double(), sin[:, None, j].double()
            want[..., j], want[..., j + d // 2] = a * c - b * s, b * c + a * s
        torch.testing.assert_close(got.double(), want, **TOL[dtype])


def test_rope_equals_transformers_apply_rotary_pos_emb():
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(7, 4, 32, generator=gen), torch.randn(7, 2, 32, generator=gen)
    cos, sin = cos_sin(torch.arange(7) * 3, 32)
    rq, rk = ref.rope(q, k, cos, sin)
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(rq, hq[0].transpose(0, 1)) and torch.equal(rk, hk[0].transpose(0, 1))


# --- no host sync -----------------------------------------------------------------------------

class NoHostSync(TorchFunctionMode):
    """Fails on every call that moves data to the host (or waits for the device)."""

    FORBIDDEN: ClassVar = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.__bool__,
                 torch.Tensor.numpy, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FORBIDDEN:
            raise AssertionError(f"host sync: Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


def test_the_guard_catches_syncs():
    x = torch.ones(2)
    for sync in (lambda: x.sum().item(), lambda: x.tolist(), lambda: x.cpu(), lambda: bool(x[0]),
                 lambda: x.numpy()):
        with NoHostSync(), pytest.raises(AssertionError, match="host sync"):
            sync()


def assert_no_host_sync(kernels, rows) -> None:
    """``kernels``' write_kv (some slots -1, all -1, none) and paged_attention over ``rows`` run
    without one host sync, and the attention is finite."""
    meta, query, kc, vc, _, _ = build_case(rows, 4, 2, 2, 8, torch.float32)
    key, value = torch.randn(2, meta.num_tokens, 2, 8)
    slots = meta.slot_mapping.clone()
    slots[::2] = -1
    with NoHostSync():
        kernels.write_kv(key, value, kc, vc, slots)
        kernels.write_kv(key, value, kc, vc, torch.full_like(slots, -1))
        kernels.write_kv(key, value, kc, vc, meta.slot_mapping)
        out = kernels.paged_attention(query, kc, vc, meta, 1 / math.sqrt(8))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("rows", [DECODE_ROWS, PREFILL_ROWS], ids=["decode", "prefill"])
def test_write_kv_and_paged_attention_make_no_host_sync(rows):
    assert_no_host_sync(ref, rows)
