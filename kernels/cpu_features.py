"""What this CPU can do for bf16: its feature flags and whether torch multiplies bf16 natively.

Read from torch's own probes (``torch.cpu._is_avx512_bf16_supported``,
``torch.cpu._is_amx_tile_supported``, whether oneDNN bf16 is usable) and, where those are missing,
the ``flags`` line of ``/proc/cpuinfo``. One answer for both the kernel choice
(``cpu_choice.py``) and the cpu set's product routing (``cpu.py``).
"""
from __future__ import annotations

import functools

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def native_bf16() -> tuple[bool, str]:
    """(does the CPU compute bf16 products natively, through torch's oneDNN path?, the evidence)."""
    found = [flag for flag in NATIVE_BF16_FLAGS if flag in cpu_flags()]
    for flag, probe in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx_bf16", "_is_amx_tile_supported")):
        fn = getattr(torch.cpu, probe, None)
        if fn is not None and flag not in found and _safe(fn):
            found.append(flag)
    if not found:
        return False, "no native bf16 instructions (avx512_bf16, amx_bf16)"
    if not (torch.backends.mkldnn.is_available() and _safe(torch.ops.mkldnn._is_mkldnn_bf16_supported)):
        return False, f"the CPU has {', '.join(found)} but torch's oneDNN bf16 path is unavailable"
    return True, f"native bf16 ({', '.join(found)}) through torch's oneDNN"


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _safe(fn) -> bool:
    try:
        return bool(fn())
    except (RuntimeError, AttributeError):
        return False
