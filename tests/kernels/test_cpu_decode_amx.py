"""Decode tokens with the scores on AMX tiles (csrc/attention_decode_amx.cpp) against dense
float64 attention and the fp32 decode kernel, on a CPU that has the tiles.

Block sizes 16 and 32 give the kernel whole blocks of 16 positions a fixed stride apart, which it
loads straight from the cache; 5 and 1 give it positions it must copy first; 8 gives both (two
blocks that happen to lie side by side are one stride). Contexts cover every remainder of 16 and
of the 32-position weighted-sum pass; GQA ratios 1 to 8 (a lone head where the ratio is odd);
head_dim from 32 to 256; shapes it cannot take (head_dim not a multiple of 32, more than 16 query
heads per KV head) run the other kernels instead. What a token reads and where a NaN in its
context goes are tested for both decode kernels in test_cpu_decode_bf16.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from qwen_npu.kernels import cpu
from test_reference import TOL, build_case, naive_attention

pytestmark = pytest.mark.skipif(not (cpu.available() and cpu.amx_tiles()), reason="the CPU has no AMX tiles")

CONTEXTS = [1, 2, 15, 16, 17, 31, 32, 33, 48, 100, 257]
ROWS = [(n - 1, 1) for n in CONTEXTS]


def attend(meta, query, kc, vc, scale, *, amx, bf16_dot=True):
    return cpu.ops().paged_attention(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                     scale, bf16_dot, amx=amx)


@pytest.mark.parametrize("kv_heads, gqa, head_dim", [(2, 2, 128), (1, 1, 32), (2, 5, 64), (1, 3, 256),
                                                     (3, 4, 96), (1, 8, 160), (2, 7, 192)])
@pytest.mark.parametrize("block_size", [16, 32, 8, 5, 1])
@pytest.mark.parametrize("rows", [ROWS, ROWS[-1:]], ids=["many-rows", "one-row"])   # one row: KV heads split
def test_decode_tokens_match_dense_and_the_fp32_kernel(kv_heads, gqa, head_dim, block_size, rows):
    meta, query, kc, vc, dense, _ = build_case(rows, block_size, kv_heads, gqa, head_dim, torch.bfloat16, seed=11)
    meta = dataclasses.replace(meta, is_decode=True)
    scale = head_dim ** -0.5
    tiles = attend(meta, query, kc, vc, scale, amx=True)
    fp32 = attend(meta, query, kc, vc, scale, amx=False, bf16_dot=False)
    want = naive_attention(query, rows, dense, gqa, scale)
    torch.testing.assert_close(tiles.double(), want, **TOL[torch.bfloat16])
    # the order of the sums along D is the one difference from the fp32 kernel (P stays fp32)
    torch.testing.assert_close(tiles.float(), fp32.float(), atol=4e-3, rtol=4e-3)
    assert not torch.equal(tiles, attend(meta, query, kc, vc, scale, amx=False))   # not the dot-product kernel
    assert torch.equal(cpu.paged_attention(query, kc, vc, meta, scale), tiles)     # the session's path here


@pytest.mark.parametrize("kv_heads, gqa, head_dim", [(2, 2, 48), (1, 17, 64)], ids=["head-dim-48", "gqa-17"])
def test_shapes_the_tiles_cannot_take_run_the_other_kernels(kv_heads, gqa, head_dim):
    meta, query, kc, vc, _, _ = build_case(ROWS, 16, kv_heads, gqa, head_dim, torch.bfloat16, seed=2)
    meta = dataclasses.replace(meta, is_decode=True)
    assert torch.equal(attend(meta, query, kc, vc, 0.1, amx=True), attend(meta, query, kc, vc, 0.1, amx=False))


def test_threads_and_splits_do_not_change_a_token():
    """A lone row's KV heads are split into as many items as two per thread: its bits are the same
    on one thread (two items) and on two (four)."""
    meta, query, kc, vc, _, _ = build_case(ROWS[-1:], 16, 4, 2, 128, torch.bfloat16, seed=7)
    meta = dataclasses.replace(meta, is_decode=True)
    both = attend(meta, query, kc, vc, 0.1, amx=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(meta, query, kc, vc, 0.1, amx=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, both)
