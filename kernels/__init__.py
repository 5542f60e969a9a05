"""Kernels behind one contract (see README.md): write_kv, paged_attention, rms_norm,
add_rms_norm, rope. ``get_kernels(name)`` returns the module implementing them."""
from __future__ import annotations

import importlib
from types import ModuleType

from . import cpu_features  # noqa: F401  (applies QWEN_NPU_CPU_ISA before torch dispatches)
from .metadata import AttentionMetadata

KERNEL_SETS = ("reference", "npu", "cpu", "cuda")


def get_kernels(name: str = "reference") -> ModuleType:
    """The kernel module called ``name`` ("reference", "npu", "cpu" or "cuda")."""
    if name not in KERNEL_SETS:
        raise ValueError(f"unknown kernel set {name!r}; choose one of {', '.join(KERNEL_SETS)}")
    return importlib.import_module(f"{__name__}.{name}")


__all__ = ["KERNEL_SETS", "AttentionMetadata", "get_kernels"]
