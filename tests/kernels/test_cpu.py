"""The cpu kernel set against the reference kernels and naive float64 formulas.

Tolerances (kernels/cpu.py): float32 atol = rtol = 1e-5; bfloat16 atol = rtol = 2e-2, against a
float64 computation from the same (rounded) inputs, exactly as for the reference set. Skipped
where the set cannot run (no AVX2 or no C++ compiler).
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from qwen_npu.kernels import cpu
from qwen_npu.kernels import reference as ref
from qwen_npu.kernels.metadata import AttentionMetadata
from test_reference import DECODE_ROWS, PREFILL_ROWS, TOL, bits, build_case, naive_attention, naive_write

from qwen_npu import SamplingParams, Session
from qwen_npu.testing import make_tiny_qwen3

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"cpu kernels: {cpu.availability()[1]}")
DTYPES = list(TOL)


# --- linear -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, cpu.PANEL_ROWS, cpu.PANEL_ROWS + 1, 45])
@pytest.mark.parametrize("n, k", [(12, 64), (37, 264), (2, 13), (20, 13), (1, 8)])
def test_linear_matches_float64(n, k, rows, dtype):
    """Both layouts (dot products for few rows, 16-row panels for many), remainders included:
    37 outputs = 2 panels + 5 by dot products; k = 264 spans two 256-column blocks."""
    gen = torch.Generator().manual_seed(rows * 100 + n)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.2).to(dtype)
    y = cpu.linear(x, w)
    assert y.shape == (rows, n) and y.dtype == dtype
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, **TOL[dtype])


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [cpu.PANEL_ROWS, 23, 45])
@pytest.mark.parametrize("n, k", [(16 * 5 + 3, 520), (16 * 8, 256), (16 * 3, 136)])
def test_linear_panels_match_float64_on_every_thread_count(n, k, rows, wdtype):
    """The many-rows layout on any CPU (``cpu.linear`` sends bf16 to torch where it is native):
    blocks of several 16-row panels split between the threads, a last block of fewer panels
    (5 panels), k in 256-column blocks and a tail (520 = 2 x 256 + 8), groups of 6 x rows and a
    remainder (23, 45), the 3 outputs past the panels by dot products. Every output is one sum
    in k order, so one thread and several give the same bits."""
    gen = torch.Generator().manual_seed(rows * 10 + n + k)
    x = torch.randn(rows, k, generator=gen)
    w = (torch.randn(n, k, generator=gen) * 0.2).to(wdtype)
    y = cpu.ops().linear(x, w, cpu.PANEL_ROWS)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, **TOL[torch.float32])
    threads = torch.get_num_threads()
    try:
        for t in {1, 2, 3} - {threads}:
            torch.set_num_threads(t)
            assert torch.equal(cpu.ops().linear(x, w, cpu.PANEL_ROWS), y), t
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not (cpu.available() and cpu.bf16_dot()), reason="the CPU has no AVX512-BF16 dot products")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 11, 16])
@pytest.mark.parametrize("n, k", [(8, 32), (16, 64), (19, 1000), (7, 13), (1, 33), (40, 96)])
def test_native_bf16_dot_products_match_float64(n, k, rows):
    """csrc/linear_bf16.cpp: x rows in pairs and one alone, weight rows in eights and the rest one
    by one, k tails read with a mask (13, 33, 1000 = 31 x 32 + 8); bf16 products are exact in
    fp32, so only the fp32 sums and the final bf16 rounding differ from float64."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.2).bfloat16()
    y = cpu.ops().linear_bf16(x, w)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    want = x.double() @ w.double().T
    torch.testing.assert_close(y.double(), want, **TOL[torch.bfloat16])
    # and it is what cpu.linear runs below cpu.torch_rows() rows, torch's product from there on
    routed = cpu.linear(x, w)
    expected = y if rows < cpu.torch_rows() else F.linear(x, w)
    assert torch.equal(routed, expected)


@pytest.mark.skipif(not (cpu.available() and cpu.bf16_dot()), reason="the CPU has no AVX512-BF16 dot products")
def test_native_bf16_dot_products_refuse_other_dtypes():
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        cpu.ops().linear_bf16(torch.randn(2, 8), torch.randn(4, 8).bfloat16())
    with pytest.raises(RuntimeError, match="disagree"):
        cpu.ops().linear_bf16(torch.randn(2, 8).bfloat16(), torch.randn(4, 9).bfloat16())


def test_linear_keeps_leading_dims_and_agrees_with_the_reference_product():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 96, generator=gen).bfloat16()
    w = (torch.randn(50, 96, generator=gen) * 0.1).bfloat16()
    y = cpu.linear(x, w)
    assert y.shape == (2, 3, 50)
    torch.testing.assert_close(y.float(), F.linear(x, w).float(), **TOL[torch.bfloat16])


def test_linear_on_a_view_of_fused_weights():
    gen = torch.Generator().manual_seed(6)
    fused = torch.randn(40, 32, generator=gen).bfloat16()
    x = torch.randn(3, 16, generator=gen).bfloat16()
    view = fused[:, 8:24]                                  # not contiguous
    torch.testing.assert_close(cpu.linear(x, view).double(), x.double() @ view.double().T,
                               **TOL[torch.bfloat16])


# --- paged attention --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [1, 2, 5])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("rows", [PREFILL_ROWS, DECODE_ROWS], ids=["prefill", "decode"])
def test_paged_attention_matches_dense(rows, block_size, gqa, dtype):
    meta, query, kc, vc, dense, _ = build_case(rows, block_size, 2, gqa, 8, dtype)
    scale = 8 ** -0.5
    out = cpu.paged_attention(query, kc, vc, meta, scale)
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), naive_attention(query, rows, dense, gqa, scale), **TOL[dtype])
    torch.testing.assert_close(out.double(), ref.paged_attention(query, kc, vc, meta, scale).double(),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa, head_dim", [(2, 128), (1, 32), (5, 64), (3, 24)])
def test_paged_attention_long_context_and_wide_heads(dtype, gqa, head_dim):
    """Wide heads and contexts past several vector widths exercise the vector paths and their
    tails: decode rows of 130 and 7 positions, prefill tiles, odd head counts per KV head."""
    rows = [(129, 1), (6, 1), (0, 37), (61, 9)]
    meta, query, kc, vc, dense, _ = build_case(rows, 16, 2, gqa, head_dim, dtype, seed=3)
    scale = head_dim ** -0.5
    out = cpu.paged_attention(query, kc, vc, meta, scale)
    torch.testing.assert_close(out.double(), naive_attention(query, rows, dense, gqa, scale), **TOL[dtype])


MIXED_ROWS = [(20, 1), (0, 9), (47, 1), (6, 4), (3, 1)]    # a mixed step: decode rows among chunks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernels", [cpu, ref], ids=["cpu", "reference"])
def test_a_mixed_step_through_the_prefill_path_matches_dense_and_the_decode_path(kernels, dtype):
    """Rows of one token among prefill chunks (is_decode=False) attend to their whole context,
    as the same rows do alone through the decode path."""
    meta, query, kc, vc, dense, _ = build_case(MIXED_ROWS, 4, 2, 2, 16, dtype, seed=11)
    assert not meta.is_decode
    scale = 16 ** -0.5
    out = kernels.paged_attention(query, kc, vc, meta, scale)
    torch.testing.assert_close(out.double(), naive_attention(query, MIXED_ROWS, dense, 2, scale), **TOL[dtype])
    starts = [0, *itertools.accumulate(q for _, q in MIXED_ROWS)]
    decode_rows = [r for r, (_, q) in enumerate(MIXED_ROWS) if q == 1]
    alone = dataclasses.replace(
        meta, block_tables=meta.block_tables[decode_rows], seq_lens=meta.seq_lens[decode_rows],
        positions=meta.positions[[starts[r] for r in decode_rows]],
        slot_mapping=meta.slot_mapping[[starts[r] for r in decode_rows]],
        query_start_loc=torch.arange(len(decode_rows) + 1, dtype=torch.int32),
        query_lens_host=(1,) * len(decode_rows),
        seq_lens_host=tuple(meta.seq_lens_host[r] for r in decode_rows), is_decode=True)
    by_decode = kernels.paged_attention(query[[starts[r] for r in decode_rows]], kc, vc, alone, scale)
    torch.testing.assert_close(out[[starts[r] for r in decode_rows]].double(), by_decode.double(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa, head_dim", [(2, 128), (4, 16), (3, 24)])
@pytest.mark.parametrize("cuts", [(33, 98), (2, 65, 130), (1, 40)], ids=["33", "2-63", "1"])
def test_a_prompt_cut_into_chunks_gets_the_bits_of_the_whole_prompt(cuts, gqa, head_dim, dtype):
    """Chunked prefill: each chunk of two or more tokens, attending to the cached part before it,
    gives bit for bit what the same tokens got in one call over the whole prompt, whatever tile
    its last tokens fall into (a chunk of 33 tokens leaves a tile of one at 16 or 32 tokens a
    tile). A chunk of one token is a decode row and goes through the decode path. Not claimed
    for bf16 on an AMX CPU, whose prefill rows go to AMX tiles or torch's SDPA whole."""
    if dtype == torch.bfloat16 and cpu.amx():
        pytest.skip("bf16 prefill rows on an AMX CPU take the AMX tiles or SDPA, a row at a time")
    whole_len = 140
    meta, query, kc, vc, _, _ = build_case([(0, whole_len)], 16, 2, gqa, head_dim, dtype, seed=5)
    scale = head_dim ** -0.5
    whole = cpu.paged_attention(query, kc, vc, meta, scale)
    edges = [0, *cuts, whole_len]
    for a, b in itertools.pairwise(edges):
        chunk = AttentionMetadata.for_rows([(a, b - a)], meta.slot_mapping[a:b].tolist(), meta.block_tables)
        out = cpu.paged_attention(query[a:b], kc, vc, chunk, scale)
        if b - a == 1:
            torch.testing.assert_close(out.double(), whole[a:b].double(), **TOL[dtype])
        else:
            assert torch.equal(bits(out), bits(whole[a:b])), f"chunk [{a}, {b}) of {edges}"


SDPA_ROWS_CASE = [(0, 40), (20, 1), (33, 17), (5, 3), (0, cpu.SDPA_ROWS), (9, cpu.SDPA_ROWS - 1), (0, 150), (7, 140)]


def sdpa_length(done: int, q: int) -> int:
    """The query length SDPA is called with: a causal row past SDPA_PAD_FROM padded to SDPA_PAD."""
    return -(-q // cpu.SDPA_PAD) * cpu.SDPA_PAD if done == 0 and q > cpu.SDPA_PAD_FROM else q


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_bf16_prefill_rows_through_sdpa_match_dense(monkeypatch, amx, block_size):
    """On a CPU with AMX tiles the C++ kernels cannot use (forced here, so every CPU runs the path)
    bf16 rows of ``SDPA_ROWS`` tokens or more go through torch's SDPA — from position 0 (causal; a
    long one zero-padded at its end, whose poisoned tail slots must not reach it) and past a cached
    prefix (masked) — and the shorter rows and decode rows through the C++ loop, in one step."""
    monkeypatch.setattr(cpu, "amx", lambda: amx)
    monkeypatch.setattr(cpu, "amx_tiles", lambda: False)
    meta, query, kc, vc, dense, tables = build_case(SDPA_ROWS_CASE, block_size, 2, 2, 32, torch.bfloat16, seed=5)
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    out = cpu.paged_attention(query, kc, vc, meta, 32 ** -0.5)
    assert out.shape == query.shape and out.dtype == torch.bfloat16
    assert [c[-2] for c in calls] == ([sdpa_length(d, q) for d, q in SDPA_ROWS_CASE if q >= cpu.SDPA_ROWS]
                                      if amx else [])
    torch.testing.assert_close(out.double(), naive_attention(query, SDPA_ROWS_CASE, dense, 2, 32 ** -0.5),
                               **TOL[torch.bfloat16])
    for row, table in enumerate(tables):            # no row reads another row's blocks, on either path
        kp, vp = kc.clone(), vc.clone()
        others = [b for b in range(kc.shape[0]) if b not in table]
        kp[others] = float("nan")
        vp[others] = float("nan")
        poisoned = cpu.paged_attention(query, kp, vp, meta, 32 ** -0.5)
        start = sum(q for _, q in SDPA_ROWS_CASE[:row])
        assert torch.equal(poisoned[start:start + SDPA_ROWS_CASE[row][1]], out[start:start + SDPA_ROWS_CASE[row][1]])


BF16_TILE_ROWS = [(0, 70), (61, 9), (5, 33), (0, 1), (200, 17)]


@pytest.mark.skipif(not (cpu.available() and cpu.bf16_dot()), reason="the CPU has no AVX512-BF16 dot products")
@pytest.mark.parametrize("gqa, head_dim", [(2, 128), (1, 32), (5, 64), (3, 256), (4, 96)])
def test_prefill_tiles_with_bf16_dot_products_match_dense_and_read_only_their_row(gqa, head_dim):
    """bf16 prefill tiles on AVX512-BF16 (csrc/attention_bf16.cpp; head_dim a multiple of 32 up to
    256, else the fp32 tile): within the bf16 tolerance of dense attention, as the fp32 tile is;
    another row's blocks never reach a row; a NaN key reaches exactly the tokens that see it."""
    meta, query, kc, vc, dense, tables = build_case(BF16_TILE_ROWS, 16, 2, gqa, head_dim, torch.bfloat16, seed=4)
    scale = head_dim ** -0.5

    def attend(k, v, bf16_dot):
        return cpu.ops().paged_attention(query, k, v, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                         scale, bf16_dot)
    fast, slow = attend(kc, vc, True), attend(kc, vc, False)
    want = naive_attention(query, BF16_TILE_ROWS, dense, gqa, scale)
    torch.testing.assert_close(fast.double(), want, **TOL[torch.bfloat16])
    torch.testing.assert_close(slow.double(), want, **TOL[torch.bfloat16])
    assert torch.equal(fast, slow) == (head_dim % 32 != 0)      # the bf16 tile ran exactly where it can
    starts = [0, *itertools.accumulate(q for _, q in BF16_TILE_ROWS)]
    for row, table in enumerate(tables):
        kp, vp = kc.clone(), vc.clone()
        others = [b for b in range(kc.shape[0]) if b not in table]
        kp[others], vp[others] = float("nan"), float("inf")
        assert torch.equal(attend(kp, vp, True)[starts[row]:starts[row + 1]], fast[starts[row]:starts[row + 1]])
    n = BF16_TILE_ROWS[0][1]                                     # row 0: tokens 0..69 of a fresh prompt
    kp = kc.clone()
    block, offset = divmod(40, 16)
    kp[int(tables[0][block]), offset, 0] = float("nan")          # position 40's key, KV head 0
    out = attend(kp, vc, True)[:n].float()
    heads = slice(0, gqa)                                        # the query heads of KV head 0
    assert out[40:, heads].isnan().all() and not out[:40, heads].isnan().any()
    assert not out[:, gqa:].isnan().any()


@pytest.mark.parametrize("poison", [float("nan"), 1e30, float("inf")])
@pytest.mark.parametrize("is_decode", [True, False])
def test_a_row_never_reads_another_rows_blocks(poison, is_decode):
    meta, query, kc, vc, _, tables = build_case(DECODE_ROWS, 4, 2, 2, 8, torch.float32, pad_cols=3)
    meta = dataclasses.replace(meta, is_decode=is_decode)
    base = cpu.paged_attention(query, kc, vc, meta, 0.35)
    assert torch.isfinite(base).all()
    for row, table in enumerate(tables):
        kp, vp = kc.clone(), vc.clone()
        others = [b for b in range(kc.shape[0]) if b not in table]
        kp[others] = poison
        vp[others] = poison
        out = cpu.paged_attention(query, kp, vp, meta, 0.35)
        assert torch.equal(out[row], base[row]), f"row {row} changed when other rows' blocks changed"


# --- write_kv ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slots", [[5, -1, 9, -1, 0], [-1, -1, -1], [-1, 3], [7], []],
                         ids=["mixed", "all-skipped", "skip-first", "one", "empty"])
def test_write_kv_is_bit_identical_to_the_naive_write(slots, dtype):
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(3, 4, 2, 8, generator=gen).to(dtype)
    vc = torch.randn(3, 4, 2, 8, generator=gen).to(dtype)
    key = torch.randn(len(slots), 2, 8, generator=gen).to(dtype)
    value = torch.randn(len(slots), 2, 8, generator=gen).to(dtype)
    want_k, want_v = naive_write(kc, vc, key, value, slots)
    cpu.write_kv(key, value, kc, vc, torch.tensor(slots, dtype=torch.int64))
    assert torch.equal(bits(kc), bits(want_k)) and torch.equal(bits(vc), bits(want_v))


def test_write_kv_casts_into_the_cache_dtype_and_refuses_slots_past_the_cache():
    kc = torch.zeros(2, 2, 1, 4, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    key = torch.randn(1, 1, 4)
    cpu.write_kv(key, key * 2, kc, vc, torch.tensor([3]))
    assert torch.equal(kc[1, 1], key[0].bfloat16()) and torch.equal(vc[1, 1], (key[0] * 2).bfloat16())
    with pytest.raises(RuntimeError, match="beyond the cache"):
        cpu.write_kv(key, key, kc, vc, torch.tensor([4]))


# --- norms and rope -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 6, 32), (5, 1024), (3, 4, 13)])
def test_rms_norm_and_add_rms_norm_match_the_reference(shape, dtype):
    gen = torch.Generator().manual_seed(2)
    x, res = (torch.randn(2, *shape, generator=gen) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    y = cpu.rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y, ref.rms_norm(x, w, 1e-6), **TOL[dtype])
    y2, summed = cpu.add_rms_norm(x, res, w, 1e-6)
    want2, want_sum = ref.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(summed, want_sum)                       # the residual stream is exact
    torch.testing.assert_close(y2, want2, **TOL[dtype])


def test_rms_norm_reads_strided_views():
    qkv = torch.randn(3, 40).bfloat16()
    q = qkv[:, :32].reshape(3, 4, 8)                          # a view into fused projections
    w = torch.rand(8).bfloat16() + 0.5
    torch.testing.assert_close(cpu.rms_norm(q, w, 1e-6), ref.rms_norm(q, w, 1e-6), **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_bit_identical_to_the_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 16, generator=gen).to(dtype)
    k = torch.randn(5, 2, 16, generator=gen).to(dtype)
    pos = torch.tensor([0, 1, 7, 100, 4095]).double()[:, None]
    freqs = pos * (1.0 / 1e6 ** (torch.arange(0, 16, 2).double() / 16))[None]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().float(), emb.sin().float()
    got_q, got_k = cpu.rope(q, k, cos, sin)
    want_q, want_k = ref.rope(q, k, cos, sin)
    assert torch.equal(bits(got_q), bits(want_q)) and torch.equal(bits(got_k), bits(want_k))


def test_rope_rounds_every_bf16_bit_pattern_as_torch_does():
    """Every 16-bit pattern as a q value (subnormals, infinities, NaNs with any payload), times
    cos/sin of every magnitude: the products of two bf16 values tie exactly between two bf16
    neighbours often, overflow to inf and underflow to subnormals, so each case of the kernel's
    round-to-nearest-even (and NaN -> 0x7FC0) meets torch's conversion."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    q = patterns.reshape(256, 2, 128)
    k = patterns.flip(0).reshape(256, 2, 128)[:, :1]
    gen = torch.Generator().manual_seed(5)
    scale = torch.exp2(torch.randint(-140, 128, (256, 1), generator=gen).float())
    cos = torch.randn(256, 128, generator=gen) * scale
    sin = torch.randn(256, 128, generator=gen) * scale.flip(0)
    got_q, got_k = cpu.rope(q, k, cos, sin)
    want_q, want_k = ref.rope(q, k, cos, sin)
    nan_q, nan_k = torch.isnan(want_q), torch.isnan(want_k)
    assert nan_q.any() and torch.isinf(want_q).any()
    assert torch.equal(torch.isnan(got_q), nan_q) and torch.equal(torch.isnan(got_k), nan_k)
    assert torch.equal(bits(got_q)[nan_q].unique(), torch.tensor([0x7FC0], dtype=torch.int16))
    assert torch.equal(bits(got_q)[~nan_q], bits(want_q)[~nan_q])
    assert torch.equal(bits(got_k)[~nan_k], bits(want_k)[~nan_k])


# --- the whole model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("cpu_bf16"), vocab_size=512, seed=4, hidden_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                           dtype=torch.bfloat16)


def run_logits(path, kernels, prompts, steps):
    sess = Session.from_pretrained(path, kernels=kernels, max_batch=4, chunk_size=16, max_model_len=128)
    reqs = [sess.add_request(p, SamplingParams(max_new_tokens=steps, ignore_eos=True)) for p in prompts]
    rows = []
    while not all(r.is_done for r in reqs):
        step = sess.step()
        if step.logits is not None:
            rows.append(step.logits.tensor.clone())
    return torch.cat(rows), [r.output_token_ids for r in reqs]


def test_bf16_model_logits_match_the_reference_set(bf16_ckpt):
    """Same prompts, chunked prefill and batched decode, both sets: logits within bf16 tolerance."""
    prompts = [list(range(3, 40)), list(range(100, 105)), [7] * 21]
    assert Session.from_pretrained(bf16_ckpt, kernels="auto").config.kernels == "cpu"   # native bf16 or not
    want, want_ids = run_logits(bf16_ckpt, "reference", prompts, 6)
    got, got_ids = run_logits(bf16_ckpt, "cpu", prompts, 6)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1                 # compare tokens only where the margin is clear
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_inside_a_cpu_product_leaves_the_session_as_it_was(bf16_ckpt, monkeypatch, exc):
    """Ctrl-C (or a failure) in the middle of a step's products, on whichever path the machine
    takes (native bf16 dot products, torch's product, the widening kernel, the layers' calls made
    in one): nothing of the step stays, statistics included, and the same session then finishes
    with the uninterrupted tokens. Layers made in one call are interrupted as it returns (Ctrl-C
    cannot land inside C++), with their K/V written."""
    prompts = [list(range(3, 30)), [7] * 9]
    want = Session.from_pretrained(bf16_ckpt, kernels="cpu", max_batch=4, chunk_size=16, max_model_len=128)
    want_ids = [list(o.token_ids) for o in want.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True),
                                                      progress=False)]
    sess = Session.from_pretrained(bf16_ckpt, kernels="cpu", max_batch=4, chunk_size=16, max_model_len=128)
    reqs = [sess.add_request(p, SamplingParams(max_new_tokens=5, ignore_eos=True)) for p in prompts]
    real = {name: getattr(cpu, name) for name in ("linear", "gate_up_silu")}   # every product of a step
    real_layers = cpu.decoder_layers
    for fail_at in (2, 3):                        # early in a prefill; inside a later step's forward
        sess.step()
        calls = []

        def failing(fn):
            def call(x, w):
                calls.append(1)
                if len(calls) == fail_at:
                    raise exc("interrupted inside a product")
                return fn(x, w)
            return call

        def failing_layers(*args, **kwargs):
            out = real_layers(*args, **kwargs)
            if out is not None:                   # the layers made in one call: their products count here
                calls.append(1)
                if len(calls) == fail_at:
                    raise exc("interrupted as the layers' one call returned")
            return out
        for name, fn in real.items():
            monkeypatch.setattr(cpu, name, failing(fn))
        monkeypatch.setattr(cpu, "decoder_layers", failing_layers)
        while True:                               # steps commit until the one that fails inside
            before = sess.state_digest()
            try:
                sess.step()
            except exc:
                break
        for name, fn in real.items():
            monkeypatch.setattr(cpu, name, fn)
        monkeypatch.setattr(cpu, "decoder_layers", real_layers)
        assert len(calls) == fail_at
        assert sess.state_digest() == before, before.diff(sess.state_digest())
        assert sess.check().ok
    while not all(r.is_done for r in reqs):
        sess.step()
    assert [list(r.output_token_ids) for r in reqs] == want_ids
