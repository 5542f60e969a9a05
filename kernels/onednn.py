"""Weights reordered once for oneDNN's bf16 product: how the cpu set multiplies on a CPU with
native bf16 instructions (AVX512-BF16 or AMX).

torch's bf16 ``F.linear`` hands plain [N, K] weights to oneDNN, which rearranges them into its
blocked layout inside every call. Reordered once at load (``prepare_weight``), the same product
skips that work: the weight becomes an opaque ``torch._mkldnn`` tensor (``weight.is_mkldnn``)
that only oneDNN's product reads, and ``weight.to_dense()`` gives the plain matrix back, bit for
bit. The products are bit-identical to ``F.linear`` on the plain weight (bf16 products, fp32 sums,
one rounding to bf16), at every number of rows; docs/benchmarks.md has the measurements that made
this the cpu set's bf16 product at every step shape on such CPUs.

Contract:
  - ``prepare_weight(w)`` returns ``w`` unchanged unless it is a 2-D bf16 CPU tensor and the CPU
    multiplies bf16 natively (``cpu_features.native_bf16``, which ``QWEN_NPU_CPU_ISA`` caps);
  - ``linear(x, w)`` takes a prepared ``w`` and any x [..., K] (bf16, on the CPU) -> [..., N];
  - ``qwen_npu.model.qwen3.dense_weight(w)`` is the plain matrix of a prepared or plain weight.
"""
from __future__ import annotations

import torch

from . import cpu_features

# The row count oneDNN is told to expect when it picks the blocked layout (a hint: the layout
# serves every row count, decode and prefill alike).
REORDER_ROWS = 16


def prepares(dtype: torch.dtype) -> bool:
    """Does ``prepare_weight`` reorder weights of ``dtype`` on this CPU?"""
    return dtype == torch.bfloat16 and cpu_features.native_bf16()[0]


def prepare_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] in the form ``linear`` multiplies fastest here (see the contract above)."""
    if weight.is_mkldnn or weight.dim() != 2 or not weight.is_cpu or not prepares(weight.dtype):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), REORDER_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ dense(weight).T -> [..., N], for a weight from ``prepare_weight``."""
    if x.dtype != weight.dtype:
        raise TypeError(f"x is {x.dtype} but the reordered weight is {weight.dtype}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but the weight [{weight.shape[0]}, "
                         f"{weight.shape[1]}] takes {weight.shape[1]}")
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")

