"""Which device and which kernel set a Session runs on: npu, cuda or cpu.

This is the ONLY module that imports ``torch_npu``, and it does so lazily, inside
``_probe_torch_npu`` (cached), never at package import. Why so careful: ``torch-npu`` without the
Ascend CANN toolkit fails to import (``libhccl.so: cannot open shared object file``), and since
torch auto-loads it as a backend extension, even a plain ``import torch`` then fails. The probe
turns every such failure into a reason in words; ``resolve_device("npu")`` raises it as a
``DeviceError``, and ``resolve_device("auto")`` quietly moves on to cuda or cpu.

    spec        -> device            kernels "auto" -> set
    "auto"      -> npu:0 | cuda:0 | cpu               npu device -> "npu"
    "npu[:N]"   -> npu:N or DeviceError (with reason) cpu device -> "cpu" where it can be built
    "cuda[:N]"  -> cuda:N or DeviceError                            (AVX2 + a C++ compiler) and
    "cpu"       -> cpu                                              the CPU lacks native bf16
                                                  other      -> "reference"
                                                  "reference" is allowed everywhere
                                                  ("npu"/"cpu" kernels need that device)
"""
from __future__ import annotations

import functools
from types import ModuleType

CANN_FIX = ("install the Ascend CANN toolkit matching torch-npu (and source its set_env.sh), "
            "or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 before torch is imported")


def torch_import_hint(exc: BaseException) -> str:
    """The message for ``import torch`` failing, typically because torch-npu is installed but
    CANN is not (torch auto-loads torch_npu as a backend extension and that import fails)."""
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        text += f" (caused by {type(cause).__name__}: {cause})"
    return (f"import torch failed: {text}. If torch-npu is installed without the Ascend CANN "
            f"libraries (libhccl, libascendcl, ...), torch cannot load its backend extension. Fix: "
            f"{CANN_FIX}; or uninstall torch-npu to run on cuda/cpu only.")


try:
    import torch
except (ImportError, OSError, RuntimeError) as _exc:   # torch-npu without CANN breaks `import torch`
    raise ImportError(torch_import_hint(_exc)) from _exc

from .errors import DeviceError

KERNEL_CHOICES = ("auto", "reference", "npu", "cpu")


@functools.lru_cache(maxsize=1)
def _probe_torch_npu() -> tuple[ModuleType | None, int, str]:
    """Import torch_npu once: (module or None, visible NPU count, reason in words)."""
    try:
        import torch_npu  # registers torch.npu and the "npu" device type
    except ImportError as e:
        if getattr(e, "name", None) == "torch_npu":
            return None, 0, "torch_npu is not installed"
        return None, 0, f"torch_npu failed to import: {type(e).__name__}: {e} ({CANN_FIX})"
    except (OSError, RuntimeError) as e:
        return None, 0, f"torch_npu failed to import: {type(e).__name__}: {e} ({CANN_FIX})"
    npu = getattr(torch_npu, "npu", None) or getattr(torch, "npu", None)
    try:
        count = int(npu.device_count()) if npu is not None else 0
        available = count > 0 and bool(npu.is_available())
    except (AttributeError, OSError, RuntimeError) as e:
        return torch_npu, 0, f"no NPU visible (torch_npu imported, but the device query failed: {e})"
    if not available:
        return torch_npu, 0, ("no NPU visible (torch_npu imported; check the driver with npu-smi "
                              "and ASCEND_RT_VISIBLE_DEVICES)")
    return torch_npu, count, "npu:0 available" if count == 1 else f"npu:0..{count - 1} available"


def npu_status() -> tuple[bool, str]:
    """(an NPU is usable here?, the reason in words)."""
    _, count, reason = _probe_torch_npu()
    return count > 0, reason


def load_torch_npu() -> ModuleType:
    """The torch_npu module, imported through the guarded probe; DeviceError if it cannot load."""
    module, _, reason = _probe_torch_npu()
    if module is None:
        raise DeviceError(f"torch_npu is needed here but unavailable: {reason}")
    return module


def _split(spec: str) -> tuple[str, int | None]:
    kind, _, index = spec.strip().lower().partition(":")
    if index and not index.isdigit():
        raise DeviceError(f"device {spec!r}: the index after ':' must be a number, e.g. 'npu:0'")
    return kind, int(index) if index else None


def device_type(device: torch.device | str) -> str:
    """"npu", "cuda", "cpu", ... for a torch.device or its string (works before torch_npu loads)."""
    if isinstance(device, torch.device):
        return device.type
    return _split(str(device))[0]


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """The torch.device for ``spec`` ("auto", "npu[:N]", "cuda[:N]", "cpu"), or DeviceError."""
    kind, index = (spec.type, spec.index) if isinstance(spec, torch.device) else _split(spec)
    if kind == "auto":
        if npu_status()[0]:
            return torch.device("npu", 0)
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "npu":
        _, count, reason = _probe_torch_npu()
        if count == 0:
            raise DeviceError(f"device {str(spec)!r} requested, but {reason}. "
                              f"Use device='auto' or 'cpu' to run without an NPU.")
        if index is not None and index >= count:
            raise DeviceError(f"device {str(spec)!r} requested, but only {count} NPU(s) are visible")
        return torch.device("npu", index or 0)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {str(spec)!r} requested, but torch.cuda.is_available() is False "
                              f"(torch {torch.__version__}). Use device='auto' or 'cpu'.")
        count = torch.cuda.device_count()
        if index is not None and index >= count:
            raise DeviceError(f"device {str(spec)!r} requested, but only {count} CUDA device(s) are visible")
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)
    raise DeviceError(f"unknown device {str(spec)!r}; choose 'auto', 'npu[:N]', 'cuda[:N]' or 'cpu'")


def default_block_size(device: torch.device | str) -> int:
    """KV block size: 128 on npu (the fused ops want multiples of 16, best 128..512), 16 elsewhere."""
    return 128 if device_type(device) == "npu" else 16


def resolve_kernels(name: str, device: torch.device | str) -> str:
    """The kernel set for ``name`` on ``device``: "auto" -> "npu" on an npu device; on a cpu device
    "cpu" or "reference" by what the CPU can do (``kernels/cpu_choice.py``); else "reference".
    "reference" runs anywhere (on an NPU too, to bisect a kernel bug). Compiles nothing."""
    kind = device_type(device)
    if name == "auto":
        if kind == "cpu":
            return cpu_kernels_choice()[0]
        return "npu" if kind == "npu" else "reference"
    if name == "cpu":
        ok, reason = _cpu_kernels_status()
        if kind != "cpu" or not ok:
            why = f"the device is {str(device)!r}" if kind != "cpu" else reason
            raise DeviceError(f"kernels='cpu' needs a cpu device with AVX2 and a C++ compiler, but {why}; "
                              f"use kernels='reference' (or 'auto')")
        return "cpu"
    if name == "reference":
        return "reference"
    if name == "npu":
        if kind != "npu":
            raise DeviceError(f"kernels='npu' needs an npu device, but the device is {str(device)!r}; "
                              f"use kernels='reference' (or 'auto'), or device='npu'")
        return "npu"
    raise DeviceError(f"unknown kernel set {name!r}; choose one of {', '.join(KERNEL_CHOICES)}")


def prepare_kernels(name: str, device: torch.device | str) -> str:
    """``resolve_kernels``, then make the set ready: the cpu set is built (or loaded) now, so no
    step ever waits for it. Where "auto" cannot have the cpu set on a CPU that would gain from it
    (no compiler, a failed build), it warns with the reason and runs the reference set;
    an explicit ``kernels="cpu"`` that cannot build is a ``DeviceError``."""
    import warnings
    chosen = resolve_kernels(name, device)
    if device_type(device) != "cpu":
        return chosen
    from .kernels import build, cpu, cpu_choice  # lazy: kernels sit above device in the layering
    if chosen == "reference":
        if name == "auto" and cpu_choice.would_gain():
            warnings.warn(f"kernels='auto' runs the reference set: {cpu_kernels_choice()[1]}", stacklevel=4)
        return chosen
    try:
        cpu.ensure_built()
    except build.KernelBuildError as e:
        if name == "cpu":
            raise DeviceError(f"kernels='cpu': {e}; use kernels='reference' (or 'auto')") from e
        warnings.warn(f"kernels='auto' runs the reference set: {e}. It is {cpu_choice.SLOWER}; "
                      f"`qwen-npu env` shows the error, `qwen-npu build-kernels` tries again", stacklevel=4)
        return "reference"
    return chosen


def cpu_kernels_choice() -> tuple[str, str]:
    """("cpu" | "reference", why) for kernels="auto" on this machine's CPU."""
    from .kernels import cpu_choice
    return cpu_choice.choose()


def _cpu_kernels_status() -> tuple[bool, str]:
    from .kernels import build, cpu
    ok, reason = cpu.availability()
    if ok:
        state, detail = build.build_status(cpu.extension())
        if state == "failed":
            return False, detail
    return ok, reason


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a named host-sync boundary: timings, benchmarks)."""
    kind = device_type(device)
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "npu":
        load_torch_npu().npu.synchronize(device)


def free_memory(device: torch.device | str) -> int:
    """Free bytes on an accelerator (cuda or npu)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "npu":
        load_torch_npu()
        return torch.npu.mem_get_info(device)[0]
    raise ValueError(f"free_memory: {device} is not an accelerator")
