"""The torch / torch-npu pair is declared once (pyproject.toml's npu extra) and the checks use it."""
from __future__ import annotations

import sys

import pytest
import wheel_kit
from wheel_kit import Wheel, WheelUnavailable, fetch, pinned_versions


def test_the_npu_extra_pins_the_pair_and_the_wheel_is_that_release(wheel):
    pins = pinned_versions()
    assert wheel.version == pins["torch-npu"]
    # torch-npu X requires torch X.*: the pinned torch must satisfy the wheel's own requirement
    assert wheel.requires_torch() == f"=={pins['torch']}.*", (
        f"torch-npu {wheel.version} requires torch{wheel.requires_torch()}; pin that torch in the npu extra")


def test_an_unpinned_extra_is_refused_with_the_file_and_what_is_missing(tmp_path):
    bad = tmp_path / "pyproject.toml"
    bad.write_text('[project]\nname = "x"\n[project.optional-dependencies]\nnpu = ["torch-npu>=2.13", "torch==2.13.0"]\n')
    with pytest.raises(ValueError, match=r"pyproject.toml: the 'npu' extra must pin torch-npu with '=='"):
        pinned_versions(bad)
    good = tmp_path / "good.toml"
    good.write_text('[project]\nname = "x"\n[project.optional-dependencies]\nnpu = ["torch==2.14.0", "torch_npu == 2.14.0"]\n')
    assert pinned_versions(good) == {"torch": "2.14.0", "torch-npu": "2.14.0"}


def test_a_cached_wheel_is_used_without_asking_the_registry(tmp_path, monkeypatch):
    cached = tmp_path / "torch_npu-9.9.9-cp311-cp311-manylinux_2_28_x86_64.whl"
    cached.write_bytes(b"")
    monkeypatch.setattr(wheel_kit.subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    assert fetch("9.9.9", tmp_path) == cached


@pytest.mark.parametrize("stderr, unreachable", [
    (("ERROR: Could not find a version that satisfies the requirement torch-npu==0.0.1 (from versions: 2.13.0)\n"
     "ERROR: No matching distribution found for torch-npu==0.0.1"), False),
    (("WARNING: Retrying ... NewConnectionError\nERROR: Could not find a version that satisfies the "
     "requirement torch-npu==2.13.0 (from versions: none)"), True),
])
def test_a_failed_download_says_what_pip_said_and_whether_the_registry_answered(tmp_path, monkeypatch,
                                                                               stderr, unreachable):
    class Proc:
        returncode, stdout = 1, ""
    Proc.stderr = stderr
    seen = []
    monkeypatch.setattr(wheel_kit.subprocess, "run", lambda cmd, **k: seen.append((cmd, k)) or Proc())
    with pytest.raises(WheelUnavailable) as caught:
        fetch("0.0.1", tmp_path / "cache")
    assert "pip download torch-npu==0.0.1 failed" in str(caught.value) and "ERROR" in str(caught.value)
    assert caught.value.unreachable is unreachable
    cmd, kwargs = seen[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
    assert kwargs["timeout"] > 0


def test_the_wheel_is_read_without_importing_torch_npu(wheel):
    assert "torch_npu" not in sys.modules
    assert isinstance(wheel, Wheel) and wheel.read_text(wheel_kit.ATB_HEADER).startswith(("#", "/"))
