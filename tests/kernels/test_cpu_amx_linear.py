"""Decode-shaped products on AMX tiles straight from oneDNN's reordered weights
(csrc/linear_amx.cpp): the bits oneDNN gives, for every row count it takes, and oneDNN wherever it
does not take the call or its layout check fails. Skipped where the CPU has no AMX tiles."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwen_npu.kernels import cpu, onednn

pytestmark = pytest.mark.skipif(not (cpu.available() and cpu.amx() and cpu.native_bf16()
                                     and cpu.bf16_dot() and cpu.ops().has_amx_linear()),
                                reason="the CPU has no AMX tiles (or Linux does not grant them)")


def reordered(n: int, k: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16() * 0.05
    return onednn.prepare_weight(w)


def calls(monkeypatch) -> list[int]:
    """The row counts the AMX kernel is called with from here on."""
    seen, real = [], cpu.ops()

    class Recorder:
        def __getattr__(self, name):
            fn = getattr(real, name)
            if name != "linear_amx":
                return fn

            def record(x, *args):
                seen.append(x.shape[0])
                return fn(x, *args)
            return record
    monkeypatch.setattr(cpu, "ops", lambda: Recorder())
    return seen


@pytest.mark.parametrize("n, k", [(4096, 1024), (1024, 2048), (1024, 3072), (96, 64), (32, 32)])
def test_up_to_16_rows_give_onednns_bits(n, k, monkeypatch):
    w = reordered(n, k)
    seen = calls(monkeypatch)
    gen = torch.Generator().manual_seed(n + k)
    for rows in (1, 2, 3, 5, 8, 13, 16):
        x = torch.randn(rows, k, generator=gen).bfloat16() * 3
        assert torch.equal(cpu.linear(x, w), onednn.linear(x, w)), rows
    assert seen[-7:] == [1, 2, 3, 5, 8, 13, 16]


def test_leading_dims_and_non_finite_rows(monkeypatch):
    w = reordered(64, 128, seed=1)
    seen = calls(monkeypatch)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[0, 1, 5], x[1, 2, 7] = float("nan"), float("inf")
    got, want = cpu.linear(x, w), onednn.linear(x, w)
    assert got.shape == (2, 3, 64) and 6 in seen                         # the six rows went to the tiles
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))     # NaN rows bit for bit too


def test_what_it_cannot_take_goes_to_onednn(monkeypatch):
    seen = calls(monkeypatch)
    big = reordered(64, 64, seed=3)
    x = torch.randn(17, 64).bfloat16()                                    # more rows than AMX_ROWS
    assert torch.equal(cpu.linear(x, big), onednn.linear(x, big))
    odd = reordered(40, 48, seed=4)                                       # N, K not multiples of 32
    y = torch.randn(4, 48).bfloat16()
    assert torch.equal(cpu.linear(y, odd), onednn.linear(y, odd))
    assert 17 not in seen and 4 not in seen[-1:]
    address = torch.ops.mkldnn.data_ptr(big)                             # the kernel's own refusals
    for rows, k in ((17, 64), (0, 64), (4, 48)):
        assert cpu.ops().linear_amx(torch.zeros(rows, k).bfloat16(), address, 64) is None


def test_another_layout_of_the_same_shape_stays_with_onednn(monkeypatch):
    """A weight reordered for one row (oneDNN lays it out in blocks of 64 columns) beside one
    reordered as a Session does: each weight is checked for itself, and the other layout is never
    read as if it were the kernel's."""
    w = torch.randn(128, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    ours = onednn.prepare_weight(w)
    other = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    x = torch.randn(4, 64).bfloat16()
    assert torch.equal(cpu.linear(x, ours), onednn.linear(x, ours))
    assert torch.equal(cpu.linear(x, other), onednn.linear(x, other))
    assert ours._amx_agrees[1]
    assert not other._amx_agrees[1] or torch.equal(cpu.linear(x, other), F.linear(x, w))


def test_a_weight_the_kernel_misreads_stays_with_onednn(monkeypatch):
    """If the kernel read a weight otherwise than oneDNN, its first product disagrees and the
    weight is never sent to the kernel again."""
    real = cpu.ops()
    sent = []

    class Wrong:
        def __getattr__(self, name):
            fn = getattr(real, name)
            if name == "linear_amx":
                def wrong(x, address, n):
                    sent.append(x.shape[0])
                    return fn(x, address, n) + 1                          # as if it read other bytes
                return wrong
            return fn
    monkeypatch.setattr(cpu, "ops", lambda: Wrong())
    w = reordered(128, 64, seed=5)
    x = torch.randn(4, 64).bfloat16()
    assert torch.equal(cpu.linear(x, w), onednn.linear(x, w))
    assert w._amx_agrees[:2] == (torch.get_num_threads(), False)
    checked = len(sent)
    assert torch.equal(cpu.linear(x, w), onednn.linear(x, w)) and len(sent) == checked


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("n, k", [(6144, 1024), (128, 64), (64, 32)])
def test_gate_up_silu_gives_the_bits_of_the_product_then_silu_mul(n, k):
    w = reordered(n, k, seed=n)
    gen = torch.Generator().manual_seed(k)
    for rows in (1, 2, 5, 8, 13, 16):
        x = torch.randn(rows, k, generator=gen).bfloat16() * 4             # gate values well below and above 0
        fused = cpu.gate_up_silu(x, w)
        assert fused is not None and fused.shape == (rows, n // 2)
        assert torch.equal(bits(fused), bits(cpu.silu_mul(cpu.linear(x, w)))), rows


def test_gate_up_silu_passes_non_finite_values_as_the_two_calls_do():
    w = reordered(128, 64, seed=7)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    x[1, 3], x[2, 9], x[3] = float("nan"), float("inf"), 1e30            # NaN, inf and huge sums
    fused = cpu.gate_up_silu(x, w)
    assert torch.equal(bits(fused), bits(cpu.silu_mul(cpu.linear(x, w))))


def test_gate_up_silu_declines_what_it_cannot_take():
    w = reordered(128, 64, seed=9)
    x = torch.randn(4, 64).bfloat16()
    assert cpu.gate_up_silu(torch.randn(17, 64).bfloat16(), w) is None                 # more than AMX_ROWS rows
    assert cpu.gate_up_silu(x.float(), w) is None                                       # not bf16
    assert cpu.gate_up_silu(x, torch.randn(128, 64).bfloat16()) is None               # a plain weight
    assert cpu.gate_up_silu(torch.randn(4, 32).bfloat16(), w) is None                  # K disagrees
    assert cpu.gate_up_silu(x, reordered(96, 64, seed=10)) is None                     # I = 48: not whole blocks
    address = torch.ops.mkldnn.data_ptr(w)                                              # the kernel's own refusals
    for rows, k, n in ((17, 64, 128), (0, 64, 128), (4, 48, 128), (4, 64, 96)):
        assert cpu.ops().gate_up_silu_amx(torch.zeros(rows, k).bfloat16(), address, n) is None


def test_a_weight_whose_product_disagrees_is_not_fused(monkeypatch):
    w = reordered(128, 64, seed=11)
    x = torch.randn(4, 64).bfloat16()
    cpu.amx_agrees(w)
    monkeypatch.setattr(w, "_amx_agrees", (w._amx_agrees[0], False) + w._amx_agrees[2:])
    assert cpu.gate_up_silu(x, w) is None


def test_a_bf16_session_fuses_the_gate_up_product_with_the_same_logits(tiny_ckpt, monkeypatch):
    from qwen_npu import SamplingParams, Session

    def run() -> torch.Tensor:
        sess = Session.from_pretrained(tiny_ckpt, kernels="cpu", dtype="bfloat16", max_model_len=128, num_blocks=32)
        reqs = [sess.add_request([5 + i] * (9 + i), SamplingParams(max_new_tokens=3, ignore_eos=True)) for i in range(3)]
        logits = []
        while not all(r.is_done for r in reqs):
            step = sess.step()
            logits.append(step.logits.to_host())
        return torch.cat(logits)

    real, used = cpu.gate_up_silu, []

    def counted(x, weight):
        out = real(x, weight)
        used.append((x.shape[0] <= cpu.AMX_ROWS, out is not None))
        return out
    monkeypatch.setattr(cpu, "gate_up_silu", counted)
    fused = run()
    assert (True, True) in used and all(small == took for small, took in used)    # decode rows fused, prefill not
    monkeypatch.setattr(cpu, "gate_up_silu", lambda x, weight: None)       # the two calls instead
    assert torch.equal(fused, run())
