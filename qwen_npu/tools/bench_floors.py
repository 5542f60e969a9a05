"""The machine's floors for ``qwen-npu bench``: how fast it reads memory and how fast torch multiplies.

    read_gb_s       one pass (a sum) over 1 GiB of float32, best of ``reps``, in huge pages
                    where the kernel gives them (as the model's weights are)
    fp32_gflops     torch's float32 product [512, 4096] x [4096, 4096], best of ``reps``
    bf16_gflops     torch's bfloat16 product [256, 1024] x [1024, 1024], best of ``reps``
                    (sizes: the module constants)
    peer_dtype      what a user would run a torch-based peer in here: ``bfloat16`` where torch's
                    bf16 product beats its float32 one (native bf16 instructions), else ``float32``;
                    decided on the bf16 shape in CPU time, which a busy machine disturbs less

From these, for a decode step of a model with ``weight_bytes`` of weights (read once per step) and
``weight_params`` matrix weights (two flops each per row):

    batch-1 floor   weight_bytes / read bandwidth       (the step cannot read faster)
    batch-B floor   2 * B * weight_params / fp32 rate   (the step cannot multiply faster in float32)

Wall-clock figures: run on an otherwise idle machine, and compare a step with floors measured in
the same process.
"""
from __future__ import annotations

import os
import time

import torch

READ_BYTES = 1 << 30                    # the buffer the read bandwidth is measured on
FP32_SHAPE = (512, 4096, 4096)          # (m, n, k) of the float32 product
BF16_SHAPE = (256, 1024, 1024)          # smaller: without native bf16 it runs at a few GFLOP/s
REPS = 3

def _sig(v: float) -> float:
    return float(f"{v:.4g}")


def _best_seconds(fn, reps: int, clock=time.perf_counter) -> float:
    fn()                                                   # warm-up: page faults, thread start
    best = float("inf")
    for _ in range(reps):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return max(best, 1e-9)


def read_bandwidth(nbytes: int = READ_BYTES, reps: int = REPS + 2) -> float:
    """GB/s of one pass over ``nbytes`` of float32 (a sum), best of ``reps``, in memory laid out as
    the model's weights are: a huge-page arena (``model.arena.WeightArena``) where the kernel
    gives one, else an ordinary tensor. The page size matters: on a 2-core EPYC the same sum read
    32 GB/s in 4 KiB pages and 58 GB/s in 2 MiB pages, and the weights live in the latter."""
    from ..model.arena import WeightArena
    n = max(nbytes // 4, 1)
    arena = WeightArena.allocate(n * 4)
    x = arena.buffer[:n * 4].view(torch.float32) if arena is not None else torch.empty(n)
    x.fill_(1.0)
    return x.nbytes / _best_seconds(x.sum, reps) / 1e9


def gemm_rate(dtype: torch.dtype = torch.float32, m: int = FP32_SHAPE[0], n: int = FP32_SHAPE[1],
              k: int = FP32_SHAPE[2], reps: int = REPS, clock=time.perf_counter) -> float:
    """GFLOP/s of torch's product [m, k] x [k, n] in ``dtype``, best of ``reps`` (``clock``: wall by
    default; ``time.process_time`` gives flops per CPU second of all threads)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    return 2 * m * n * k / _best_seconds(lambda: torch.mm(a, b), reps, clock) / 1e9


def measure() -> dict:
    """The machine's floors as one flat dict (see the module docstring), with the load average."""
    fp32 = gemm_rate(torch.float32, *FP32_SHAPE)
    bf16 = gemm_rate(torch.bfloat16, *BF16_SHAPE)
    return {"read_gb_s": _sig(read_bandwidth()), "fp32_gflops": _sig(fp32), "bf16_gflops": _sig(bf16),
            "peer_dtype": user_dtype("cpu"), "threads": torch.get_num_threads(), "load": round(os.getloadavg()[0], 2)}


def model_weights(model) -> tuple[int, int]:
    """(bytes read by one decode step, matrix parameters) of a loaded ``Qwen3Model``: every layer
    tensor and the final norm are read once, the LM head's rows all of them."""
    layer_tensors = [t for layer in model.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    nbytes = sum(t.nbytes for t in layer_tensors) + model.lm_head.nbytes + model.norm.nbytes
    params = sum(t.numel() for t in layer_tensors if t.dim() == 2) + model.lm_head.numel()
    return nbytes, params


def decode_floors(floors: dict, weight_bytes: int, weight_params: int, batches=(1, 16)) -> dict:
    """Milliseconds below which a decode step cannot go: ``b1_read_ms`` (the weights read once at
    the measured bandwidth) and ``b{B}_compute_ms`` (the products at the float32 rate), by batch."""
    out = {"weight_bytes": weight_bytes, "weight_params": weight_params,
           "b1_read_ms": round(weight_bytes / (floors["read_gb_s"] * 1e9) * 1e3, 2)}
    for b in batches:
        out[f"b{b}_compute_ms"] = round(2 * b * weight_params / (floors["fp32_gflops"] * 1e9) * 1e3, 2)
    return out


def user_dtype(device: str) -> str:
    """The dtype a user would run a torch-based peer in on ``device``: on a CPU the faster product."""
    if not device.startswith("cpu"):
        return "bfloat16"
    rates = [gemm_rate(dtype, *BF16_SHAPE, clock=time.process_time) for dtype in (torch.bfloat16, torch.float32)]
    faster = rates[0] > rates[1]
    return "bfloat16" if faster else "float32"


def for_run(model, result: dict) -> dict:
    """``floors`` (the machine's and ``model``'s decode floors) and, when ``result`` has the decode
    probes, ``decode_b1_vs_floor`` and ``decode_b16_vs_floor`` (probe / floor: 1.0 is the floor)."""
    floors = measure()
    floors.update(decode_floors(floors, *model_weights(model)))
    out = {"floors": floors}
    if result.get("decode_ms_b1"):
        out["decode_b1_vs_floor"] = round(result["decode_ms_b1"] / floors["b1_read_ms"], 2)
        out["decode_b16_vs_floor"] = round(result["decode_ms_b16"] / floors["b16_compute_ms"], 2)
    return out
