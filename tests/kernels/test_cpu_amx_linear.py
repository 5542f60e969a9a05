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
