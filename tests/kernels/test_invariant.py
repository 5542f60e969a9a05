"""Batch-invariant kernels (kernels/invariant.py): a row's bits do not depend on the other rows.

Each check is made against the ordinary kernels too, which do change a row's bits with the
number of rows (torch's float32 product below five rows and from five on; the cpu set's
one-row and panel paths), so the checks can fail.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwen_npu.kernels import AttentionMetadata, cpu, cuda, invariant, reference
from qwen_npu.kernels.invariant import BatchInvariant

needs_cpu = pytest.mark.skipif(not cpu.available(), reason="the cpu kernel set cannot be built here")
ROWS = (1, 2, 3, 4, 5, 7, 16, 17, 33, 64)


def forms() -> list:
    out = [invariant.tiled_linear]
    if cpu.available():
        out.append(invariant.cpu_linear)
    return out


def row_alone_and_among(linear, weight: torch.Tensor, dtype: torch.dtype) -> list[int]:
    """The row counts at which row 0's product differs from its product alone."""
    g = torch.Generator().manual_seed(1)
    row = torch.randn(1, weight.shape[1], generator=g).to(dtype)
    alone = linear(row, weight)
    differ = []
    for m in ROWS:
        x = torch.cat((row, torch.randn(m - 1, weight.shape[1], generator=g).to(dtype)))
        if not torch.equal(linear(x, weight)[:1], alone):
            differ.append(m)
    return differ


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(392, 96), (1030, 1024), (96, 160)])      # (N, K): column and k tails
def test_a_row_is_multiplied_the_same_way_among_any_number_of_rows(shape, dtype):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype) * 0.05
    for linear in forms():
        assert row_alone_and_among(linear, weight, dtype) == [], linear.__name__
        x = torch.randn(9, shape[1]).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=tol, rtol=tol)


def test_the_ordinary_products_do_not_promise_it():
    weight = torch.randn(1030, 1024, generator=torch.Generator().manual_seed(0)) * 0.05
    assert row_alone_and_among(F.linear, weight, torch.float32), "torch's product was invariant: the check is vacuous"
    if cpu.available():      # fp32 rows against bf16 weights: the one-row, dots and panel paths in fp32
        assert row_alone_and_among(lambda x, w: cpu.ops().linear(x, w, 16), weight.bfloat16(), torch.float32)


def test_tiled_linear_keeps_leading_dimensions_and_empty_inputs():
    w = torch.randn(24, 8)
    x = torch.randn(2, 3, 8)
    assert invariant.tiled_linear(x, w).shape == (2, 3, 24)
    assert invariant.tiled_linear(torch.empty(0, 8), w).shape == (0, 24)


def caches(dtype, blocks=40, block_size=4, kv=2, d=32):
    g = torch.Generator().manual_seed(2)
    return (torch.randn(blocks, block_size, kv, d, generator=g).to(dtype),
            torch.randn(blocks, block_size, kv, d, generator=g).to(dtype))


def tables(rows: int, width: int = 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.stack([torch.randperm(40, generator=g)[:width] for _ in range(rows)]).to(torch.int32)


def attention_forms() -> list:
    return [invariant.reference_attention] + ([invariant.cpu_attention] if cpu.available() else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_attends_the_same_way_as_decode_row_in_a_chunk_and_in_a_mixed_step(dtype):
    """Token 9 of row 0 (context 0..9): alone as a decode row, as the 4th token of a chunk of 6
    starting at 6, as the first of a chunk of 2, and beside other rows of a mixed step."""
    kc, vc = caches(dtype)
    table = tables(3)
    q9 = torch.randn(1, 6, 32).to(dtype)
    for attend in attention_forms():
        def at(rows, slots_table, query):
            meta = AttentionMetadata.for_rows(rows, [-1] * sum(n for _, n in rows), slots_table)
            return attend(query, kc, vc, meta, 0.17)
        alone = at([(9, 1)], table[:1], q9)
        chunk = torch.cat((torch.randn(3, 6, 32).to(dtype), q9, torch.randn(2, 6, 32).to(dtype)))
        assert torch.equal(at([(6, 6)], table[:1], chunk)[3:4], alone), attend.__name__
        assert torch.equal(at([(9, 2)], table[:1], torch.cat((q9, q9)))[:1], alone), attend.__name__
        mixed = torch.cat((torch.randn(2, 6, 32).to(dtype), q9, torch.randn(1, 6, 32).to(dtype)))
        assert torch.equal(at([(3, 2), (9, 1), (20, 1)], table[[1, 0, 2]], mixed)[2:3], alone), attend.__name__
        # the same attention as the ordinary kernels, to rounding
        meta = AttentionMetadata.for_rows([(6, 6), (20, 1)], [-1] * 7, table[:2])
        query = torch.cat((chunk, q9))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(attend(query, kc, vc, meta, 0.17),
                                   reference.paged_attention(query, kc, vc, meta, 0.17), atol=tol, rtol=tol)


def test_the_ordinary_attention_does_not_promise_it():
    kc, vc = caches(torch.float32)
    table = tables(1)
    q9 = torch.randn(1, 6, 32)
    chunk = torch.cat((torch.randn(3, 6, 32), q9, torch.randn(2, 6, 32)))
    sets = [reference] + ([cpu] if cpu.available() else [])
    differ = []
    for k in sets:
        alone = k.paged_attention(q9, kc, vc, AttentionMetadata.for_rows([(9, 1)], [-1], table), 0.17)
        in_chunk = k.paged_attention(chunk, kc, vc, AttentionMetadata.for_rows([(6, 6)], [-1] * 6, table), 0.17)[3:4]
        differ.append(not torch.equal(alone, in_chunk))
    assert any(differ), "the ordinary attention was invariant: the check is vacuous"


def test_a_batch_invariant_set_holds_plain_matrices_and_keeps_its_name():
    for base in (reference, cuda) + ((cpu,) if cpu.available() else ()):
        inv = BatchInvariant(base)
        assert inv.NAME == base.NAME and not hasattr(inv, "prepare_weight") and not hasattr(inv, "prepares_weights")
        assert repr(inv) == f"BatchInvariant({base.NAME!r})"
    assert BatchInvariant(cuda).linear is invariant.tiled_linear           # fused sets take the pure-torch form
    assert BatchInvariant(cuda).paged_attention is invariant.reference_attention
    assert BatchInvariant(cuda).rms_norm is reference.rms_norm
    if cpu.available():
        assert BatchInvariant(cpu).linear is invariant.cpu_linear and BatchInvariant(cpu).silu_mul is cpu.silu_mul


@needs_cpu
def test_odd_row_counts_take_the_pair_tree_in_the_bf16_dot_kernel():
    """csrc/linear_bf16.cpp sums a lone row beside a row of zeros, so rows 0..M-1 of an odd M
    match each row's product alone (before, the last row of an odd M took another tree)."""
    if not cpu.bf16_dot():
        pytest.skip("no AVX512-BF16 here: the kernel is not built in")
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(64, 1024, generator=g) * 0.05).bfloat16()
    x = torch.randn(5, 1024, generator=g).bfloat16()
    whole = cpu.ops().linear_bf16(x, w)
    for i in range(5):
        assert torch.equal(whole[i:i + 1], cpu.ops().linear_bf16(x[i:i + 1], w)), i
