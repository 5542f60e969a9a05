"""Which device and which kernel set a Session runs on: npu, cuda or cpu.

``torch_npu`` is loaded only through ``qwen_npu.device.npu_runtime`` (its guarded probe), which turns
every failure to load it into a reason in words; ``resolve_device("npu")`` raises it as a
``DeviceError``, and ``resolve_device("auto")`` quietly moves on to cuda or cpu.

    spec        -> device            kernels "auto" -> set
    "auto"      -> npu:0 | cuda:0 | cpu               npu device  -> "npu"
    "npu[:N]"   -> npu:N or DeviceError (with reason) cuda device -> "cuda"
    "cuda[:N]"  -> cuda:N or DeviceError              cpu device  -> "cpu" where it can be built
    "cpu"       -> cpu                                              (AVX2 + a C++ compiler) and
                                                                    the CPU lacks native bf16
                                                  other       -> "reference"
                                                  "reference" and "cuda" (pure torch) are
                                                  allowed everywhere
                                                  ("npu"/"cpu" kernels need that device)
"""
from __future__ import annotations

# first: npu_runtime guards ``import torch`` (torch-npu without CANN breaks it) with a clear message
from .npu_runtime import (CANN_FIX, _probe_torch_npu, installed_op_support,  # noqa: F401  isort: skip
                          load_torch_npu, npu_status, torch_import_hint)
import torch  # isort: skip

from ..errors import DeviceError, warn

KERNEL_CHOICES = ("auto", "reference", "npu", "cpu", "cuda")


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
    """The kernel set for ``name`` on ``device``: "auto" -> "npu" on an npu device, "cuda" on a cuda
    device; on a cpu device "cpu" or "reference" by what the CPU can do (``kernels/cpu_choice.py``);
    else "reference". "reference" runs anywhere (on an NPU too, to bisect a kernel bug), and so
    does "cuda" (pure torch; its tests run on the CPU). Compiles nothing."""
    kind = device_type(device)
    if name == "auto":
        if kind == "cpu":
            return cpu_kernels_choice()[0]
        return {"npu": "npu", "cuda": "cuda"}.get(kind, "reference")
    if name == "cpu":
        ok, reason = _cpu_kernels_status()
        if kind != "cpu" or not ok:
            why = f"the device is {str(device)!r}" if kind != "cpu" else reason
            raise DeviceError(f"kernels='cpu' needs a cpu device with AVX2 and a C++ compiler, but {why}; "
                              f"use kernels='reference' (or 'auto')")
        return "cpu"
    if name in ("reference", "cuda"):
        return name
    if name == "npu":
        if kind != npu_kernels_device_type():
            raise DeviceError(f"kernels='npu' needs an npu device, but the device is {str(device)!r}; "
                              f"use kernels='reference' (or 'auto'), or device='npu'")
        return "npu"
    raise DeviceError(f"unknown kernel set {name!r}; choose one of {', '.join(KERNEL_CHOICES)}")


def prepare_kernels(name: str, device: torch.device | str) -> str:
    """``resolve_kernels``, then make the set ready: the cpu set is built (or loaded) now, so no
    step ever waits for it. Where "auto" cannot have the cpu set on a CPU that would gain from it
    (no compiler, a failed build), it warns with the reason and runs the reference set;
    an explicit ``kernels="cpu"`` that cannot build is a ``DeviceError``."""
    chosen = resolve_kernels(name, device)
    if chosen == "cuda":                        # pure torch: nothing to build, any device
        return chosen
    if device_type(device) != "cpu" or chosen == "npu":
        return chosen
    from ..kernels import build, cpu, cpu_choice  # lazy: the cpu set is imported only for a cpu device
    if chosen == "reference":
        if name == "auto" and cpu_choice.would_gain():
            warn(f"kernels='auto' runs the reference set: {cpu_kernels_choice()[1]}")
        return chosen
    try:
        cpu.ensure_built()
    except build.KernelBuildError as e:
        if name == "cpu":
            raise DeviceError(f"kernels='cpu': {e}; use kernels='reference' (or 'auto')") from e
        warn(f"kernels='auto' runs the reference set: {e}. It is {cpu_choice.SLOWER}; "
             f"`qwen-npu env` shows the error, `qwen-npu build-kernels` tries again")
        return "reference"
    return chosen


def npu_kernels_device_type() -> str:
    """The device type the npu kernel set runs its fused ops on: ``kernels.npu.DEVICE_TYPE``,
    "npu". The CPU stand-in tests point it at "cpu" (with a stand-in for torch_npu), which is
    how a whole Session runs the npu set's code path without a card."""
    from ..kernels import npu  # lazy: imports no torch_npu
    return npu.DEVICE_TYPE


def cpu_kernels_choice() -> tuple[str, str]:
    """("cpu" | "reference", why) for kernels="auto" on this machine's CPU."""
    from ..kernels import cpu_choice
    return cpu_choice.choose()


def _cpu_kernels_status() -> tuple[bool, str]:
    from ..kernels import build, cpu
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


def device_count(kind: str) -> int:
    """How many devices of ``kind`` ("cuda", "npu") this process sees; 1 for "cpu"."""
    if kind == "cuda":
        return torch.cuda.device_count()
    if kind == "npu":
        return load_torch_npu().npu.device_count()
    return 1


def free_memory(device: torch.device | str) -> int:
    """Free bytes on an accelerator (cuda or npu)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "npu":
        load_torch_npu()
        return torch.npu.mem_get_info(device)[0]
    raise ValueError(f"free_memory: {device} is not an accelerator")
