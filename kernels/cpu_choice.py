"""Which kernel set ``kernels="auto"`` runs on a CPU, and why, from what the CPU can do.

    AVX2 + FMA, the cpu set can be built  -> "cpu"
        without native bf16: torch's bf16 products take a slow generic path; the cpu set does
        fp32 arithmetic on bf16 storage, 4-12x faster there
        with native bf16 (AVX512-BF16 or AMX): the cpu set runs every product of a bf16 model
        through oneDNN on weights reordered once at load (kernels/onednn.py) and attention,
        norms, RoPE and KV writes in its own kernels, faster than the reference set at every
        step shape measured (docs/benchmarks.md)
    otherwise                             -> "reference", with the reason the cpu set cannot run

``choose()`` returns (set, reason); ``qwen-npu env`` prints both. What the CPU can do is read in
``kernels/cpu_features.py``.
"""
from __future__ import annotations

import torch

from .cpu_features import native_bf16

SLOWER = "slower than the cpu set (4-12x on CPUs without native bf16, 1.5-2.5x with it)"


def choose() -> tuple[str, str]:
    """("cpu" or "reference", why) for ``kernels="auto"`` on a cpu device."""
    from . import build, cpu
    native, evidence = native_bf16()
    ok, reason = cpu.availability()
    if not ok:
        return "reference", f"the cpu set cannot be built here ({reason}); the reference set is {SLOWER}"
    state, detail = build.build_status(cpu.extension())
    if state == "failed":
        return "reference", f"building the cpu set failed: {detail}; the reference set is {SLOWER}"
    if native:
        return "cpu", (f"{evidence}; {reason}: the cpu set runs the products through oneDNN on weights "
                       f"reordered once at load and the rest (attention, norms, KV writes) in its own "
                       f"kernels, faster than the reference set at every step shape measured")
    return "cpu", f"{evidence}; {reason}: the cpu set's fp32 arithmetic beats torch's generic bf16 path"


def would_gain() -> bool:
    """Would this CPU run the cpu set faster than the reference set (AVX2 or AVX-512, with or
    without native bf16)?"""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
