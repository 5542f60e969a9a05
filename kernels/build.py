"""Building a C++ kernel extension once per machine: visibly, and never waiting for ever.

    ensure_built(ext)   the loaded extension module; compiles it first when the cache has none
    build_status(ext)   "loaded" | "cached" | "not built" | "failed" | "failed before", and details

What it adds to ``torch.utils.cpp_extension.load``:

- **Said out loud.** Before compiling it prints what it is doing, where the result is cached and
  about how long it takes (``MESSAGE``), shows a bar (``tqdm.auto``: text in a terminal, a widget
  in a notebook) that counts the compiled objects and ticks every half second, and reports the
  time taken. Loading an already built extension prints nothing.
- **A lock the OS releases.** torch serialises builds with a ``lock`` file that it waits on with
  no bound, so a build killed half way (kernel restart, Ctrl-C, SIGKILL) leaves every later build
  waiting for ever. Here builds are serialised with ``fcntl.flock`` on ``<folder>.flock``, which
  the operating system releases when its holder dies. Holding it proves that a ``lock`` file in
  the folder is left over from a killed build: it is removed, with a message naming it. Another
  process's build is waited for at most ``WAIT_S`` seconds, saying so.
- **A failure is final for the process.** A build that fails raises ``KernelBuildError`` with the
  compiler's output, once; later calls raise the same error at once instead of compiling again.
  The output is also written to ``<folder>.failed.log`` (``qwen-npu env`` shows it) and removed by
  the next successful build. ``forget_failures()`` lets a process try again.
- **One build per process.** Threads asking at once wait for the first one's build.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

MESSAGE = "building the CPU kernels once for this machine, about a minute or two; cached in {folder}"
WAIT_S = 900.0          # the longest wait for another process's (or thread's) build
POLL_S = 0.5            # progress bar tick and lock poll interval
TORCH_LOCK = "lock"     # the file torch's builder creates in the build folder while building


class KernelBuildError(RuntimeError):
    """The extension could not be built or loaded. ``output`` holds the compiler's output."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


@dataclasses.dataclass(frozen=True)
class Extension:
    """What to build: ``name`` must change whenever the sources or flags do (a hash in it)."""

    name: str
    sources: tuple[str, ...]
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    include_paths: tuple[str, ...] = ()

    @property
    def folder(self) -> Path:
        """``$TORCH_EXTENSIONS_DIR/<name>`` (torch's default root when the variable is unset)."""
        root = os.environ.get("TORCH_EXTENSIONS_DIR")
        if not root:
            from torch.utils.cpp_extension import get_default_build_root
            root = get_default_build_root()
        return Path(root) / self.name

    @property
    def library(self) -> Path:
        return self.folder / f"{self.name}.so"

    @property
    def failure_log(self) -> Path:
        return self.folder.with_name(self.name + ".failed.log")


_thread_lock = threading.Lock()
_loaded: dict[Path, ModuleType] = {}
_failed: dict[Path, KernelBuildError] = {}


def ensure_built(ext: Extension, *, log=None, progress: bool = True, wait_s: float = WAIT_S) -> ModuleType:
    """The extension's module, built first if needed (see the module docstring)."""
    key = ext.folder
    module = _loaded.get(key)
    if module is not None:
        return module
    if key in _failed:
        raise _failed[key]
    log = log or _stderr
    if not _thread_lock.acquire(timeout=wait_s):
        raise KernelBuildError(f"another thread of this process has been building {ext.name} for over "
                               f"{wait_s:.0f} s; giving up waiting")
    try:
        if key in _loaded:
            return _loaded[key]
        if key in _failed:
            raise _failed[key]
        try:
            module = _build_locked(ext, log, progress, wait_s)
        except KernelBuildError as e:
            _failed[key] = e
            _write_failure(ext, e)
            raise
        _loaded[key] = module
        return module
    finally:
        _thread_lock.release()


def build_status(ext: Extension) -> tuple[str, str]:
    """(state, detail): "loaded" (in this process), "failed" (in this process: final until
    ``forget_failures()``), "failed before" (the last build on this machine, another process; the
    next Session tries again), "cached" (built, not loaded yet) or "not built"; detail names the
    folder or the error."""
    key = ext.folder
    if key in _loaded:
        return "loaded", str(key)
    if key in _failed:
        return "failed", str(_failed[key])
    if ext.failure_log.exists():
        first = ext.failure_log.read_text(errors="replace").splitlines()[:1]
        return "failed before", f"the last build failed: {first[0] if first else '?'} (log: {ext.failure_log})"
    if ext.library.exists():
        return "cached", str(ext.library)
    return "not built", f"will build into {key}"


def forget_failures() -> None:
    """Let this process try failed builds again (after fixing the compiler, say)."""
    _failed.clear()


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _build_locked(ext: Extension, log, progress: bool, wait_s: float) -> ModuleType:
    folder = ext.folder
    folder.mkdir(parents=True, exist_ok=True)
    with _process_lock(folder.with_name(ext.name + ".flock"), log, wait_s):
        stale = folder / TORCH_LOCK
        if stale.exists():
            log(f"removing {stale}: left behind by a build that was killed half way")
            stale.unlink(missing_ok=True)
        if ext.library.exists():
            try:
                return _load(ext)               # ninja finds nothing to do
            except KernelBuildError:
                log(f"the cached build in {folder} does not load; building it again")
                ext.library.unlink(missing_ok=True)
        log(MESSAGE.format(folder=folder))
        t0 = time.perf_counter()
        with _progress_bar(ext, progress):
            module = _load(ext)
        log(f"built the CPU kernels in {time.perf_counter() - t0:.1f} s")
        ext.failure_log.unlink(missing_ok=True)
        return module


def ninja_path() -> str | None:
    """The ninja torch's builder will run: on PATH, else the one of the ``ninja`` package."""
    found = shutil.which("ninja")
    if found is None:
        try:
            import ninja
        except ImportError:
            return None
        found = shutil.which("ninja", path=getattr(ninja, "BIN_DIR", ""))
    return found


def _load(ext: Extension) -> ModuleType:
    from torch.utils import cpp_extension
    ninja = ninja_path()
    if ninja is not None and shutil.which("ninja") is None:    # torch runs plain "ninja"
        os.environ["PATH"] = os.pathsep.join([str(Path(ninja).parent), os.environ.get("PATH", "")])
    # the name already carries a hash of the sources; torch's own versioning would rename a second
    # build in this process (another TORCH_EXTENSIONS_DIR) to <name>_v1
    getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", {}).pop(ext.name, None)
    try:
        return cpp_extension.load(name=ext.name, sources=list(ext.sources), extra_cflags=list(ext.cflags),
                                  extra_ldflags=list(ext.ldflags), extra_include_paths=list(ext.include_paths),
                                  build_directory=str(ext.folder), verbose=False)
    except Exception as e:      # any failure (compiler, linker, loader) is a failed build
        text = str(e) or type(e).__name__
        output = text.partition(": ")[2] or getattr(e, "output", b"") or ""
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
        cxx = os.environ.get("CXX", "c++")
        raise KernelBuildError(f"building {ext.name} with CXX={cxx} failed: {_summary(text)}",
                               output or text) from e


def _summary(text: str) -> str:
    """The compiler's first error line (or the last line) of a build's output."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() and not ln.startswith("[")]
    return (errors or lines or ["no output"])[0][:400]


def _write_failure(ext: Extension, e: KernelBuildError) -> None:
    with contextlib.suppress(OSError):
        ext.failure_log.parent.mkdir(parents=True, exist_ok=True)
        ext.failure_log.write_text(f"{e}\n\n{e.output}\n")


@contextlib.contextmanager
def _process_lock(path: Path, log, wait_s: float):
    """``fcntl.flock`` on ``path``: released by the OS when this process dies, waited for at most
    ``wait_s`` seconds."""
    import fcntl
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    log(f"waiting for another process building the CPU kernels ({_holder(fd)} holds "
                        f"{path}); waiting up to {wait_s:.0f} s")
                    told = True
                if time.monotonic() >= deadline:
                    raise KernelBuildError(f"another process ({_holder(fd)}) held {path} for over {wait_s:.0f} s; "
                                           f"gave up waiting for its build") from None
                time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.01)))
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return f"pid {text}" if text.isdigit() else "a process"


@contextlib.contextmanager
def _progress_bar(ext: Extension, enabled: bool):
    """A bar over the build's steps (one object per source, then the link), ticking while it runs."""
    if not enabled:
        yield
        return
    from tqdm.auto import tqdm
    start = time.time()
    stems = [Path(s).stem for s in ext.sources]
    outputs = [ext.folder / f"{s}.o" for s in stems] + [ext.library]
    bar = tqdm(total=len(outputs), desc="building CPU kernels", unit="step", leave=True,
               bar_format="{desc}: {n}/{total} steps |{bar}| {elapsed}")
    done = threading.Event()

    def tick():
        while not done.wait(POLL_S):
            n = sum(1 for p in outputs if _written_since(p, start))
            if n > bar.n:
                bar.update(n - bar.n)
            else:
                bar.refresh()

    thread = threading.Thread(target=tick, name="kernel-build-progress", daemon=True)
    thread.start()
    try:
        yield
        bar.update(bar.total - bar.n)
    finally:
        done.set()
        thread.join(timeout=2 * POLL_S)
        bar.close()


def _written_since(path: Path, start: float) -> bool:
    try:
        return path.stat().st_mtime >= start - 1
    except OSError:
        return False
