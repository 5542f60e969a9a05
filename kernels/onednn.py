"""Weights reordered once for oneDNN's bf16 product: how the cpu set multiplies on a CPU with
native bf16 instructions (AVX512-BF16 or AMX).

torch's bf16 ``F.linear`` hands plain [N, K] weights to oneDNN, which rearranges them into its
blocked layout inside every call. Reordered once at load (``prepare_weight``), the same product
skips that work: the weight becomes an opaque ``torch._mkldnn`` tensor (``weight.is_mkldnn``)
that only oneDNN's product reads, and ``weight.to_dense()`` gives the plain matrix back, bit for
bit. The products are bit-identical to ``F.linear`` on the plain weight (bf16 products, fp32 sums,
one rounding to bf16), at every number of rows; docs/benchmarks.md has the measurements that made
this the cpu set's bf16 product at every step shape on such CPUs. The reordered weights live
in memory torch allocates; ``prepare_weight`` asks Linux to back it with huge pages.

Contract:
  - ``prepare_weight(w)`` returns ``w`` unchanged unless it is a 2-D bf16 CPU tensor and the CPU
    multiplies bf16 natively (``cpu_features.native_bf16``, which ``QWEN_NPU_CPU_ISA`` caps);
  - ``linear(x, w)`` takes a prepared ``w`` and any x [..., K] (bf16, on the CPU) -> [..., N];
    every row of the result is the one ``F.linear`` gives that row among at least ``MIN_ROWS``
    (fewer rows are padded with zero rows);
  - ``qwen_npu.model.qwen3.dense_weight(w)`` is the plain matrix of a prepared or plain weight.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

from . import cpu_features

log = logging.getLogger(__name__)

# The row count oneDNN is told to expect when it picks the blocked layout (a hint: the layout
# serves every row count, decode and prefill alike).
REORDER_ROWS = 16
HUGE_PAGE = 2 << 20                 # bytes of one transparent huge page on x86-64
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25     # Linux madvise advice values (MADV_COLLAPSE: Linux 6.1)
# Fewer x rows than this are padded with zero rows up to it: oneDNN's product takes a slower path
# for one or two rows than for four on a reordered weight (docs/benchmarks.md).
MIN_ROWS = 4


def prepares(dtype: torch.dtype) -> bool:
    """Does ``prepare_weight`` reorder weights of ``dtype`` on this CPU?"""
    return dtype == torch.bfloat16 and cpu_features.native_bf16()[0]


def prepare_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] in the form ``linear`` multiplies fastest here (see the contract above)."""
    if weight.is_mkldnn or weight.dim() != 2 or not weight.is_cpu or not prepares(weight.dtype):
        return weight
    prepared = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), REORDER_ROWS)
    collapse_to_huge_pages(torch.ops.mkldnn.data_ptr(prepared), prepared.nbytes)
    return prepared


def collapse_to_huge_pages(address: int, nbytes: int) -> bool:
    """Back the whole 2 MiB pages inside [address, address + nbytes) with transparent huge pages
    now (``MADV_COLLAPSE``), as the weight arena does for plain weights: a decode step streams
    every weight, and in 4 KiB pages that stream stalls on page walks. False (and nothing
    changed) where the kernel or the range does not allow it; the weights work either way."""
    start, end = -(-address // HUGE_PAGE) * HUGE_PAGE, (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    ok = (libc.madvise(start, end - start, MADV_HUGEPAGE) == 0
          and libc.madvise(start, end - start, MADV_COLLAPSE) == 0)
    if not ok:
        log.debug("reordered weight at %#x: no huge pages (madvise errno %d)", address, ctypes.get_errno())
    return ok


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ dense(weight).T -> [..., N], for a weight from ``prepare_weight``."""
    if x.dtype != weight.dtype:
        raise TypeError(f"x is {x.dtype} but the reordered weight is {weight.dtype}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but the weight [{weight.shape[0]}, "
                         f"{weight.shape[1]}] takes {weight.shape[1]}")
    rows = x.numel() // max(x.shape[-1], 1)
    if 0 < rows < MIN_ROWS:
        padded = x.new_zeros(MIN_ROWS, x.shape[-1])
        padded[:rows] = x.reshape(rows, -1)
        y = torch.ops.mkldnn._linear_pointwise(padded, weight, None, "none", [], "")
        return y[:rows].reshape(*x.shape[:-1], weight.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")

