"""Device selection and import safety, with torch_npu simulated (never installed here).

Each fake torch_npu runs in a subprocess (``sys.executable -c ...`` with the fake first on
PYTHONPATH), so this test process never sees it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from qwen_npu.kernels import cpu as cpu_kernels

from qwen_npu import DeviceError
from qwen_npu import device as dev

NO_TORCH_NPU = importlib.util.find_spec("torch_npu") is None
needs_no_torch_npu = pytest.mark.skipif(not NO_TORCH_NPU, reason="torch_npu is installed here")


def run_python(code: str, fake_root=None) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line, returned as a dict."""
    env = dict(os.environ)
    if fake_root is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(fake_root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_fake_torch_npu(root, init_source: str):
    pkg = root / "torch_npu"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(init_source))
    return root


# --- torch_npu absent (this machine) ----------------------------------------------------------

@needs_no_torch_npu
def test_without_torch_npu_auto_is_cuda_or_cpu_and_npu_names_the_reason():
    assert dev.npu_status() == (False, "torch_npu is not installed")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert dev.resolve_device("auto").type == expected
    assert dev.resolve_device() == dev.resolve_device("auto")
    for spec in ("npu", "npu:0", "NPU:1"):
        with pytest.raises(DeviceError, match="torch_npu is not installed"):
            dev.resolve_device(spec)


def test_explicit_devices():
    assert dev.resolve_device("cpu") == torch.device("cpu")
    assert dev.resolve_device(torch.device("cpu")) == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="cuda"):
            dev.resolve_device("cuda")
    for bad in ("tpu", "npu:x", "gpu"):
        with pytest.raises(DeviceError):
            dev.resolve_device(bad)


def test_default_block_size():
    assert dev.default_block_size(torch.device("cpu")) == 16
    assert dev.default_block_size("cuda:0") == 16
    assert dev.default_block_size("npu:0") == 128


# "auto" on a cpu picks the cpu kernel set where it can run (AVX2 and a C++ compiler), with native
# bf16 or without (tests/kernels/test_build.py covers the choice with stubbed detection)
CPU_AUTO = "cpu" if cpu_kernels.available() else "reference"


@pytest.mark.parametrize("name, device, expected", [
    ("auto", "cpu", CPU_AUTO), ("auto", "cuda:0", "cuda"), ("auto", "npu:0", "npu"),
    ("reference", "cpu", "reference"), ("reference", "npu:0", "reference"), ("npu", "npu", "npu"),
    ("cuda", "cpu", "cuda"), ("cuda", "npu:0", "cuda"), ("cuda", "cuda:1", "cuda"),
])
def test_resolve_kernels(name, device, expected):
    assert dev.resolve_kernels(name, device) == expected
    if device == "cpu":
        assert dev.resolve_kernels(name, torch.device("cpu")) == expected


def test_the_cuda_set_needs_no_build_on_a_cpu_device(monkeypatch):
    from qwen_npu.kernels import cpu as cpu_set

    def refuse():
        raise AssertionError("the cpu set was built for kernels='cuda'")
    monkeypatch.setattr(cpu_set, "ensure_built", refuse)
    assert dev.prepare_kernels("cuda", "cpu") == "cuda"


@pytest.mark.parametrize("name, device", [("npu", "cpu"), ("npu", "cuda:0"), ("fast", "cpu"), ("cpu", "cuda:0"),
                                          ("cpu", "npu:0")])
def test_resolve_kernels_refuses(name, device):
    with pytest.raises(DeviceError, match="kernel"):
        dev.resolve_kernels(name, device)


def test_synchronize_on_cpu_is_a_no_op():
    dev.synchronize(torch.device("cpu"))


def test_torch_import_hint_names_both_fixes():
    try:
        raise RuntimeError("Failed to load the backend extension: torch_npu.") from OSError(
            "libhccl.so: cannot open shared object file")
    except RuntimeError as exc:
        hint = dev.torch_import_hint(exc)
    assert "libhccl.so" in hint and "CANN" in hint and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in hint


def test_importing_qwen_npu_imports_neither_torch_npu_nor_transformers():
    got = run_python("""
        import json, sys
        import qwen_npu, qwen_npu.device, qwen_npu.kernels, qwen_npu.kernels.npu
        print(json.dumps({m: m in sys.modules for m in ("torch_npu", "transformers")}))
    """)
    assert got == {"torch_npu": False, "transformers": False}


def test_npu_kernels_on_cpu_fall_back_to_the_reference_and_warn_once():
    from qwen_npu.kernels import npu, reference
    npu.warn_fallback.cache_clear()
    x, w = torch.randn(3, 8), torch.rand(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert torch.equal(npu.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    assert [str(c.message) for c in caught] == [
        "qwen_npu.kernels.npu.rms_norm: tensors are on cpu, not an npu; running the reference kernel instead"]
    npu.warn_fallback.cache_clear()


# --- fake torch_npu packages, each in a subprocess -------------------------------------------

BROKEN_CHECK = """
    import json, sys, torch
    import qwen_npu
    from qwen_npu import device as dev, DeviceError
    from qwen_npu.kernels import get_kernels
    dev._probe_torch_npu.cache_clear()
    ok, reason = dev.npu_status()
    try:
        dev.resolve_device("npu")
        npu_error = None
    except DeviceError as e:
        npu_error = str(e)
    ref = get_kernels("reference")
    x = torch.randn(2, 8)
    y = ref.rms_norm(x, torch.ones(8), 1e-6)
    kc = torch.zeros(2, 4, 1, 8); vc = torch.zeros_like(kc)
    ref.write_kv(x[:, None], x[:, None], kc, vc, torch.tensor([1, -1]))
    print(json.dumps({"ok": ok, "reason": reason, "npu_error": npu_error,
                      "auto": str(dev.resolve_device("auto")), "kernels": dev.resolve_kernels("auto", "cpu"),
                      "reference_ok": bool(torch.isfinite(y).all()) and bool(kc[0, 1].eq(x[0]).all())}))
"""


@pytest.mark.parametrize("error", ['OSError("libhccl.so: cannot open shared object file")',
                                   'RuntimeError("ACL error 507033: libascendcl init failed")'])
def test_broken_torch_npu_is_reported_with_the_cann_hint(tmp_path, error):
    root = make_fake_torch_npu(tmp_path / "fake", f"raise {error}\n")
    got = run_python(BROKEN_CHECK, root)
    message = error.split('"')[1]
    assert got["ok"] is False
    assert got["reason"].startswith("torch_npu failed to import") and message in got["reason"]
    for text in (got["reason"], got["npu_error"]):
        assert "CANN" in text and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in text
    assert got["auto"] in ("cpu", "cuda:0") and got["kernels"] == CPU_AUTO and got["reference_ok"]


def test_torch_npu_that_sees_no_device(tmp_path):
    root = make_fake_torch_npu(tmp_path / "fake", """
        class npu:
            is_available = staticmethod(lambda: False)
            device_count = staticmethod(lambda: 0)
    """)
    got = run_python(BROKEN_CHECK, root)
    assert got["ok"] is False and got["reason"].startswith("no NPU visible")
    assert "no NPU visible" in got["npu_error"] and got["auto"] in ("cpu", "cuda:0") and got["reference_ok"]


def test_torch_npu_that_sees_a_device(tmp_path):
    root = make_fake_torch_npu(tmp_path / "fake", """
        import torch
        torch.utils.rename_privateuse1_backend("npu")
        synced = []
        class npu:
            is_available = staticmethod(lambda: True)
            device_count = staticmethod(lambda: 2)
            synchronize = staticmethod(lambda device=None: synced.append(str(device)))
    """)
    got = run_python("""
        import json, torch_npu
        from qwen_npu import device as dev, DeviceError
        auto = dev.resolve_device("auto")
        try:
            dev.resolve_device("npu:2"); too_far = None
        except DeviceError as e:
            too_far = str(e)
        dev.synchronize(auto)
        print(json.dumps({"status": dev.npu_status(), "auto": str(auto), "npu1": str(dev.resolve_device("npu:1")),
                          "block": dev.default_block_size(auto), "kernels": dev.resolve_kernels("auto", auto),
                          "reference": dev.resolve_kernels("reference", auto), "too_far": too_far,
                          "synced": torch_npu.synced}))
    """, root)
    assert got["status"] == [True, "npu:0..1 available"]
    assert got["auto"] == "npu:0" and got["npu1"] == "npu:1" and got["block"] == 128
    assert got["kernels"] == "npu" and got["reference"] == "reference"
    assert "only 2 NPU" in got["too_far"] and got["synced"] == ["npu:0"]


def make_autoloaded_broken_torch_npu(root):
    """torch-npu installed without CANN: torch's backend autoload fails inside `import torch`."""
    make_fake_torch_npu(root, 'raise OSError("libhccl.so: cannot open shared object file")\n')
    dist = root / "torch_npu-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    return root


IMPORT_CHECK = """
    import importlib.util, json, sys, types
    if {bypass_init}:   # load qwen_npu.device without running qwen_npu/__init__.py
        pkg = types.ModuleType("qwen_npu")
        pkg.__path__ = list(importlib.util.find_spec("qwen_npu").submodule_search_locations)
        sys.modules["qwen_npu"] = pkg
    try:
        import qwen_npu.device
        message = None
    except ImportError as e:
        message = str(e)
    except Exception as e:
        message = "not an ImportError: " + repr(e)
    print(json.dumps({{"message": message}}))
"""


def assert_hint(message):
    assert message is not None and message.startswith("import torch failed"), message
    assert "CANN" in message and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in message


def test_device_module_turns_a_failing_import_torch_into_the_cann_hint(tmp_path):
    root = make_autoloaded_broken_torch_npu(tmp_path / "fake")
    assert_hint(run_python(IMPORT_CHECK.format(bypass_init=True), root)["message"])


def test_import_qwen_npu_shows_the_cann_hint_when_torch_cannot_load(tmp_path):
    root = make_autoloaded_broken_torch_npu(tmp_path / "fake")
    assert_hint(run_python(IMPORT_CHECK.format(bypass_init=False), root)["message"])
