"""What this CPU can do for bf16: its feature flags and whether torch multiplies bf16 natively.

Read from torch's own probes (``torch.cpu._is_avx512_bf16_supported``,
``torch.cpu._is_amx_tile_supported``, whether oneDNN bf16 is usable) and, where those are missing,
the ``flags`` line of ``/proc/cpuinfo``. One answer for both the kernel choice
(``cpu_choice.py``) and the cpu set's product routing (``cpu.py``).

``QWEN_NPU_CPU_ISA=avx2`` (read here and nowhere else) makes an AVX-512 machine answer as an
AVX2-only one would: the flags lose every ``avx512*`` and ``amx*`` entry, torch's probes are not
asked, so the cpu set never runs its AVX512-BF16 kernel nor hands products to oneDNN's bf16 path;
and torch's own kernels are capped at AVX2 too (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
``MKL_ENABLE_INSTRUCTIONS``, set when this module is imported unless already set). torch reads
those when it first dispatches, so set the variable before the process starts;
``isa_cap_in_force()`` says whether it took. MKL may still pick other AVX2 code on another
vendor's CPU, so the cap reproduces an AVX2 machine's kernel paths, not every last bit of its
rounding.
"""
from __future__ import annotations

import functools
import os

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ISA_ENV = "QWEN_NPU_CPU_ISA"
ISA_CHOICES = ("native", "avx2")
# torch's own switches for the same cap, as each library spells it
TORCH_ISA_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                  "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def isa_cap() -> str | None:
    """"avx2" when ``QWEN_NPU_CPU_ISA=avx2`` caps this process at AVX2, else None ("native" or unset)."""
    raw = os.environ.get(ISA_ENV, "").strip().lower()
    if raw in ("", "native"):
        return None
    if raw not in ISA_CHOICES:
        raise ValueError(f"{ISA_ENV}={os.environ[ISA_ENV]!r}: expected one of {', '.join(ISA_CHOICES)}")
    return raw


def apply_isa_cap() -> None:
    """Pass the cap on to torch's libraries (and to child processes, such as notebook kernels)."""
    if isa_cap() == "avx2":
        for name, value in TORCH_ISA_CAPS.items():
            os.environ.setdefault(name, value)


def isa_cap_in_force() -> tuple[bool, str]:
    """(does the process run as the cap asks?, in words) — torch's capability is fixed at its first
    dispatch, so a cap set after that is reported here instead of silently ignored."""
    cap = isa_cap()
    got = torch.backends.cpu.get_cpu_capability()
    if cap is None:
        return True, f"native ({got})"
    if got in ("AVX512", "AMX"):
        return False, (f"{ISA_ENV}={cap} but torch already runs {got} kernels: set it before the process "
                       f"starts")
    return True, f"capped at {cap} ({ISA_ENV}); torch runs {got} kernels"


@functools.lru_cache(maxsize=1)
def native_bf16() -> tuple[bool, str]:
    """(does the CPU compute bf16 products natively, through torch's oneDNN path?, the evidence)."""
    found = [flag for flag in NATIVE_BF16_FLAGS if flag in cpu_flags()]
    if isa_cap() is None:
        probes = (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx_bf16", "_is_amx_tile_supported"))
        for flag, probe in probes:
            fn = getattr(torch.cpu, probe, None)
            if fn is not None and flag not in found and _safe(fn):
                found.append(flag)
    if not found:
        capped = f", {ISA_ENV}={isa_cap()}" if isa_cap() else ""
        return False, f"no native bf16 instructions (avx512_bf16, amx_bf16{capped})"
    if not (torch.backends.mkldnn.is_available() and _safe(torch.ops.mkldnn._is_mkldnn_bf16_supported)):
        return False, f"the CPU has {', '.join(found)} but torch's oneDNN bf16 path is unavailable"
    return True, f"native bf16 ({', '.join(found)}) through torch's oneDNN"


def avx512_bf16() -> bool:
    """Does the CPU have the AVX512-BF16 dot-product instructions (and no cap hides them)?"""
    if isa_cap() is not None:
        return False
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return _safe(probe) if probe is not None else "avx512_bf16" in cpu_flags()


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none), less the AVX-512
    and AMX ones under ``QWEN_NPU_CPU_ISA=avx2``."""
    flags: frozenset[str] = frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = frozenset(line.partition(":")[2].split())
                    break
    except OSError:
        pass
    if isa_cap() == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
    return flags


def _safe(fn) -> bool:
    try:
        return bool(fn())
    except (RuntimeError, AttributeError):
        return False


apply_isa_cap()
