"""Prefill rows on AMX tiles (csrc/attention_amx.cpp) against dense float64 attention and the fp32
tile, on a CPU whose tiles the C++ kernels can use.

Rows start at position 0 or past a cached prefix, cross the kernel's 64-position blocks and its
groups of 16 query rows (tokens x query heads) at every remainder, and share steps with decode
rows; GQA ratios 1 to 8, head_dim from 32 to 256 (96 and 160: dblocks not a multiple of four),
block sizes that put a block's 16 positions side by side or not. Shapes it cannot take (head_dim
not a multiple of 32) run the bf16 tile instead."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from qwen_npu.kernels import cpu
from test_reference import TOL, build_case, naive_attention

pytestmark = pytest.mark.skipif(not (cpu.available() and cpu.amx_tiles()), reason="no AMX tiles for the C++ kernels")

ROWS = [(0, 70), (61, 9), (5, 33), (0, 1), (200, 17), (0, 64), (63, 65), (0, 2), (17, 130)]


def attend(meta, query, kc, vc, scale, *, amx, bf16_dot=True):
    return cpu.ops().paged_attention(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                     scale, bf16_dot, amx=amx)


@pytest.mark.parametrize("kv_heads, gqa, head_dim", [(2, 2, 128), (1, 1, 32), (2, 5, 64), (1, 3, 256),
                                                     (3, 4, 96), (1, 8, 160), (2, 7, 192)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_prefill_rows_match_dense_and_the_fp32_tile(kv_heads, gqa, head_dim, block_size):
    meta, query, kc, vc, dense, _ = build_case(ROWS, block_size, kv_heads, gqa, head_dim, torch.bfloat16, seed=4)
    scale = head_dim ** -0.5
    tiles = attend(meta, query, kc, vc, scale, amx=True)
    fp32 = attend(meta, query, kc, vc, scale, amx=False, bf16_dot=False)
    want = naive_attention(query, ROWS, dense, gqa, scale)
    torch.testing.assert_close(tiles.double(), want, **TOL[torch.bfloat16])
    torch.testing.assert_close(tiles.float(), fp32.float(), atol=8e-3, rtol=8e-3)   # P in bf16, sums reordered
    assert not torch.equal(tiles, attend(meta, query, kc, vc, scale, amx=False))     # not the bf16 tile


def test_a_shape_the_tiles_cannot_take_runs_the_bf16_tile():
    meta, query, kc, vc, _, _ = build_case(ROWS, 16, 2, 2, 48, torch.bfloat16, seed=2)
    assert torch.equal(attend(meta, query, kc, vc, 0.1, amx=True), attend(meta, query, kc, vc, 0.1, amx=False))


def test_the_session_path_runs_every_bf16_row_on_the_tiles(monkeypatch):
    """cpu.paged_attention hands prefill rows to the C++ kernel here (not to torch's SDPA)."""
    meta, query, kc, vc, dense, _ = build_case(ROWS, 16, 2, 2, 128, torch.bfloat16, seed=6)
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = cpu.paged_attention(query, kc, vc, meta, 0.1)
    assert calls == []
    assert torch.equal(out, attend(meta, query, kc, vc, 0.1, amx=True))


def test_a_token_s_bits_do_not_depend_on_the_other_queries_of_its_group():
    """The same prompt prefilled whole and from its second token on (a cached first token): every
    query row then sits in another group of 16, next to other rows, and gets the same bits."""
    meta, query, kc, vc, _, _ = build_case([(0, 90)], 16, 2, 3, 64, torch.bfloat16, seed=8)
    whole = attend(meta, query, kc, vc, 0.1, amx=True)
    later = dataclasses.replace(meta, positions=meta.positions[1:], slot_mapping=meta.slot_mapping[1:],
                                query_start_loc=torch.tensor([0, 89], dtype=torch.int32), query_lens_host=(89,))
    assert torch.equal(attend(later, query[1:], kc, vc, 0.1, amx=True), whole[1:])


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 1e30])
def test_a_row_reads_only_its_own_context(poison):
    meta, query, kc, vc, _, tables = build_case(ROWS, 16, 2, 2, 128, torch.bfloat16, seed=3, poison=poison)
    base = attend(meta, query, kc, vc, 0.1, amx=True)
    assert torch.isfinite(base).all()
    starts = [0]
    for _, q in ROWS:
        starts.append(starts[-1] + q)
    for row, table in enumerate(tables):
        kp, vp = kc.clone(), vc.clone()
        others = [b for b in range(kc.shape[0]) if b not in table]
        kp[others], vp[others] = -poison, 0.5
        assert torch.equal(attend(meta, query, kp, vp, 0.1, amx=True)[starts[row]:starts[row + 1]],
                           base[starts[row]:starts[row + 1]])


def test_a_nan_key_reaches_exactly_the_tokens_that_see_it():
    rows = [(0, 100), (30, 20)]
    meta, query, kc, vc, _, tables = build_case(rows, 16, 2, 2, 128, torch.bfloat16, seed=5)
    block, offset = divmod(40, 16)
    kc[int(tables[0][block]), offset, 1] = float("nan")       # position 40 of row 0, KV head 1
    out = attend(meta, query, kc, vc, 0.1, amx=True).float()
    heads = slice(2, 4)                                         # the query heads of KV head 1
    assert out[40:100, heads].isnan().all() and not out[:40, heads].isnan().any()
    assert not out[:100, :2].isnan().any() and not out[100:].isnan().any()


def test_a_row_of_no_tokens_reads_nothing():
    """A row with no tokens this step (its query_start_loc repeats) and only padding in its block
    table: the tiles make no work of it, as the other paths do (its table would point before the
    caches)."""
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(64, 64, 8, 256, generator=gen).bfloat16()    # 16 MiB: an allocation of its own
    vc = torch.randn(64, 64, 8, 256, generator=gen).bfloat16()
    query = torch.randn(20, 8, 256, generator=gen).bfloat16()
    tables = torch.full((2, 60), -1, dtype=torch.int32)
    tables[0, :2] = torch.tensor([3, 7])
    seq_lens = torch.tensor([120, 3000], dtype=torch.int32)
    starts = torch.tensor([0, 20, 20], dtype=torch.int32)
    ops = cpu.ops()
    tiles = ops.paged_attention(query, kc, vc, tables, seq_lens, starts, 0.1, True, amx=True)
    other = ops.paged_attention(query, kc, vc, tables, seq_lens, starts, 0.1, True, amx=False)
    torch.testing.assert_close(tiles.float(), other.float(), atol=8e-3, rtol=8e-3)
