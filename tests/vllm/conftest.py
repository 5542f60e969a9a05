"""Real-engine tests: vLLM's CPU build, in the separate venv `.ci/setup-vllm` makes.

Every test here carries the `vllm` marker (`-m "not vllm"` skips them). Without that venv they
are skipped, except under CI=true, where a missing venv fails them: CI must run them.
"""
import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).parent
DEFAULT_VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qwen-npu" / "vllm-0.32"


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_python():
    """The python of the vLLM venv, with vLLM 0.32 and this qwen_npu importable in it."""
    venv = Path(os.environ.get("QWEN_NPU_VLLM_VENV", DEFAULT_VENV))
    python = venv / "bin" / "python"
    problem = None
    if not python.exists():
        problem = f"no vLLM venv at {venv} (make it with .ci/setup-vllm)"
    else:
        code = "import vllm, qwen_npu.integrations.vllm as g; print(vllm.__version__, g.__file__)"
        probe = subprocess.run([str(python), "-c", code], check=False, capture_output=True, text=True,
                               timeout=300)
        if probe.returncode != 0:
            problem = f"{python} cannot import vllm and qwen_npu: {probe.stderr[-2000:]}"
        elif not probe.stdout.split()[0].startswith("0.32."):
            problem = f"{python} has vLLM {probe.stdout.split()[0]}, expected 0.32.x"
        elif Path(probe.stdout.split()[1]).resolve().parents[3] != HERE.parents[1].resolve():
            problem = f"{python} imports another qwen_npu ({probe.stdout.split()[1]}); rerun .ci/setup-vllm"
    if problem:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: the vLLM real-engine tests must run, but {problem}")
        pytest.skip(problem)
    return str(python)


@pytest.fixture(scope="session")
def vllm_ckpt(tmp_path_factory):
    """A tiny Qwen3 with the real tokenizer; head_dim 64 (vLLM's CPU attention has no kernel for 16)."""
    from qwen_npu.testing import make_tiny_qwen3
    return make_tiny_qwen3(tmp_path_factory.mktemp("vllm_ckpt"), head_dim=64, num_attention_heads=2,
                           num_key_value_heads=1)
