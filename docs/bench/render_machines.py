"""The sections of docs/benchmarks.md for the other machines measured (docs/bench/results-*.json):
each machine's workloads beside the peers, and every run's figures as shares of the limits
measured in the same run (see render_benchmarks.py)."""
from __future__ import annotations

from pathlib import Path

from render_floors import user_dtype, vllm_by_dtype

from qwen_npu.tools.bench_report import ratio_text

HERE = Path(__file__).resolve().parent
RUNS = (("mixed", "`mixed`"), ("mixed, mixed steps", "`mixed`, `mixed_steps=True`"), ("seed", "`seed`"))


def extra_results() -> list[Path]:
    """The results files of the other machines, in name order, a machine's capped run
    (``results-NAME-as-ISA.json``) after its native one."""
    return sorted(HERE.glob("results-*.json"), key=lambda p: ("-as-" in p.name, p.name))


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def _gib(n) -> str:
    return "–" if not n else f"{n / 2 ** 30:.2f}"


def limits_table(runs: dict) -> list[str]:
    """One row per run of ours: its figures beside the limits that run measured."""
    lines = ["| run | prefill on the layers, GFLOP/s (of the peak) | batch-1 step / read floor | batch-16 step, "
             "share of its limit | workload floor / run | host per batch-16 step, ms (of the step) | "
             "peak memory GiB: weights + KV + buffers + before load, rest |", "|---|---|---|---|---|---|---|"]
    for key, label in RUNS:
        r = runs.get(key)
        if not r:
            continue
        prefill = f"{r['prefill_gflops']:.0f} ({_pct(r.get('prefill_share'))})" if r.get("prefill_gflops") else "–"
        b1 = f"{r['decode_b1_vs_floor']:.2f}x" if r.get("decode_b1_vs_floor") else "–"
        host = (f"{r['decode_host_ms_b16']:.2f} ({100 * r['decode_host_share_b16']:.1f}%)"
                if r.get("decode_host_ms_b16") else "–")
        m = r.get("memory")
        if m:
            parts = m["weights"] + m["kv_cache"] + m["buffers"] + m["before_load"]
            rest = r["peak_rss_bytes"] - parts
            mem = (f"{_gib(r['peak_rss_bytes'])}: {_gib(m['weights'])} + {_gib(m['kv_cache'])} + "
                   f"{_gib(m['buffers'])} + {_gib(m['before_load'])}, rest {_gib(rest)} "
                   f"({100 * rest / r['peak_rss_bytes']:.0f}%)")
        else:
            mem = _gib(r.get("peak_rss_bytes"))
        lines.append(f"| {label} | {prefill} | {b1} | {_pct(r.get('decode_b16_share'))} | "
                     f"{_pct(r.get('workload_share'))} | {host} | {mem} |")
    return lines


def limits_text(runs: dict) -> list[str]:
    """The limits the first run with them measured, in words."""
    f = next((r["floors"] for r in runs.values() if r.get("floors", {}).get("peaks")), None)
    if not f:
        return []
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in f["peaks"].items())
    return [f"Limits measured in the runs (`qwen_npu/tools/bench_floors.py`): reading memory "
            f"**{f['read_gb_s']:.1f} GB/s**; register-resident multiply-adds on both cores, GFLOP/s: {peaks} "
            f"(the limit is the fastest, or a product measured faster: **{f['peak_gflops']:.0f}**, "
            f"{f['peak_kind']}); torch's float32 product "
            f"{f['fp32_gflops']:.0f} and bf16 product {f['bf16_gflops']:.0f} GFLOP/s beside them. A "
            f"workload's floor is the sum over its steps of the larger of reading the weights and "
            f"multiplying by them at the peak (the LM head only for rows that get logits; attention left "
            f"out), so it is a lower bound."]


def machine_section(res: dict) -> list[str]:
    m, when = res.get("machine", {}), res.get("measured", {})
    cap = m.get("isa_cap")
    title = f"### {m.get('cpu', '?')}, {m.get('cores', '?')} cores" + (f", run as an {cap.upper()} machine" if cap else "")
    runs = res.get("workloads", {})
    dtype = user_dtype(res) or "bfloat16"
    vllm = vllm_by_dtype(res).get(dtype, {})
    lines = [title, "",
             f"torch {m.get('torch', '?')} ({m.get('cpu_capability', '?')}; bf16/AVX-512/AMX instructions: "
             f"{', '.join(m.get('bf16_or_amx') or []) or 'none'}"
             + (f", capped with `QWEN_NPU_CPU_ISA={cap}`" if cap else "") + f"), {m.get('threads', '?')} threads. "
             "Measured: " + ", ".join(f"{k} {v}" for k, v in when.items()) + ".", "",
             f"| workload | qwen-npu | vLLM CPU 0.32, {dtype} | qwen-npu vs vLLM |", "|---|---|---|---|"]
    for key, label in RUNS:
        r = runs.get(key)
        if not r:
            continue
        peer = vllm.get(key.split(",")[0])
        peer_cell = f"{peer['seconds']:.1f} s" if peer else "not run"
        lines.append(f"| {label} | {r['seconds']:.1f} s ({r['out_tok_s']:.1f} out tok/s) | {peer_cell} | "
                     f"{ratio_text(peer, r, bold=True)} |")
    lines += ["", *limits_text(runs), "", *limits_table(runs), ""]
    prof = res.get("profile", {})
    if prof:
        lines += ["Milliseconds per step by part (as in \"Where the time goes\" above):", "",
                  *profile_table(prof), ""]
    return lines


def profile_table(prof: dict) -> list[str]:
    """{kernel set: {step: {part: ms}}} (``profile_steps.profile``) as a Markdown table."""
    from profile_steps import PARTS

    def ms(v):
        return "–" if v is None else f"{v:.1f}"
    lines = ["| kernels | step | " + " | ".join(PARTS) + " | total |", "|---|---|" + "---|" * (len(PARTS) + 1)]
    for k, cases in prof.items():
        for case, parts in cases.items():
            lines.append(f"| `{k}` | {case} | " + " | ".join(ms(parts.get(p)) for p in PARTS)
                         + f" | **{ms(parts.get('total'))}** |")
    return lines


ROUTING = """## Kernel routing: the measurements behind the cpu set's thresholds

Measured on a 2-core AVX512-BF16 host without AMX (interleaved A/B), 0.6B shapes:

- `NATIVE_ROWS = 6` (CPUs with native bf16 but no AVX512-BF16 dot products): torch's bf16 product
  (oneDNN: bf16 products, fp32 sums) was 1.3-2.3x faster than `csrc/linear.cpp` from 8 rows up;
  below 6 rows the C++ kernel streamed the weights as fast or faster. torch's float32 product fed
  with weights widened to fp32 on each call lost to the C++ kernel at every shape (1.1-2.3x).
- `BF16_DOT_ROWS = 20` (AVX512-BF16): one layer's products plus the LM head, ms, dot-product kernel /
  C++ widening kernel / torch: 1 row 11.1 / 13.5 / 16.4, 8 rows 18.1 / 31.4 / 21.9, 16 rows 25.9 /
  41.9 / 26.8, 24 rows 33.6 / 53.8 / 33.3, 32 rows 41.2 / 67.1 / 38.6. Whole batch-16 decode steps:
  106-108 ms with the dot-product kernel, 115-119 ms with torch's product (3 interleaved rounds);
  batch 1: 45 ms, 53-54 ms with the widening kernel.
- `kernels="auto"` on that host: decode steps 1.6x (batch 1) and 2.4x (batch 16) faster with the
  cpu set than with the reference set, before the dot-product kernel.

Measured on a 2-core Intel Xeon with AMX tiles (and AVX512-BF16), 2026-12-02, 0.6B shapes:

- With AMX, torch's bf16 product runs on the tiles and wins from a few rows: the four products of
  a layer took 1.56 ms at 16 rows against 4.02 ms through the dot-product kernel (0.77 / 2.20 ms at
  1 row, 1.41 / 1.59 ms at 4). Whole decode steps at context 128, three interleaved rounds, best
  of each: batch 8 124-128 ms with torch from 2-8 rows against 175 ms with the old threshold of
  20, batch 16 136-144 ms against 244 ms; batch 4 110-118 ms either way. So on an AMX CPU torch
  takes over from `NATIVE_ROWS` (6) rows.
- Prefill attention of one 512-token row, per layer: the C++ flash loop 19-28 ms, torch's SDPA in
  bf16 4-5 ms (3-D inputs take SDPA's slow path: 26 ms; the kernel passes 4-D ones). Under
  `QWEN_NPU_CPU_ISA=avx2` the C++ loop stays the faster (18.8 ms against 25.6 ms for SDPA in bf16
  and 27.8 ms in fp32), so SDPA is used only with AMX (`SDPA_ROWS = 16` tokens and more).
- Greedy sampling plus the health check of 16 rows of 151936 logits: 2.3 ms for torch's argmax
  alone and two more passes for the check, 0.36 ms for the fused read (`greedy_health`).
- oneDNN's bf16 product with the weights reordered once for it
  (`torch.ops.mkldnn._reorder_linear_weight`) was bit-identical and 27% faster at 16 and 128 rows
  (the same at 512).

Measured on a 2-core AMD EPYC with AVX512-BF16 (no AMX), 2026-12-02, 0.6B shapes, interleaved A/B:

- Weights reordered for oneDNN (`kernels/onednn.py`), the 28 layers' four products in a row, ms,
  plain weights through the routing above / reordered: 1 row 39.8 / 38.2, 2 rows 40.4 / 40.6,
  4 rows 44.2 / 34.3, 16 rows 72.6 / 50.1; the LM head 13.6 / 11.6 (1 row), 16.1 / 10.2 (4),
  27.7 / 19.0 (16). With one or two rows oneDNN takes a slower path than with four (1 row padded
  to 4: 41.5 ms against 47.1), so fewer rows are padded to four. Whole decode steps at context
  128, reordered weights backed by huge pages (`MADV_COLLAPSE`) against plain weights in the
  arena, medians of five interleaved rounds on a busy host: batch 1 57.9 / 58.8 ms, batch 2
  62.8 / 67.6, batch 4 62.8 / 75.3, batch 16 112.8 / 142.7 (without huge pages batch 1 was 5-10%
  slower than on the arena; an earlier, quieter sitting gave batch 16 84 against 108 ms). The products are bit-identical
  to torch's bf16 product on the plain weights; the plain matrices are not kept (a tied LM head
  keeps the embedding and gets a reordered copy).
- Prefill attention tiles: up to 64 query rows per tile instead of 16 (each K/V chunk packed once
  for four times the rows; same bits) took a 512-token row from 16.3 to 13.0 ms per layer; on bf16
  pairs (`csrc/attention_bf16.cpp`) 1.5-2x faster again than the fp32 tile at every shape measured
  (512 tokens: 7-8 ms against 11-15 ms), with errors against float32 attention as large as the
  fp32 tile's (both dominated by the bf16 output). torch's SDPA in bf16 took 22.8 ms there.
"""
