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


# the ops the npu kernel set calls: torch_npu's custom (aclnn) ops, and the ATB op it can decode with
CUSTOM_OPS = ("npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score", "npu_rms_norm",
              "npu_add_rms_norm", "npu_apply_rotary_pos_emb")
ATB_OPS = ("_npu_paged_attention",)


def op_support(module: ModuleType) -> dict[str, str | None]:
    """{op: None where the installed stack can run it, else why not} for the kernel set's ops.

    A custom op is there when ``module`` (torch_npu) exports it. An ATB op is there only when
    torch_npu's ATB library loaded, which needs the NNAL package (``libatb``): then the op is
    registered as ``torch.ops.atb.<op>`` (``torch_npu.<op>`` exists either way, as a wrapper that
    raises when called without NNAL). Nothing is run on the device."""
    version = getattr(module, "__version__", "?")
    out: dict[str, str | None] = {
        op: None if callable(getattr(module, op, None)) else f"torch_npu {version} has no {op}"
        for op in CUSTOM_OPS}
    for op in ATB_OPS:
        out[op] = None if _atb_registered(op) else (
            f"torch.ops.atb.{op} is not registered (torch_npu's ATB library did not load: install "
            f"the NNAL package matching CANN and source its set_env.sh)")
    return out


def _atb_registered(op: str) -> bool:
    try:
        getattr(torch.ops.atb, op)
    except (AttributeError, RuntimeError):
        return False
    return True


@functools.lru_cache(maxsize=1)
def installed_op_support() -> dict[str, str | None]:
    """``op_support`` of the torch_npu this process loads (probed once); {} without torch_npu."""
    module, _, _ = _probe_torch_npu()
    return {} if module is None else op_support(module)


def load_torch_npu() -> ModuleType:
    """The torch_npu module, imported through the guarded probe; DeviceError if it cannot load."""
    module, _, reason = _probe_torch_npu()
    if module is None:
        raise DeviceError(f"torch_npu is needed here but unavailable: {reason}")
    return module
