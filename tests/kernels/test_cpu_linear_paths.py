"""Which product the cpu set's ``linear`` runs, and that each is right at awkward shapes.

Four kinds of machine, forced through ``cpu.native_bf16``, ``cpu.bf16_dot`` and ``cpu.amx``:

    AVX512-BF16        bf16 x below ``cpu.BF16_DOT_ROWS`` rows: csrc/linear_bf16.cpp; from it on:
                       torch's bf16 product (run only where the CPU really has the instructions)
    AVX512-BF16 + AMX  the same with ``cpu.NATIVE_ROWS`` for ``BF16_DOT_ROWS`` (the tiles win early)
    other native bf16  bf16 x from ``cpu.NATIVE_ROWS`` rows on: torch's bf16 product
    (AMX only)
    no native bf16     the C++ widening kernel (torch's bf16 product would be only slow, not wrong)

Tolerances as in test_cpu.py, against float64 from the same rounded inputs.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_reference import TOL

from qwen_npu.kernels import cpu, cpu_features

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"cpu kernels: {cpu.availability()[1]}")


HAS_DOT = cpu.available() and cpu.bf16_dot()
MACHINES = [pytest.param("avx512-bf16", marks=pytest.mark.skipif(not HAS_DOT, reason="no AVX512-BF16 here")),
            pytest.param("avx512-bf16-amx", marks=pytest.mark.skipif(not HAS_DOT, reason="no AVX512-BF16 here")),
            "native-bf16-only", "no-native-bf16"]


@pytest.fixture
def kernel_calls(monkeypatch):
    """The calls that reach the compiled extension: ("linear" or "linear_bf16", x shape)."""
    calls = []
    real = cpu.ops()

    class Spy:
        def linear(self, *args):
            calls.append(("linear", args[0].shape))
            return real.linear(*args)

        def linear_bf16(self, *args):
            calls.append(("linear_bf16", args[0].shape))
            return real.linear_bf16(*args)

        def has_bf16_dot(self):
            return real.has_bf16_dot()
    monkeypatch.setattr(cpu, "ops", lambda: Spy())
    return calls


def as_machine(monkeypatch, machine):
    monkeypatch.setattr(cpu, "native_bf16", lambda: machine != "no-native-bf16")
    monkeypatch.setattr(cpu, "bf16_dot", lambda: machine.startswith("avx512-bf16"))
    monkeypatch.setattr(cpu, "amx", lambda: machine in ("avx512-bf16-amx", "native-bf16-only"))


def expected_path(machine, rows):
    if machine == "avx512-bf16":
        return "linear_bf16" if rows < cpu.BF16_DOT_ROWS else "torch"
    if machine == "avx512-bf16-amx":
        return "linear_bf16" if rows < cpu.NATIVE_ROWS else "torch"
    if machine == "native-bf16-only" and rows >= cpu.NATIVE_ROWS:
        return "torch"
    return "linear"


def _case(rows, n, k, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed + rows * 1000 + n * 10 + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.2).bfloat16()
    return x, w


ROWS = sorted({1, cpu.NATIVE_ROWS - 1, cpu.NATIVE_ROWS, cpu.NATIVE_ROWS + 1, cpu.BF16_DOT_ROWS - 1,
               cpu.BF16_DOT_ROWS, 16, 33})


@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k", [(37, 264), (2, 13), (151, 1000), (17, 8)])
def test_linear_path_by_rows_and_machine(monkeypatch, kernel_calls, machine, rows, n, k):
    as_machine(monkeypatch, machine)
    x, w = _case(rows, n, k)
    y = cpu.linear(x, w)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, **TOL[torch.bfloat16])
    path = expected_path(machine, rows)
    assert [c[0] for c in kernel_calls] == ([] if path == "torch" else [path])
    if path == "torch":
        assert torch.equal(y, F.linear(x, w))


@pytest.mark.parametrize("machine", MACHINES)
def test_linear_counts_rows_across_leading_dims(monkeypatch, kernel_calls, machine):
    """[2, R, K] is 2R rows: the choice goes by rows, not by the first dimension."""
    as_machine(monkeypatch, machine)
    for r in (cpu.NATIVE_ROWS, cpu.BF16_DOT_ROWS):
        kernel_calls.clear()
        x, w = _case(2 * r, 50, 96, seed=3)
        x = x.view(2, r, 96)
        y = cpu.linear(x, w)
        assert y.shape == (2, r, 50)
        torch.testing.assert_close(y.double(), x.double() @ w.double().T, **TOL[torch.bfloat16])
        path = expected_path(machine, 2 * r)
        assert [c[0] for c in kernel_calls] == ([] if path == "torch" else [path])


def test_float32_x_with_bf16_weights_stays_on_the_kernel(monkeypatch, kernel_calls):
    """Only bf16 x may take torch's bf16 product: fp32 x would be rounded on the way."""
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)
    x, w = _case(40, 24, 72, dtype=torch.float32, seed=4)
    y = cpu.linear(x, w)
    assert y.dtype == torch.float32 and len(kernel_calls) == 1
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, **TOL[torch.float32])


def test_non_contiguous_weight_view_on_either_path(monkeypatch):
    fused = (torch.randn(40, 48, generator=torch.Generator().manual_seed(7)) * 0.2).bfloat16()
    view = fused[:, 8:40]                                 # not contiguous
    x = torch.randn(19, 32, generator=torch.Generator().manual_seed(8)).bfloat16()
    for machine in ("avx512-bf16", "native-bf16-only", "no-native-bf16")[0 if HAS_DOT else 1:]:
        as_machine(monkeypatch, machine)
        for rows in (3, 19):
            torch.testing.assert_close(cpu.linear(x[:rows], view).double(), x[:rows].double() @ view.double().T,
                                       **TOL[torch.bfloat16])


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="needs /proc/cpuinfo to know the answer")
def test_native_bf16_probe_agrees_with_the_cpu_flags():
    flags = set(Path("/proc/cpuinfo").read_text().split())
    if cpu_features.isa_cap() == "avx2":                    # an AVX2-only machine has none of them
        flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
    assert cpu.native_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(4, 16), (7, 1000), (151, 1030), (3, 40), (1, 7), (9, 2048 + 24)])
def test_one_row_against_many_weight_rows(wdtype, n, k):
    """The one-row layout: weight rows 4 at a time with the last n % 4 alone, k in steps of 16
    with the remainder one by one, prefetching past the end of the weights."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(1, k, generator=gen)
    w = (torch.randn(n, k, generator=gen) * 0.2).to(wdtype)
    y = cpu.ops().linear(x, w, cpu.PANEL_ROWS)
    assert y.shape == (1, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, **TOL[torch.float32])
