"""The npu kernel set against the reference kernels, on the CPU, with torch_npu replaced by a
stand-in whose ops compute what their documentation says (numeric_kit.py). Every call is bound
and checked against the wheel on the way. Tolerances: bfloat16 atol = rtol = 2e-2 (README.md),
write_kv bit-identical; no case may fall back to the reference."""
from __future__ import annotations

import pytest
import torch
from numeric_kit import BehavingStandIn, StandInError, fused_infer_attention_score
from qwen_npu.kernels import npu as npu_k
from qwen_npu.kernels import reference as ref
from rules_kit import RuleError
from standin_kit import ALL_OPS, ATTENTION_ROWS, HEAD_DIM, NO_FIA, attention_case, run_with_stand_in

TOL = {"atol": 2e-2, "rtol": 2e-2}


def run_behaving(meta, signatures, run, support=ALL_OPS):
    stand_in = BehavingStandIn(meta, signatures, support)
    out, calls, fell_back = run_with_stand_in(meta, "cpu", run, stand_in=stand_in)
    assert not fell_back, fell_back
    return out, calls


def nan_outside_contexts(kc, vc, meta, block_size):
    """Every cache slot outside the rows' contexts becomes NaN: no kernel may read one."""
    keep = torch.zeros(kc.shape[0] * block_size, dtype=torch.bool)
    for row, n in enumerate(meta.seq_lens_host):
        for p in range(n):
            keep[int(meta.block_tables[row, p // block_size]) * block_size + p % block_size] = True
    for cache in (kc, vc):
        cache.view(-1, *cache.shape[2:])[~keep] = float("nan")


CASES = [(name, rows, bs, skip, ALL_OPS) for name, (rows, bs, skip) in ATTENTION_ROWS.items()]
CASES += [("decode, ATB (no FIA)", ATTENTION_ROWS["decode"][0], 128, (), NO_FIA),
          ("decode, all fresh, ATB (no FIA)", ATTENTION_ROWS["decode, all fresh"][0], 128, (), NO_FIA)]


@pytest.mark.parametrize("name, rows, block_size, skipped, support", CASES, ids=[c[0] for c in CASES])
def test_paged_attention_matches_the_reference(meta, signatures, name, rows, block_size, skipped, support):
    """A token with slot -1 reads its position's slot through the table, as the reference does
    (every slot outside the contexts is NaN, so reading any other slot shows)."""
    query, kc, vc, m = attention_case(rows, block_size, device="cpu", skipped=skipped)
    nan_outside_contexts(kc, vc, m, block_size)
    scale = HEAD_DIM ** -0.5
    out, calls = run_behaving(meta, signatures, lambda: npu_k.paged_attention(query, kc, vc, m, scale), support)
    assert len(calls) == 1
    want = ref.paged_attention(query.float(), kc.float(), vc.float(), m, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want, **TOL)


@pytest.mark.parametrize("pattern", ["mixed", "all skipped", "none skipped"])
def test_write_kv_is_bit_identical_to_the_reference(meta, signatures, pattern):
    gen = torch.Generator().manual_seed(4)
    kc = torch.randn(6, 128, 2, HEAD_DIM, generator=gen).bfloat16()
    vc = torch.randn_like(kc)
    slots = torch.randperm(6 * 128, generator=gen)[:40]
    slots[::3] = -1 if pattern == "mixed" else slots[::3]
    if pattern == "all skipped":
        slots[:] = -1
    key, value = torch.randn(40, 2, HEAD_DIM, generator=gen).bfloat16(), torch.randn(40, 2, HEAD_DIM).bfloat16()
    want_k, want_v = kc.clone(), vc.clone()
    ref.write_kv(key, value, want_k, want_v, slots)
    _, calls = run_behaving(meta, signatures, lambda: npu_k.write_kv(key, value, kc, vc, slots))
    assert [c.op for c in calls] == ["npu_scatter_pa_kv_cache"]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_norms_and_rope_match_the_reference_and_rope_leaves_its_inputs(meta, signatures):
    gen = torch.Generator().manual_seed(5)
    x, res = (torch.randn(7, 256, generator=gen) * 3).bfloat16(), torch.randn(7, 256, generator=gen).bfloat16()
    w = (torch.rand(256, generator=gen) + 0.5).bfloat16()
    q, k = torch.randn(9, 8, HEAD_DIM, generator=gen).bfloat16(), torch.randn(9, 2, HEAD_DIM, generator=gen).bfloat16()
    emb = torch.arange(9.0)[:, None] * torch.rand(HEAD_DIM, generator=gen)
    cos, sin = emb.cos(), emb.sin()
    q0, k0 = q.clone(), k.clone()

    def run():
        return npu_k.rms_norm(x, w, 1e-6), npu_k.add_rms_norm(x, res, w, 1e-6), npu_k.rope(q, k, cos, sin)
    (y, (y2, summed), (rq, rk)), calls = run_behaving(meta, signatures, run)
    assert [c.op for c in calls] == ["npu_rms_norm", "npu_add_rms_norm", "npu_apply_rotary_pos_emb"]
    torch.testing.assert_close(y.float(), ref.rms_norm(x, w, 1e-6).float(), **TOL)
    want2, want_sum = ref.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(y2.float(), want2.float(), **TOL)
    assert torch.equal(summed, want_sum)
    wq, wk = ref.rope(q, k, cos, sin)
    torch.testing.assert_close(rq.float(), wq.float(), **TOL)
    torch.testing.assert_close(rk.float(), wk.float(), **TOL)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert not torch.equal(rq, q0)                       # the rotated copies, not the inputs


def test_the_stand_in_refuses_a_block_id_outside_the_cache(meta, signatures):
    """The op does not validate block ids; the stand-in does (and the rules refuse the call first)."""
    query, kc, vc, m = attention_case(ATTENTION_ROWS["prefill chunk"][0], 128, device="cpu")
    table = m.block_tables[:, :2].clamp(min=0)
    table[0, 0] = kc.shape[0]                            # one past the last block
    args = {"query": query, "key": kc.flatten(2), "value": vc.flatten(2),
            "atten_mask": npu_k._causal_mask(query.device), "block_table": table, "input_layout": "TND",
            "block_size": 128, "actual_seq_lengths": [20, 148, 185], "actual_seq_lengths_kv": [120, 256, 37],
            "num_key_value_heads": 2, "num_heads": 8, "scale": 0.1, "sparse_mode": 3}
    with pytest.raises(StandInError, match="block id outside the cache"):
        fused_infer_attention_score(**args)
    with pytest.raises(RuleError, match="must hold block ids 0 <= id < 7"):
        BehavingStandIn(meta, signatures).npu_fused_infer_attention_score(**args)
