"""Calls outside what the wheel documents never reach the fused op: the kernel runs the reference
instead and says why (docs/npu.md quotes the limit each case comes from)."""
from __future__ import annotations

import pytest
import torch
from qwen_npu.kernels import npu as npu_k
from qwen_npu.kernels import reference as ref
from rules_kit import check_call
from standin_kit import attention_case, run_with_stand_in


def rope_case(head_dim):
    q, k = torch.randn(5, 4, head_dim).bfloat16(), torch.randn(5, 2, head_dim).bfloat16()
    cos, sin = torch.randn(5, head_dim), torch.randn(5, head_dim)
    return (lambda: npu_k.rope(q, k, cos, sin)), (lambda: ref.rope(q, k, cos, sin))


def prefill_case(block_size, heads_per_kv=4, kv_heads=2):
    query, kc, vc, meta = attention_case([(100, 20), (0, 37)], block_size, device="cpu")
    query = torch.randn(query.shape[0], kv_heads * heads_per_kv, query.shape[2]).bfloat16()
    kc, vc = kc[:, :, :1].repeat(1, 1, kv_heads, 1), vc[:, :, :1].repeat(1, 1, kv_heads, 1)
    return (lambda: npu_k.paged_attention(query, kc, vc, meta, 0.1)), \
        (lambda: ref.paged_attention(query, kc, vc, meta, 0.1))


def norm_case(shape):
    x, w = torch.randn(*shape).bfloat16(), torch.ones(shape[-1]).bfloat16()
    return (lambda: npu_k.rms_norm(x, w, 1e-6)), (lambda: ref.rms_norm(x, w, 1e-6))


OUT_OF_SPEC = [   # case, the op it must not call, the reason it must give
    (lambda: rope_case(96), "npu_apply_rotary_pos_emb", "head_dim 96 is not 64 or 128"),
    (lambda: rope_case(256), "npu_apply_rotary_pos_emb", "head_dim 256 is not 64 or 128"),
    (lambda: prefill_case(64), "npu_fused_infer_attention_score", "block_size 64 is not a multiple of 128"),
    (lambda: prefill_case(16), "npu_fused_infer_attention_score", "block_size 16 is not a multiple of 128"),
    (lambda: prefill_case(128, heads_per_kv=72, kv_heads=1), "npu_fused_infer_attention_score",
     "72 query heads over 1 kv heads"),
    (lambda: norm_case((1024,)), "npu_rms_norm", "x is 1-D"),
]


@pytest.mark.parametrize("case, op, reason", OUT_OF_SPEC, ids=[o[2] for o in OUT_OF_SPEC])
def test_out_of_spec_calls_run_the_reference(meta, case, op, reason):
    run, reference = case()
    got, calls, fell_back = run_with_stand_in(meta, "cpu", run)
    assert [c.op for c in calls] == []
    assert len(fell_back) == 1 and reason in fell_back[0], fell_back
    want = reference()
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("case, op", [(lambda: rope_case(64), "npu_apply_rotary_pos_emb"),
                                      (lambda: prefill_case(256), "npu_fused_infer_attention_score"),
                                      (lambda: prefill_case(512), "npu_fused_infer_attention_score"),
                                      (lambda: norm_case((3, 2, 1024)), "npu_rms_norm")],
                         ids=["rope head_dim 64", "prefill block 256", "prefill block 512", "norm 3-D"])
def test_in_spec_edges_call_the_fused_op(meta, signatures, case, op):
    run, _ = case()
    _, calls, fell_back = run_with_stand_in(meta, "cpu", run)
    assert [c.op for c in calls] == [op] and not fell_back
    check_call(signatures, calls[0])
