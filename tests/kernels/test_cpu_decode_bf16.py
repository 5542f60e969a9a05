"""Decode tokens through the AVX512-BF16 dot products (csrc/attention_decode_bf16.cpp) against
dense float64 attention and the fp32 decode kernel, on a CPU that has them.

Contexts cover every remainder of the kernel's position blocks (8 positions per head pair, 16 for
a lone head, 32 per weighted-sum pass), GQA ratios 1 to 5 (a lone head where the ratio is odd),
head_dim from 32 to 256 and one it cannot take (the fp32 kernel then runs, bit for bit)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from qwen_npu.kernels import cpu
from test_reference import TOL, build_case, naive_attention

pytestmark = pytest.mark.skipif(not (cpu.available() and cpu.bf16_dot()),
                                reason="the CPU has no AVX512-BF16 dot products")

CONTEXTS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 64, 100, 257]
ROWS = [(n - 1, 1) for n in CONTEXTS]


def attend(meta, query, kc, vc, scale, bf16_dot, amx=False):
    return cpu.ops().paged_attention(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                     scale, bf16_dot, amx=amx)


@pytest.mark.parametrize("kv_heads, gqa, head_dim", [(2, 2, 128), (1, 1, 32), (2, 5, 64), (1, 3, 256),
                                                     (3, 4, 96), (1, 6, 160), (2, 7, 192), (1, 8, 224),
                                                     (2, 2, 48)])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("rows", [ROWS, ROWS[-1:]], ids=["many-rows", "one-row"])   # one row: KV heads split
def test_decode_tokens_match_dense_and_the_fp32_kernel(kv_heads, gqa, head_dim, block_size, rows):
    meta, query, kc, vc, dense, _ = build_case(rows, block_size, kv_heads, gqa, head_dim, torch.bfloat16, seed=9)
    meta = dataclasses.replace(meta, is_decode=True)
    scale = head_dim ** -0.5
    fast, slow = attend(meta, query, kc, vc, scale, True), attend(meta, query, kc, vc, scale, False)
    want = naive_attention(query, rows, dense, gqa, scale)
    torch.testing.assert_close(fast.double(), want, **TOL[torch.bfloat16])
    torch.testing.assert_close(slow.double(), want, **TOL[torch.bfloat16])
    torch.testing.assert_close(fast.float(), slow.float(), atol=8e-3, rtol=8e-3)   # P in bf16: the one difference
    assert torch.equal(fast, slow) == (head_dim % 32 != 0)      # the bf16 kernel ran exactly where it can
    # the session's entry point takes this CPU's path (on one with AMX tiles: csrc/attention_decode_amx.cpp)
    assert torch.equal(cpu.paged_attention(query, kc, vc, meta, scale),
                       attend(meta, query, kc, vc, scale, True, amx=cpu.amx_tiles()))


# Both bf16 decode kernels of this CPU: on dot products, and where the C++ kernels can use AMX tiles,
# with the scores on them (csrc/attention_decode_amx.cpp).
KERNELS = [pytest.param(False, id="dot-products"),
           pytest.param(True, id="tiles", marks=pytest.mark.skipif(not (cpu.available() and cpu.amx_tiles()),
                                                                   reason="no AMX tiles for the C++ kernels"))]


@pytest.mark.parametrize("amx", KERNELS)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 1e30])
def test_a_decode_token_reads_only_its_own_context(poison, block_size, amx):
    """Every slot outside a row's context (other rows' blocks, the tail of its last block) holds
    ``poison`` already (build_case); changing what other rows' blocks hold changes nothing either."""
    meta, query, kc, vc, _, tables = build_case(ROWS, block_size, 2, 2, 128, torch.bfloat16, seed=3, poison=poison)
    base = attend(meta, query, kc, vc, 0.1, True, amx=amx)
    assert torch.isfinite(base).all()
    for row, table in enumerate(tables):
        kp, vp = kc.clone(), vc.clone()
        others = [b for b in range(kc.shape[0]) if b not in table]
        kp[others], vp[others] = -poison, 0.5
        assert torch.equal(attend(meta, query, kp, vp, 0.1, True, amx=amx)[row], base[row])


@pytest.mark.parametrize("amx", KERNELS)
@pytest.mark.parametrize("target", ["key", "value"])
def test_a_nan_in_the_context_reaches_exactly_the_heads_that_read_it(target, amx):
    rows = [(99, 1), (40, 1)]
    meta, query, kc, vc, _, tables = build_case(rows, 16, 4, 2, 128, torch.bfloat16, seed=5)
    block, offset = divmod(57, 16)                     # position 57 of row 0, KV head 2
    cache = kc if target == "key" else vc
    cache[int(tables[0][block]), offset, 2] = float("nan")
    out = attend(meta, query, kc, vc, 0.1, True, amx=amx).float()
    assert out[0, 4:6].isnan().all()                   # the query heads of KV head 2
    assert not out[0, :4].isnan().any() and not out[0, 6:].isnan().any()
    assert not out[1].isnan().any()
