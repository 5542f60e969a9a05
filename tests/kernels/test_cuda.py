"""The cuda kernel set (pure torch, run here on the CPU) against the reference set and float64.

Tolerances: against the reference set, float32 atol = rtol = 1e-5 and bfloat16 atol = rtol = 2e-2
(the two sets round differently: SDPA's fused kernels accumulate in their own order, the split-KV
merge rescales partial sums); against float64, those of kernels/README.md; ``write_kv``
bit-identical. Contexts reach past ``cuda.TILE`` so that rows span several split-KV tiles.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from qwen_npu.kernels import cuda
from qwen_npu.kernels import reference as ref
from test_reference import (
    DECODE_ROWS,
    PREFILL_ROWS,
    TOL,
    assert_no_host_sync,
    bits,
    build_case,
    naive_attention,
    naive_write,
)

DTYPES = list(TOL)
LONG = [(cuda.TILE * 2 + 37, 1), (3, 1), (cuda.TILE - 1, 1), (cuda.TILE, 1)]     # 1 to 3 tiles per row
MIXED = [(20, 1), (0, 9), (cuda.TILE + 5, 1), (16, 16), (40, 0), (7, 3), (2 * cuda.TILE, 1)]
CHUNKS = [(0, 5), (7, 3), (300, 40), (3, 2), (1, 33)]                               # several buckets
CASES = {"prefill": PREFILL_ROWS, "decode": DECODE_ROWS, "long-decode": LONG, "mixed": MIXED, "chunks": CHUNKS}


def both(rows, block_size, gqa, dtype, head_dim=8, **kw):
    meta, query, kc, vc, dense, _ = build_case(rows, block_size, 2, gqa, head_dim, dtype, **kw)
    scale = head_dim ** -0.5
    return (meta, query, kc, vc, dense, scale, cuda.paged_attention(query, kc, vc, meta, scale),
            ref.paged_attention(query, kc, vc, meta, scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [1, 2, 5])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_the_reference_and_dense(case, block_size, gqa, dtype):
    rows = CASES[case]
    _, query, _, _, dense, scale, got, want = both(rows, block_size, gqa, dtype)
    assert got.shape == query.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(got.double(), naive_attention(query, rows, dense, gqa, scale), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_realistic_head_counts(dtype):
    """Qwen3 heads (head_dim 128, 8 query heads per kv head) and a chunk after a long prefix."""
    rows = [(600, 64), (90, 1), (0, 17)]
    _, _, _, _, _, _, got, want = both(rows, 16, 8, dtype, head_dim=128)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_one_token_rows_agree_through_the_decode_and_the_prefill_path():
    meta, query, kc, vc, _, scale, decode, _ = both(LONG, 4, 2, torch.float32)
    assert meta.is_decode
    as_prefill = cuda.paged_attention(query, kc, vc, dataclasses.replace(meta, is_decode=False), scale)
    torch.testing.assert_close(as_prefill, decode, atol=1e-6, rtol=1e-6)


def test_replicated_padding_rows_give_identical_outputs():
    """decode_padding="replicate": padding rows repeat row 0's token, table and slot."""
    meta, query, kc, vc, _, _ = build_case([(13, 1)], 4, 2, 2, 8, torch.float32)[:6]
    n = 4
    rep = dataclasses.replace(meta, positions=meta.positions.repeat(n), slot_mapping=meta.slot_mapping.repeat(n),
                              block_tables=meta.block_tables.repeat(n, 1), seq_lens=meta.seq_lens.repeat(n),
                              query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                              query_lens_host=(1,) * n, seq_lens_host=meta.seq_lens_host * n)
    out = cuda.paged_attention(query.repeat(n, 1, 1), kc, vc, rep, 0.3)
    assert all(torch.equal(out[i], out[0]) for i in range(n))
    torch.testing.assert_close(out[:1], ref.paged_attention(query, kc, vc, meta, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("poison", [float("nan"), 1e30, float("inf")])
@pytest.mark.parametrize("case", ["decode", "long-decode", "mixed", "chunks"])
def test_a_row_never_reads_another_rows_blocks(poison, case):
    """Tile and bucket padding read the row's own position 0, never a slot outside its context."""
    meta, query, kc, vc, _, tables = build_case(CASES[case], 4, 2, 2, 8, torch.float32, pad_cols=3)
    base = cuda.paged_attention(query, kc, vc, meta, 0.35)
    assert torch.isfinite(base).all()
    start = 0
    for row, (table, q_len) in enumerate(zip(tables, meta.query_lens_host)):
        kp, vp = kc.clone(), vc.clone()
        others = [b for b in range(kc.shape[0]) if b not in table]
        kp[others] = poison
        vp[others] = poison
        out = cuda.paged_attention(query, kp, vp, meta, 0.35)
        assert torch.equal(out[start:start + q_len], base[start:start + q_len]), f"row {row} read other blocks"
        start += q_len


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slots", [[5, -1, 9, -1, 0], [-1, -1, -1], [-1, 3], [7], [], [0, -1]],
                         ids=["mixed", "all-skipped", "skip-first", "one", "empty", "slot-0-kept"])
def test_write_kv_is_bit_identical_to_the_naive_write(slots, dtype):
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(3, 4, 2, 8, generator=gen).to(dtype)
    kc[0, 0, 0, 0] = float("nan")                 # slot 0 is re-written as it is when none is kept
    vc = torch.randn(3, 4, 2, 8, generator=gen).to(dtype)
    key, value = torch.randn(2, len(slots), 2, 8, generator=gen).to(dtype)
    want_k, want_v = naive_write(kc, vc, key, value, slots)
    for index_dtype in (torch.int64, torch.int32):
        k, v = kc.clone(), vc.clone()
        cuda.write_kv(key, value, k, v, torch.tensor(slots, dtype=index_dtype))
        assert torch.equal(bits(k), bits(want_k)) and torch.equal(bits(v), bits(want_v))


def test_write_kv_casts_and_sees_a_slot_mapping_changed_in_place():
    """The redirect is kept per slot-mapping tensor, and rebuilt once the tensor is written to."""
    kc = torch.zeros(2, 2, 1, 4, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    key = torch.randn(2, 1, 4)
    slots = torch.tensor([3, -1])
    cuda.write_kv(key, key * 2, kc, vc, slots)
    assert torch.equal(kc[1, 1], key[0].bfloat16()) and torch.equal(vc[1, 1], (key[0] * 2).bfloat16())
    slots[0], slots[1] = -1, 0
    cuda.write_kv(key, key * 2, kc, vc, slots)
    assert torch.equal(kc[0, 0], key[1].bfloat16()) and torch.equal(kc[1, 1], key[0].bfloat16())


def test_an_edited_block_table_is_read_afresh():
    """The per-step plan is kept for the metadata object and rebuilt once its tensors change in place."""
    meta, query, kc, vc, _, _ = build_case([(9, 1), (9, 1), (30, 1)], 4, 2, 2, 8, torch.float32)
    first = cuda.paged_attention(query, kc, vc, meta, 0.3)
    assert torch.equal(cuda.paged_attention(query, kc, vc, meta, 0.3), first)
    meta.block_tables[[0, 1]] = meta.block_tables[[1, 0]]            # the same object, edited
    again = cuda.paged_attention(query, kc, vc, meta, 0.3)
    torch.testing.assert_close(again, ref.paged_attention(query, kc, vc, meta, 0.3), atol=1e-5, rtol=1e-5)
    assert not torch.equal(again[:2], first[:2]) and torch.equal(again[2], first[2])


@pytest.mark.parametrize("case", list(CASES))
def test_write_kv_and_paged_attention_make_no_host_sync(case):
    assert_no_host_sync(cuda, CASES[case])


def test_norms_and_rope_are_the_references():
    assert (cuda.rms_norm, cuda.add_rms_norm, cuda.rope) == (ref.rms_norm, ref.add_rms_norm, ref.rope)
