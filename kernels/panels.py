"""Weights held as 16-column panels: the form the cpu set multiplies bf16 matrices in on a CPU
without native bf16 instructions (csrc/linear_packed.cpp).

A plain weight [N, K] (N outputs, K inputs) becomes ``panels`` [N / 16, K, 16]: panel p holds,
for each k, the 16 weights of outputs 16 p .. 16 p + 15, stored in the order ``ORDER`` (0-3 8-11
4-7 12-15) so that one 32-byte load widens to fp32 outputs 0-7 and 8-15 exactly in registers.
Made once at load, so that no product transposes weights; the bytes are the weight's own (no
padding: only weights of N divisible by 16 are packed, the others stay plain).

Contract:
  - ``packs(w)``: is ``w`` a 2-D bf16 CPU tensor with N % 16 == 0 and K > 0;
  - ``pack(w)`` [N / 16, K, 16], ``unpack(pack(w))`` equal to ``w`` bit for bit;
  - ``is_packed(w)``: a model matrix in this form (the only 3-D matrices a model holds);
  - ``out_features(w)``: N, for a plain, reordered or packed weight.
"""
from __future__ import annotations

import torch

WIDTH = 16                                       # outputs per panel
ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)    # stored position -> output in the panel


def packs(weight: torch.Tensor) -> bool:
    return (not weight.is_mkldnn and weight.dim() == 2 and weight.is_cpu and weight.dtype == torch.bfloat16
            and weight.shape[0] % WIDTH == 0 and weight.shape[0] > 0 and weight.shape[1] > 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] -> panels [N / 16, K, 16] (see the module docstring)."""
    if not packs(weight):
        raise ValueError(f"panels take a 2-D bf16 cpu weight of a multiple of {WIDTH} rows; got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    n, k = weight.shape
    # output 8 h + 4 q + b of a panel is stored at 8 q + 4 h + b (ORDER): the two halving axes
    # swap, so the whole packing is one strided copy into memory of its own (no intermediate the
    # size of the weight, never a view of the input, whatever its strides)
    out = torch.empty((n // WIDTH, k, WIDTH), dtype=weight.dtype)
    out.view(n // WIDTH, k, 2, 2, 4).copy_(weight.reshape(n // WIDTH, 2, 2, 4, k).permute(0, 4, 2, 1, 3))
    return out


def is_packed(weight: torch.Tensor) -> bool:
    return not weight.is_mkldnn and weight.dim() == 3 and weight.shape[2] == WIDTH


def unpack(panels: torch.Tensor) -> torch.Tensor:
    """panels [P, K, 16] -> the plain weight [16 P, K], bit for bit."""
    p, k, _ = panels.shape
    return panels.reshape(p, k, 2, 2, 4).permute(0, 3, 2, 4, 1).reshape(p * WIDTH, k)


def out_features(weight: torch.Tensor) -> int:
    return weight.shape[0] * WIDTH if is_packed(weight) else weight.shape[0]
