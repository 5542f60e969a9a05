"""Shared fixtures. The session-scoped checkpoints are shared by every test: treat them as
read-only (copy a folder with ``shutil.copytree`` before changing anything in it)."""
import os

import pytest
import torch

from qwen_npu.testing import make_tiny_qwen3

torch.set_num_threads(2)


def pytest_configure(config):
    """``QWEN_NPU_CPU_ISA=avx2`` runs the suite as an AVX2-only CPU would (kernels/cpu_features.py);
    a cap that came too late to take would test the wrong paths, so stop instead."""
    from qwen_npu.kernels import cpu_features
    ok, why = cpu_features.isa_cap_in_force()
    if not ok:
        pytest.exit(why, returncode=4)


@pytest.fixture
def default_sigint():
    """Ctrl-C raises KeyboardInterrupt for the test's duration, as in a notebook: a process started in
    the background by a non-interactive shell inherits SIGINT ignored, and Python keeps it so."""
    import signal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Default tiny Qwen3 (2 layers, hidden 64) with the real vocabulary, tokenizer and chat template."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_ckpt"))


@pytest.fixture(scope="session")
def tiny_ckpt_small_vocab(tmp_path_factory):
    """Default tiny Qwen3 with a 512-token vocabulary, no tokenizer files, eos 511."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_ckpt_small_vocab"), vocab_size=512)


# The Session-level parity and collision tests run once per kernel set that runs on the CPU (the
# cuda set is pure torch and runs here too), whatever kernels="auto" would pick on this host:
# modules whose names start with one of these.
BOTH_KERNEL_SETS = ("test_hf_parity", "test_session_hf_greedy", "test_collisions_", "test_speculative_greedy")


def pytest_generate_tests(metafunc):
    module = metafunc.module.__name__.rpartition(".")[2]
    if "kernel_set" in metafunc.fixturenames and module.startswith(BOTH_KERNEL_SETS):
        metafunc.parametrize("kernel_set", ["reference", "cpu", "cuda"], indirect=True)


@pytest.fixture(autouse=True)
def kernel_set(request, monkeypatch):
    """In the modules named by BOTH_KERNEL_SETS, every Session made with kernels="auto" runs the set
    named by the parameter; "cpu" is skipped with the reason where the set cannot be built, except
    under CI=true, where that is a failure. Elsewhere this fixture does nothing."""
    name = getattr(request, "param", None)
    if name is None:
        return None
    if name == "cpu":
        from qwen_npu.kernels import build, cpu
        try:
            cpu.ensure_built()
        except build.KernelBuildError as e:
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"CI=true: the cpu kernel set must be tested here, but {e}")
            pytest.skip(f"the cpu kernel set cannot run here: {e}")
    import qwen_npu.session.session as session_module
    real = session_module.load_session

    def load_session(path, options):
        if options.kernels != "auto":
            return real(path, options)
        model, config, tokenizer, parallel = real(path, options.replace(kernels=name))
        assert config.kernels == name, f"asked for the {name} kernel set, got {config.kernels}"
        return model, config, tokenizer, parallel

    monkeypatch.setattr(session_module, "load_session", load_session)
    return name


@pytest.fixture
def small_floors(monkeypatch):
    """``qwen-npu bench``'s limits measured on small buffers, so that a test run stays quick."""
    from qwen_npu.tools import bench_floors
    monkeypatch.setattr(bench_floors, "READ_BYTES", 1 << 22)
    monkeypatch.setattr(bench_floors, "FP32_SHAPE", (64, 128, 128))
    monkeypatch.setattr(bench_floors, "BF16_SHAPE", (64, 128, 128))
    monkeypatch.setattr(bench_floors, "REPS", 1)
    monkeypatch.setattr(bench_floors, "PEAK_ITERS", 100_000)
