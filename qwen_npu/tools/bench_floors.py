"""The machine's limits for ``qwen-npu bench``, and every figure of a run as a share of them.

    read_gb_s       one pass (a sum) over 1 GiB of float32, best of ``reps``, in huge pages
                    where the kernel gives them (as the model's weights are)
    peaks           GFLOP/s of register-resident multiply-adds on every thread, per instruction
                    kind the CPU has (``kernels/csrc/peak.cpp``: float32 FMA at 8 lanes, at 16
                    lanes with AVX-512, the AVX512-BF16 dot product, AMX bf16 tile products); no
                    product in those instructions can beat them
    peak_gflops     the fastest of ``peaks``: the compute limit, and never below a product rate
                    measured beside it (a busy core can slow the loop; ``peak_kind`` then names the
                    product, as it does where the cpu kernels cannot be built)
    fp32_gflops     torch's float32 product [512, 4096] x [4096, 4096], best of ``reps``
    bf16_gflops     torch's bfloat16 product [256, 1024] x [1024, 1024], best of ``reps``
                    (sizes: the module constants; shown beside the limit, never used as one)
    peer_dtype      what a user would run a torch-based peer in here: ``bfloat16`` where torch's
                    bf16 product beats its float32 one (native bf16 instructions), else ``float32``;
                    decided on the bf16 shape in CPU time, which a busy machine disturbs less

From these, for a model whose decode step reads ``weight_bytes`` of weights and multiplies by
``weight_params`` matrix weights (two flops each per row):

    batch-1 floor   weight_bytes / read bandwidth       (the step cannot read faster)
    batch-B floor   2 * B * weight_params / peak        (the step cannot multiply faster)
    a workload      the sum over its steps of the larger of the two, for the step's tokens (the
                    layers) and its logits rows (the LM head, read and multiplied only for them);
                    attention and the KV cache's reads are left out, so the floor is a lower bound

Wall-clock figures: run on an otherwise idle machine, and compare a run with limits measured in
the same process: ``qwen-npu bench`` measures them before and after its run and divides by the
higher of each (on a shared machine a single measurement can catch a slow moment), reporting how
far the two were apart.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

READ_BYTES = 1 << 30                    # the buffer the read bandwidth is measured on
FP32_SHAPE = (512, 4096, 4096)          # (m, n, k) of the float32 product
BF16_SHAPE = (256, 1024, 1024)          # smaller: without native bf16 it runs at a few GFLOP/s
REPS = 3
PEAK_ITERS = 20_000_000                 # per thread and kind: about 0.1 s at 40 GFLOP/s per core
PEAK_KINDS = {"avx2_fma": 0, "avx512_fma": 1, "avx512_bf16_dot": 2, "amx_bf16": 3}   # csrc/peak.cpp's kinds

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


def read_bandwidth(nbytes: int | None = None, reps: int = REPS + 2) -> float:
    """GB/s of one pass over ``nbytes`` of float32 (a sum), best of ``reps``, in memory laid out as
    the model's weights are: a huge-page arena (``model.arena.WeightArena``) where the kernel
    gives one, else an ordinary tensor. The page size matters: on a 2-core EPYC the same sum read
    32 GB/s in 4 KiB pages and 58 GB/s in 2 MiB pages, and the weights live in the latter."""
    from ..model.arena import WeightArena
    n = max((nbytes or READ_BYTES) // 4, 1)
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


def compute_peaks(iters: int | None = None, reps: int | None = None) -> dict[str, float]:
    """GFLOP/s of register-resident multiply-adds on every thread, best of ``reps`` (default
    ``REPS``) runs of ``iters`` iterations per thread (default ``PEAK_ITERS``), for each kind
    of ``PEAK_KINDS`` this CPU has (under ``QWEN_NPU_CPU_ISA=avx2`` only "avx2_fma"); empty where
    the cpu kernels cannot be built here."""
    from ..kernels import cpu, cpu_features
    if not cpu.available():
        return {}
    try:
        ops = cpu.ops()
    except Exception:                       # a failed build is reported by `qwen-npu env`
        return {}
    flags = cpu_features.cpu_flags()
    kinds = ["avx2_fma"]
    if ops.peak_has_avx512() and "avx512f" in flags:
        kinds.append("avx512_fma")
        if cpu_features.avx512_bf16():
            kinds.append("avx512_bf16_dot")
    if "amx_bf16" in flags and ops.peak_has_amx():
        kinds.append("amx_bf16")
    iters, reps = iters or PEAK_ITERS, reps or REPS
    return {k: _sig(max(ops.fma_peak(PEAK_KINDS[k], iters)[0] for _ in range(reps))) for k in kinds}


def measure() -> dict:
    """The machine's limits as one flat dict (see the module docstring), with the load average."""
    floors = {"read_gb_s": _sig(read_bandwidth()), "peaks": compute_peaks(),
              "fp32_gflops": _sig(gemm_rate(torch.float32, *FP32_SHAPE)),
              "bf16_gflops": _sig(gemm_rate(torch.bfloat16, *BF16_SHAPE))}
    floors["peak_gflops"], floors["peak_kind"] = usable_peak(floors, torch.bfloat16)   # every kind
    return {**floors, "peer_dtype": user_dtype("cpu"), "threads": torch.get_num_threads(),
            "load": round(os.getloadavg()[0], 2)}


APART_TIMEOUT_S = 600.0                 # the most a measurement in a child process may take


def measure_apart(timeout_s: float | None = None) -> dict:
    """``measure()`` run in a child process with this one's settings (the module's sizes, torch's
    thread count, the environment), so that its buffers (``READ_BYTES`` for the read bandwidth,
    the product's matrices) never count in this process's peak resident memory: a run measures
    its limits before itself this way and still reports its own peak. Raises ``RuntimeError``
    (with the child's last words) when the child fails or takes longer than ``timeout_s``."""
    settings = {"READ_BYTES": READ_BYTES, "FP32_SHAPE": list(FP32_SHAPE), "BF16_SHAPE": list(BF16_SHAPE),
                "REPS": REPS, "PEAK_ITERS": PEAK_ITERS, "threads": torch.get_num_threads()}
    limit = timeout_s or APART_TIMEOUT_S
    try:
        done = subprocess.run([sys.executable, "-m", __name__, json.dumps(settings)], capture_output=True,
                              text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"measuring the machine's limits in a child process took longer than {limit:.0f} s") from e
    if done.returncode != 0:
        raise RuntimeError(f"measuring the machine's limits in a child process failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError) as e:
        raise RuntimeError(f"measuring the machine's limits in a child process gave no limits: stdout "
                           f"{done.stdout.strip()[-500:]!r}, stderr {done.stderr.strip()[-1500:]!r}") from e


def higher_of(before: dict, after: dict, dtype: torch.dtype = torch.bfloat16) -> dict:
    """One run's limits from two measurements of ``measure()``, before and after the run: each rate
    the higher of the two (what the machine reached at least once in the sitting), the rest as
    measured after, and ``drift``: both measurements of the read bandwidth and of the limit usable
    in ``dtype`` (``[before, after]``), so that a report can say how far the machine moved meanwhile."""
    out = dict(after)
    for key in ("read_gb_s", "fp32_gflops", "bf16_gflops"):
        out[key] = max(before[key], after[key])
    out["peaks"] = {k: max(v, before.get("peaks", {}).get(k, 0.0)) for k, v in after.get("peaks", {}).items()}
    out["peak_gflops"], out["peak_kind"] = usable_peak(out, dtype)
    out["drift"] = {"read_gb_s": [before["read_gb_s"], after["read_gb_s"]],
                    "peak_gflops": [usable_peak(before, dtype)[0], usable_peak(after, dtype)[0]]}
    return out


def model_shape(model) -> dict:
    """What one forward of a loaded ``Qwen3Model`` reads and multiplies, split where the LM head
    runs only for the rows that get logits: ``layer_bytes``/``layer_params`` (every layer tensor
    and the final norm; matrix weights) and ``head_bytes``/``head_params``."""
    layer_tensors = [t for layer in model.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return {"layer_bytes": sum(t.nbytes for t in layer_tensors) + model.norm.nbytes,
            "layer_params": sum(t.numel() for t in layer_tensors if t.dim() >= 2),   # matrices, packed or not
            "head_bytes": model.lm_head.nbytes, "head_params": model.lm_head.numel()}


def model_weights(model) -> tuple[int, int]:
    """(bytes read by one decode step, matrix parameters) of a loaded ``Qwen3Model``: every layer
    tensor and the final norm are read once, the LM head's rows all of them."""
    s = model_shape(model)
    return s["layer_bytes"] + s["head_bytes"], s["layer_params"] + s["head_params"]


FLOAT32_KINDS = ("avx2_fma", "avx512_fma", "torch float32 product")   # what a float32 model can run on


def usable_peak(floors: dict, dtype: torch.dtype) -> tuple[float, str]:
    """(GFLOP/s, kind): the limit for a model of ``dtype`` among the rates ``floors`` measured —
    a float32 model cannot use the bf16 instructions (dot products, AMX tiles, torch's bf16
    product), a bf16 model can use any (the cpu set widens bf16 to float32 where it has to)."""
    achieved = {**floors.get("peaks", {}), "torch float32 product": floors["fp32_gflops"]}
    if "bf16_gflops" in floors:
        achieved["torch bf16 product"] = floors["bf16_gflops"]
    if dtype == torch.float32:
        achieved = {k: v for k, v in achieved.items() if k in FLOAT32_KINDS}
    kind = max(achieved, key=achieved.get)
    return achieved[kind], kind


def _peak(floors: dict) -> float:
    return floors.get("peak_gflops") or floors["fp32_gflops"]


def decode_floors(floors: dict, weight_bytes: int, weight_params: int, batches=(1, 16)) -> dict:
    """Milliseconds below which a decode step cannot go: ``b1_read_ms`` (the weights read once at
    the measured bandwidth), and by batch ``b{B}_compute_ms`` (the products at the compute peak,
    or at the float32 product rate when ``floors`` has no peak) and ``b{B}_floor_ms`` (the larger
    of the two: a step reads every weight whatever its batch)."""
    read_ms = weight_bytes / (floors["read_gb_s"] * 1e9) * 1e3
    out = {"weight_bytes": weight_bytes, "weight_params": weight_params, "b1_read_ms": round(read_ms, 2)}
    for b in batches:
        compute_ms = 2 * b * weight_params / (_peak(floors) * 1e9) * 1e3
        out[f"b{b}_compute_ms"] = round(compute_ms, 2)
        out[f"b{b}_floor_ms"] = round(max(read_ms, compute_ms), 2)
    return out


def workload_floor(floors: dict, shape: dict, steps) -> float:
    """Seconds below which a run of ``steps`` [(tokens computed, logits rows)] cannot go: per step
    the larger of its read time and its compute time (see the module docstring)."""
    bw, peak = floors["read_gb_s"] * 1e9, _peak(floors) * 1e9
    total = 0.0
    for tokens, rows in steps:
        nbytes = shape["layer_bytes"] + (shape["head_bytes"] if rows else 0)
        flops = 2 * (tokens * shape["layer_params"] + rows * shape["head_params"])
        total += max(nbytes / bw, flops / peak)
    return total


def user_dtype(device: str) -> str:
    """The dtype a user would run a torch-based peer in on ``device``: on a CPU the faster product."""
    if not device.startswith("cpu"):
        return "bfloat16"
    rates = [gemm_rate(dtype, *BF16_SHAPE, clock=time.process_time) for dtype in (torch.bfloat16, torch.float32)]
    faster = rates[0] > rates[1]
    return "bfloat16" if faster else "float32"


def for_run(model, result: dict, steps=None, batch: int = 16, before: dict | None = None) -> dict:
    """``floors`` (the machine's limits and ``model``'s decode floors) and the run's figures as
    shares of them: with the decode probes in ``result``, ``decode_b1_vs_floor`` and
    ``decode_b16_vs_floor`` (probe / the larger of its read and compute floors: 1.0 is the floor)
    and ``decode_b16_share`` (the inverse: 1.0 is the limit); with prefill in the run, ``prefill_gflops`` (the layers' products
    per second of prefill steps) and ``prefill_share`` of the peak; with ``steps`` (the run's
    [(tokens, logits rows)]), ``workload_floor_s`` and ``workload_share`` (floor / seconds).
    The limit is the one usable in the model's dtype (``usable_peak``); ``batch``: the rows of the
    batch probe (its figures keep the ``b16`` names whatever ``batch`` is). ``before``: the limits
    measured before the run (``measure()``); then each limit is the higher of the two
    (``higher_of``) and ``floors["drift"]`` keeps both."""
    floors = measure() if before is None else higher_of(before, measure(), model.dtype)
    floors["peak_gflops"], floors["peak_kind"] = usable_peak(floors, model.dtype)
    shape = model_shape(model)
    floors.update(decode_floors(floors, *model_weights(model), batches=(1, batch)))
    if batch != 16:                                 # the probe's floors under the names it is read by
        floors["b16_compute_ms"], floors["b16_floor_ms"] = floors[f"b{batch}_compute_ms"], floors[f"b{batch}_floor_ms"]
    out = {"floors": floors}
    if result.get("decode_ms_b1"):
        out["decode_b1_vs_floor"] = round(result["decode_ms_b1"] / floors["b1_read_ms"], 2)
        out["decode_b16_vs_floor"] = round(result["decode_ms_b16"] / floors["b16_floor_ms"], 2)
        out["decode_b16_share"] = _sig(floors["b16_floor_ms"] / result["decode_ms_b16"])
    if result.get("prefill_s"):
        rate = 2 * result["prefill_tokens"] * shape["layer_params"] / result["prefill_s"] / 1e9
        out["prefill_gflops"] = _sig(rate)
        out["prefill_share"] = _sig(rate / _peak(floors))
    if steps:
        floor = workload_floor(floors, shape, steps)
        out["workload_floor_s"] = _sig(floor)
        out["workload_share"] = _sig(floor / result["seconds"])
    return out


if __name__ == "__main__":          # measure_apart's child: the settings as JSON in, the limits as JSON out
    _settings = json.loads(sys.argv[1])
    torch.set_num_threads(_settings.pop("threads"))
    for _name, _value in _settings.items():
        globals()[_name] = tuple(_value) if isinstance(_value, list) else _value
    print(json.dumps(measure()))
