"""The guarded loader of ``torch_npu``: the ONLY place the package imports it.

It is imported lazily, inside ``_probe_torch_npu`` (cached), never at package import. Why so
careful: ``torch-npu`` without the Ascend CANN toolkit fails to import (``libhccl.so: cannot open
shared object file``), and since torch auto-loads it as a backend extension, even a plain
``import torch`` then fails. The probe turns every such failure into a reason in words.
``qwen_npu.device`` (device choice) and ``qwen_npu.kernels.npu`` (the kernels) both load it here.
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

from ..errors import DeviceError


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
