"""Building the cpu kernels: said on screen, one build per process, a bounded wait on another
process's build, a killed build's lock recognised as stale, a failed build reported once.

The threading and waiting tests replace the compile itself (``build._load``) by a stand-in that
writes the build's outputs slowly; the stale-lock test loads the real extension in a fresh process.
"""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
from qwen_npu.kernels import build, cpu, cpu_choice, cpu_features

from qwen_npu import device as devices
from qwen_npu.errors import DeviceError

HOLD_FLOCK = textwrap.dedent("""
    import fcntl, os, sys, time
    folder = sys.argv[1]
    fd = os.open(folder + ".flock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, str(os.getpid()).encode())
    if sys.argv[2] == "with-torch-lock":        # torch's builder creates this file while it builds
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, "lock"), "w").close()
    print("holding", flush=True)
    time.sleep(120)
""")


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """An empty TORCH_EXTENSIONS_DIR and no build remembered by this process (restored after)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    loaded, failed = dict(build._loaded), dict(build._failed)
    caches = (cpu.ops, cpu.availability, cpu_features.native_bf16, cpu_features.cpu_flags)
    for c in caches:
        c.cache_clear()
    yield tmp_path
    build._loaded.clear(), build._loaded.update(loaded)
    build._failed.clear(), build._failed.update(failed)
    for c in caches:
        c.cache_clear()


def fake_extension(name="fake_ext"):
    return build.Extension(name=name, sources=("/nowhere/a.cpp", "/nowhere/b.cpp"))


def slow_fake_load(calls, seconds=0.6):
    """A stand-in compile: writes each object and the library in turn, counts its calls."""
    def load(ext):
        calls.append(threading.get_ident())
        ext.folder.mkdir(parents=True, exist_ok=True)
        for stem in ("a", "b"):
            time.sleep(seconds / 3)
            (ext.folder / f"{stem}.o").write_bytes(b"")
        time.sleep(seconds / 3)
        ext.library.write_bytes(b"")
        return object()
    return load


def hold_flock(folder: Path, mode: str) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_FLOCK, str(folder), mode], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_two_threads_asking_at_once_build_once_and_say_so_once(fresh_state, monkeypatch):
    calls, logs, got, errors = [], [], [], []
    monkeypatch.setattr(build, "_load", slow_fake_load(calls))
    ext = fake_extension()
    gate = threading.Barrier(2)

    def ask():
        gate.wait()
        try:
            got.append(build.ensure_built(ext, log=logs.append, progress=True))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(got) == 2 and got[0] is got[1]
    assert len(calls) == 1
    assert logs[0] == build.MESSAGE.format(folder=ext.folder)
    assert sum("building the CPU kernels once" in line for line in logs) == 1
    assert logs[-1].startswith("built the CPU kernels in ")
    assert build.build_status(ext)[0] == "loaded"
    assert build.ensure_built(ext) is got[0] and len(calls) == 1


def test_a_live_build_in_another_process_is_waited_for_with_a_bound(fresh_state, monkeypatch):
    calls, logs = [], []
    monkeypatch.setattr(build, "_load", slow_fake_load(calls))
    ext = fake_extension("waits")
    ext.folder.parent.mkdir(parents=True)
    holder = hold_flock(ext.folder, "alone")
    try:
        t0 = time.monotonic()
        with pytest.raises(build.KernelBuildError, match=rf"pid {holder.pid}\) held .*waits.flock for over 1 s"):
            build.ensure_built(ext, log=logs.append, wait_s=1.0)
        assert time.monotonic() - t0 < 30
    finally:
        holder.kill()
        holder.wait()
    assert calls == [] and "waiting up to 1 s" in logs[0] and f"pid {holder.pid}" in logs[0]


def test_interrupted_build_releases_the_lock_and_is_not_remembered_as_failed(fresh_state, monkeypatch):
    calls = []

    def interrupted(ext):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "_load", interrupted)
    ext = fake_extension("interrupted")
    with pytest.raises(KeyboardInterrupt):
        build.ensure_built(ext, log=lambda s: None, progress=False)
    assert build.build_status(ext)[0] == "not built"
    monkeypatch.setattr(build, "_load", slow_fake_load(calls, seconds=0.1))
    assert build.ensure_built(ext, log=lambda s: None, wait_s=2.0) is not None     # the flock was released
    assert len(calls) == 2


def test_broken_compiler_fails_once_and_sessions_fall_back_with_a_warning(fresh_state, monkeypatch, tiny_ckpt):
    if not cpu.available():
        pytest.skip(f"cpu kernels: {cpu.availability()[1]}")
    tries = fresh_state / "tries"
    cxx = fresh_state / "broken-cxx"
    cxx.write_text(f"#!/bin/sh\necho x >> {tries}\necho 'broken-cxx: error: no compiling today' >&2\nexit 1\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    cpu.availability.cache_clear()
    assert cpu.available()                                  # the static checks cannot tell
    logs = []
    with pytest.raises(build.KernelBuildError, match="CXX=.*broken-cxx failed") as first:
        cpu.ensure_built(log=logs.append, progress=False)
    n = len(tries.read_text().splitlines())
    assert n >= 1 and "no compiling today" in first.value.output
    with pytest.raises(build.KernelBuildError) as again:
        cpu.ensure_built(progress=False)
    assert again.value is first.value and len(tries.read_text().splitlines()) == n      # not retried
    assert cpu.extension().failure_log.exists()

    monkeypatch.setattr(cpu_choice, "native_bf16", lambda: (False, "stubbed: no native bf16"))
    assert devices.resolve_kernels("auto", "cpu") == "reference"
    with pytest.raises(DeviceError, match="kernels='cpu'"):
        devices.prepare_kernels("cpu", "cpu")
    monkeypatch.setattr(devices, "resolve_kernels", lambda name, dev: "cpu")     # as on a fresh process
    from qwen_npu import Session
    with pytest.warns(UserWarning, match=r"runs the reference set: building .* failed.*slower"):
        sess = Session.from_pretrained(tiny_ckpt, device="cpu", max_model_len=64)
    assert sess.config.kernels == "reference" and len(tries.read_text().splitlines()) == n

    from qwen_npu import env_report
    report = env_report().as_dict()
    assert report["cpu kernel build"].startswith("failed: building") and "tries again" in report["cpu kernel build"]
    build._failed.clear()                                   # a new process: the log on disk still tells
    assert env_report().as_dict()["cpu kernel build"].startswith("failed before: the last build failed: building")


@pytest.fixture
def real_extension(request):
    """The real cpu extension, built (or loaded) in the current TORCH_EXTENSIONS_DIR."""
    if not cpu.available():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the cpu kernels cannot be built: {cpu.availability()[1]}")
        pytest.skip(f"cpu kernels: {cpu.availability()[1]}")
    try:
        cpu.ensure_built(progress=False)
    except build.KernelBuildError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the cpu kernels did not build: {e}")
        pytest.skip(f"the cpu kernels did not build here: {e}")
    return cpu.extension()


def test_lock_left_by_a_killed_build_is_removed_with_a_message(real_extension):
    ext = real_extension
    holder = hold_flock(ext.folder, "with-torch-lock")      # a build in progress ...
    os.kill(holder.pid, signal.SIGKILL)                     # ... killed half way
    holder.wait()
    stale = ext.folder / build.TORCH_LOCK
    assert stale.exists()
    load = "from qwen_npu.kernels import cpu; cpu.ensure_built(progress=False); print('loaded')"
    try:
        done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=300,
                              check=False)
    finally:
        stale.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded"
    assert f"removing {stale}: left behind by a build that was killed half way" in done.stderr


@pytest.mark.parametrize("flags, probes, mkldnn, want", [
    ({"avx2", "avx512_bf16"}, {}, True, "native"),           # cpu set, products through oneDNN
    ({"avx2", "amx_bf16"}, {}, True, "native"),
    ({"avx2"}, {"_is_avx512_bf16_supported": True}, True, "native"),
    ({"avx2", "avx512_bf16"}, {}, False, "generic"),         # native bf16 that torch cannot use
    ({"avx2", "avx512f"}, {}, True, "generic"),
])
def test_auto_choice_follows_the_cpus_bf16_support(fresh_state, monkeypatch, flags, probes, mkldnn, want):
    monkeypatch.delenv(cpu_features.ISA_ENV, raising=False)     # the stubbed machine, uncapped
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        value = probes.get(name, False)
        monkeypatch.setattr(cpu_choice.torch.cpu, name, lambda v=value: v, raising=False)
    monkeypatch.setattr(cpu_choice.torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: mkldnn, raising=False)
    monkeypatch.setattr(cpu, "availability", lambda: (True, "AVX2 CPU, stubbed compiler"))
    chosen, why = cpu_choice.choose()
    assert chosen == "cpu"                                   # wherever the cpu set can be built
    assert devices.resolve_kernels("auto", "cpu") == "cpu"
    if want == "native":
        assert "native bf16" in why and "oneDNN on weights reordered" in why, why
    else:
        assert "generic bf16 path" in why, why
    monkeypatch.setattr(cpu, "availability", lambda: (False, "no C++ compiler: 'c++' is not on PATH"))
    chosen, why = cpu_choice.choose()
    assert chosen == "reference"
    assert "no C++ compiler" in why and "slower" in why
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert devices.prepare_kernels("auto", "cpu") == "reference"
    assert any("no C++ compiler" in str(w.message) for w in caught)


def test_build_kernels_command_builds_ahead_of_time_and_reports_failures(real_extension, tmp_path, monkeypatch,
                                                                          capsys):
    from qwen_npu.tools.cli import main
    library = real_extension.library                        # built, so the command only loads it
    assert main(["build-kernels", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "the CPU kernels are ready" in out and str(library) in out
    assert "kernels='auto' on this CPU runs the" in out
    assert "building the CPU kernels once" not in out                                # nothing to build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("CXX", "/bin/false")
    cpu.availability.cache_clear()
    try:
        assert main(["build-kernels", "--no-progress"]) == 1
    finally:
        cpu.availability.cache_clear()
    out = capsys.readouterr().out
    assert out.startswith("building the CPU kernels once for this machine")        # said before it started
    assert "qwen-npu build-kernels: building qwen_npu_cpu_" in out and "CXX=/bin/false failed" in out


@pytest.mark.parametrize("capability, warns", [("AVX2", True), ("DEFAULT", False)])
def test_auto_warns_about_the_reference_set_only_where_the_cpu_set_would_be_faster(fresh_state, monkeypatch,
                                                                                   capability, warns):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2"}))
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(cpu_choice.torch.cpu, name, lambda: False, raising=False)
    monkeypatch.setattr(cpu_choice.torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(cpu, "availability", lambda: (False, "stubbed: no C++ compiler"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert devices.prepare_kernels("auto", "cpu") == "reference"
    texts = [str(w.message) for w in caught]
    want = ("kernels='auto' runs the reference set: the cpu set cannot be built here (stubbed: no C++ "
            f"compiler); the reference set is {cpu_choice.SLOWER}")
    assert texts == ([want] if warns else [])
