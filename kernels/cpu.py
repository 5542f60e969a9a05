"""CPU kernels for x86-64 with AVX2 + FMA: the reference contract (README.md), faster.

On a CPU without native bf16 instructions, torch's bf16 matrix products take a slow generic
path (well under 10 GFLOP/s on two cores). This set keeps bf16 storage (weights and KV cache)
but does all arithmetic in fp32:

    function         how                                              vs reference
    linear           few rows (decode, LM head): C++ kernel that       fp32 accumulation instead
                       reads each bf16 weight row once and widens it    of bf16 products
                       in registers; many rows (prefill chunks): the
                       weights widened to fp32 and multiplied by MKL
    paged_attention  C++: each token reads only its own visible       fp32 scores and softmax
                       context through the block table (no gather,
                       no padding to the longest row), fp32 softmax
    write_kv         C++: one copy per token, negative slots skipped  identical
    rms_norm, add_rms_norm, rope                                       the reference functions

float32 models use torch's float32 matrix products for ``linear`` (already fast) and the C++
attention. Tolerances against the reference (tests/kernels/test_cpu.py): float32 atol = rtol
= 1e-5; bfloat16 atol = rtol = 2e-2.

The C++ source (``cpu_ops.cpp``) is compiled on first use with ``torch.utils.cpp_extension``
(a C++ compiler and ninja are needed; the build is cached under ``TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``). ``available()`` says whether this machine can use the set;
``kernels="auto"`` picks it on such a CPU and the reference set elsewhere.
"""
from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from . import reference
from .metadata import AttentionMetadata

NAME = "cpu"
SOURCE = Path(__file__).with_name("cpu_ops.cpp")
# From this many x rows on, the weights are re-laid out in panels (see cpu_ops.cpp) ...
PANEL_ROWS = 4
# ... and past this many, the weights are widened to fp32 for MKL's matrix product instead.
MAX_KERNEL_ROWS = 32

rms_norm = reference.rms_norm
add_rms_norm = reference.add_rms_norm
rope = reference.rope


@functools.lru_cache(maxsize=1)
def availability() -> tuple[bool, str]:
    """(usable here?, the reason in words). Does not compile anything."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return False, f"the CPU's vector capability is {cap}; these kernels need AVX2 + FMA"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return False, "no C++ compiler (c++ or g++) on PATH to build the kernels"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401
        except ImportError:
            return False, "ninja is not installed (pip install ninja) to build the kernels"
    return True, f"{cap} CPU with a C++ compiler"


def available() -> bool:
    return availability()[0]


@functools.lru_cache(maxsize=1)
def ops():
    """The compiled extension (built on the first call, then loaded from the build cache)."""
    ok, reason = availability()
    if not ok:
        raise RuntimeError(f"the cpu kernel set cannot run here: {reason}")
    from torch.utils import cpp_extension
    return cpp_extension.load(name="qwen_npu_cpu_ops", sources=[str(SOURCE)],
                              extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c"], verbose=False)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T -> [..., N] in x's dtype, accumulated in fp32."""
    if weight.dtype == torch.float32 or x.device.type != "cpu":
        return F.linear(x, weight)
    rows = x.numel() // x.shape[-1]
    if rows > MAX_KERNEL_ROWS:
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return ops().linear(x, weight, PANEL_ROWS, 256, 0)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """As ``reference.write_kv``: scatter by slot, negative slots never written."""
    ops().write_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """As ``reference.paged_attention`` (decode and prefill), computed in fp32."""
    return ops().paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, float(scale))
