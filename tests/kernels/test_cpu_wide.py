"""The bf16 norms and activation on 16 AVX-512 lanes (csrc/elementwise_avx512.cpp) give the bits
of the 8-lane kernels, on a CPU that has AVX-512: every rounding in the same place and the mean
square summed in the same order, tails and non-finite values included. Many rows per case, so
that a summation order that moved the last bit of a row's scale would show in the outputs."""
from __future__ import annotations

import pytest
import torch

from qwen_npu.kernels import cpu

pytestmark = pytest.mark.skipif(not (cpu.available() and cpu.wide()), reason="the CPU has no AVX-512")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def spread(rows: int, n: int, seed: int) -> torch.Tensor:
    """bf16 values over many magnitudes, a few non-finite ones in the first row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen) * 3)
    x = x.bfloat16()
    x[0, : min(3, n)] = torch.tensor([float("nan"), float("inf"), -float("inf")][: min(3, n)])
    return x


@pytest.mark.parametrize("n", [1024, 1013, 1000, 128, 29, 24, 17, 13, 8, 3])
def test_norms_are_bit_identical_to_the_8_lane_kernels(n):
    ops = cpu.ops()
    x, r = spread(1500, n, 1), spread(1500, n, 2)
    w = torch.randn(n, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(bits(ops.rms_norm(x, w, 1e-6, True)), bits(ops.rms_norm(x, w, 1e-6, False)))
    (y, s), (y8, s8) = ops.add_rms_norm(x, r, w, 1e-6, True), ops.add_rms_norm(x, r, w, 1e-6, False)
    assert torch.equal(bits(s), bits(s8)) and torch.equal(bits(y), bits(y8))


@pytest.mark.parametrize("head_dim", [128, 64, 256, 96, 32])
def test_qk_norm_rope_is_bit_identical_to_the_8_lane_kernel(head_dim):
    """On views of a fused qkv output, as the model passes them."""
    ops = cpu.ops()
    tokens, heads, kv_heads = 300, 4, 2
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).bfloat16()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    cos, sin = torch.randn(tokens, head_dim, generator=gen), torch.randn(tokens, head_dim, generator=gen)
    qw, kw = torch.randn(head_dim, generator=gen).bfloat16(), torch.randn(head_dim, generator=gen).bfloat16()
    qkv[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])      # token 0, q head 0
    wide = ops.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin, True)
    narrow = ops.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin, False)
    for a, b in zip(wide, narrow):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("n", [3072, 1000, 13])
def test_silu_mul_is_bit_identical_to_the_8_lane_kernel(n):
    ops = cpu.ops()
    gate_up = spread(64, 2 * n, 4) * 4
    assert torch.equal(bits(ops.silu_mul(gate_up, True)), bits(ops.silu_mul(gate_up, False)))
    rows = torch.cat([gate_up, gate_up], 1)[:, : 2 * n]              # strided rows
    assert torch.equal(bits(ops.silu_mul(rows, True)), bits(ops.silu_mul(rows, False)))


def test_the_set_runs_the_wide_kernels_here(monkeypatch):
    x = spread(20, 1024, 5)
    w = torch.ones(1024, dtype=torch.bfloat16)
    calls = []
    real = cpu.ops()

    class Recorder:
        def __getattr__(self, name):
            fn = getattr(real, name)

            def record(*args):
                calls.append((name, args[-1]))
                return fn(*args)
            return record
    monkeypatch.setattr(cpu, "ops", lambda: Recorder())
    cpu.rms_norm(x, w, 1e-6)
    cpu.silu_mul(x)
    assert calls == [("rms_norm", True), ("silu_mul", True)]
