"""Output shapes and dtypes: the wheel's own meta registrations, run on the CPU, against what the
kernel contract promises, for the decode, prefill-chunk, mixed and other recorded cases.

The stand-in answers every custom-op call with the outputs the wheel's meta function infers, so
a kernel that unpacks or reshapes an op's outputs wrongly returns the wrong shape here.
"""
from __future__ import annotations

import pytest
import torch
from standin_kit import SCENARIOS

META_OPS = ["npu_fused_infer_attention_score", "npu_rms_norm", "npu_add_rms_norm", "npu_apply_rotary_pos_emb"]


def flat(output):
    return list(output) if isinstance(output, tuple) else [output]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_kernel_outputs_have_the_contract_shapes(scenarios, name):
    got = [None if o is None else (tuple(o.shape), o.dtype) for o in flat(scenarios[name].output)]
    assert got == scenarios[name].expected


@pytest.mark.parametrize("op", META_OPS)
def test_each_custom_op_is_answered_by_the_wheels_meta_function(scenarios, meta, op):
    calls = [c for s in scenarios.values() for c in s.calls if c.op == op]
    assert calls and op in meta.registered
    for call in calls:
        assert call.result is not None and all(isinstance(t, torch.Tensor) for t in call.result)


def test_attention_output_is_tokens_heads_head_dim_in_the_query_dtype(scenarios):
    for name in ("decode, 256-token blocks", "prefill chunk", "mixed"):
        (call,) = scenarios[name].calls
        out, lse = call.result
        query = call.kwargs["query"]
        assert out.shape == query.shape and out.dtype == query.dtype, name
        assert lse.numel() == 0, "softmax_lse is only produced with softmax_lse_flag=True"


def test_add_rms_norm_third_output_is_the_sum_not_the_rstd(scenarios):
    (call,) = scenarios["add_rms_norm"].calls
    y, rstd, summed = call.result
    x1 = call.args[0]
    assert y.shape == summed.shape == x1.shape and y.dtype == summed.dtype == x1.dtype
    assert rstd.dtype == torch.float32 and rstd.shape == (*x1.shape[:-1], 1)


def test_the_meta_functions_really_run(meta):
    """A wrong layout is refused by the wheel's own meta check (so it is evaluated, not mocked)."""
    q = torch.empty(2, 3, 8, 128)
    with pytest.raises(RuntimeError, match="queryDims"):
        meta.run("npu_fused_infer_attention_score", q, q, q, input_layout="TND", num_heads=8)
    out, rstd = meta.run("npu_rms_norm", torch.empty(4, 6, 32, dtype=torch.float16),
                         torch.empty(6, 32, dtype=torch.float16), 1e-6)
    assert out.shape == (4, 6, 32) and rstd.shape == (4, 1, 1) and rstd.dtype == torch.float32
