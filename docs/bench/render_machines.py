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
            f"out), so it is a lower bound."] + drift_text(runs)


def drift_text(runs: dict) -> list[str]:
    """How far the limits measured before and after each run lay apart, where the runs kept both."""
    drifts = [r["floors"]["drift"] for r in runs.values() if "drift" in r.get("floors", {})]
    if not drifts:
        return []
    reads = [v for d in drifts for v in d["read_gb_s"]]
    peaks = [v for d in drifts for v in d["peak_gflops"]]
    return [f"Each run measured its limits before and after itself and divides by the higher of each: "
            f"across the runs, reading memory {min(reads):.1f}-{max(reads):.1f} GB/s and the limit "
            f"{min(peaks):.0f}-{max(peaks):.0f} GFLOP/s."]


def machine_section(res: dict) -> list[str]:
    m, when = res.get("machine", {}), res.get("measured", {})
    cap = m.get("isa_cap")
    fm = f" ({m['cpu_family_model']})" if m.get("cpu_family_model") else ""
    title = (f"### {m.get('cpu', '?')}{fm}, {m.get('cores', '?')} cores"
             + (f", run as an {cap.upper()} machine" if cap else ""))
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
