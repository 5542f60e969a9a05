"""The probe of the installed stack (``npu_runtime.op_support``, ``installed_op_support``) with a
fake torch_npu: a custom op is there when the module exports it, the ATB decode op only when
``torch.ops.atb`` holds it (torch_npu's wrapper exists either way). Nothing is imported."""
from __future__ import annotations

import types

import pytest
import torch
from wheel_kit import exposed_ops

from qwen_npu.device import npu_runtime
from qwen_npu.device.npu_runtime import ATB_OPS, CUSTOM_OPS, installed_op_support, op_support

ATB = "_npu_paged_attention"


def fake_torch_npu(ops=CUSTOM_OPS + ATB_OPS, version="2.13.0"):
    """A module exporting ``ops`` as callables (the ATB ones as torch_npu's wrappers do)."""
    module = types.ModuleType("torch_npu")
    module.__version__ = version
    for op in ops:
        setattr(module, op, lambda *a, **k: None)
    return module


def torch_with_atb(namespace):
    """The ``torch`` npu_runtime sees, with ``torch.ops.atb`` replaced by ``namespace``."""
    return types.SimpleNamespace(ops=types.SimpleNamespace(atb=namespace))


class RaisingNamespace:
    def __getattr__(self, name):
        raise RuntimeError(f"no op {name}")


def test_with_atb_registered_every_op_is_there(monkeypatch):
    monkeypatch.setattr(npu_runtime, "torch", torch_with_atb(types.SimpleNamespace(**{ATB: object()})))
    assert op_support(fake_torch_npu()) == {op: None for op in CUSTOM_OPS + ATB_OPS}


@pytest.mark.parametrize("namespace", [None, types.SimpleNamespace(), RaisingNamespace()],
                         ids=["this torch, no atb library", "atb without the op", "lookup raises"])
def test_without_the_atb_op_it_is_unavailable_and_the_reason_says_how_to_install_it(monkeypatch, namespace):
    if namespace is not None:
        monkeypatch.setattr(npu_runtime, "torch", torch_with_atb(namespace))
    support = op_support(fake_torch_npu())          # torch_npu._npu_paged_attention exists, unregistered
    assert all(support[op] is None for op in CUSTOM_OPS)
    assert f"torch.ops.atb.{ATB} is not registered" in support[ATB] and "NNAL" in support[ATB]


def test_a_custom_op_the_module_lacks_is_named_with_the_version():
    support = op_support(fake_torch_npu([op for op in CUSTOM_OPS if op != "npu_rms_norm"], version="2.9.0"))
    assert support["npu_rms_norm"] == "torch_npu 2.9.0 has no npu_rms_norm"
    assert [op for op in CUSTOM_OPS if support[op] is not None] == ["npu_rms_norm"]


def test_a_non_callable_attribute_is_not_an_op():
    module = fake_torch_npu()
    module.npu_fused_infer_attention_score = "not a function"
    assert op_support(module)["npu_fused_infer_attention_score"] == "torch_npu 2.13.0 has no npu_fused_infer_attention_score"


def test_this_torch_has_no_atb_op_registered():
    assert not npu_runtime._atb_registered(ATB)
    assert not hasattr(torch.ops.atb, ATB)


@pytest.fixture
def probe(monkeypatch):
    """Replace the guarded import's result; the cached probe results are cleared around the test."""
    def set_probe(result):
        monkeypatch.setattr(npu_runtime, "_probe_torch_npu", lambda: result)
        installed_op_support.cache_clear()
    yield set_probe
    installed_op_support.cache_clear()


def test_installed_op_support_probes_the_loaded_module_once(probe, monkeypatch):
    monkeypatch.setattr(npu_runtime, "torch", torch_with_atb(types.SimpleNamespace(**{ATB: object()})))
    probe((fake_torch_npu(), 1, "npu:0 available"))
    first = installed_op_support()
    assert first == {op: None for op in CUSTOM_OPS + ATB_OPS}
    probe_calls = []
    monkeypatch.setattr(npu_runtime, "op_support", lambda m: probe_calls.append(m) or {})
    assert installed_op_support() is first and probe_calls == []


def test_installed_op_support_is_empty_without_torch_npu(probe):
    probe((None, 0, "torch_npu is not installed"))
    assert installed_op_support() == {}


def test_the_wheel_exports_every_op_the_probe_looks_for(wheel):
    exported = exposed_ops(wheel)
    assert {op: exported.get(op) for op in CUSTOM_OPS} == {op: f"torch.ops.npu.{op}" for op in CUSTOM_OPS}
    assert {op: exported.get(op) for op in ATB_OPS} == {op: f"torch.ops.atb.{op}" for op in ATB_OPS}
