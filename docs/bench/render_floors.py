"""The peers by dtype and the machine's floors, for docs/benchmarks.md (see render_benchmarks.py)."""
from __future__ import annotations

from qwen_npu.tools.bench_report import ratio_text
from qwen_npu.tools.bench_floors import decode_floors


def vllm_by_dtype(res: dict) -> dict:
    """{dtype: {workload: run}}; results of the older layout (one bf16 run per workload) included."""
    vllm = res.get("vllm", {})
    if any("seconds" in v for v in vllm.values()):
        return {"bfloat16": vllm}
    return vllm


def hf_by_dtype(run: dict | None) -> dict:
    """{dtype: Hugging Face run} of one of our workload results."""
    if not run or "hf" not in run:
        return {}
    return run.get("hf_by_dtype") or {run["hf"].get("dtype", "bfloat16"): run["hf"]}


def user_dtype(res: dict) -> str | None:
    """The dtype a user would run the peers in on the measured machine (None: floors not measured)."""
    if res.get("floors", {}).get("peer_dtype"):
        return res["floors"]["peer_dtype"]
    for run in res.get("workloads", {}).values():
        if run.get("floors", {}).get("peer_dtype"):
            return run["floors"]["peer_dtype"]
    return None


def dtype_table(res: dict) -> list[str]:
    """Every peer run in every dtype measured, labelled, beside ours."""
    ours, user = res.get("workloads", {}), user_dtype(res)
    rows = []
    for dtype, runs in vllm_by_dtype(res).items():
        rows += [(w, f"vLLM CPU 0.32, {dtype}", dtype, runs.get(w)) for w in ("mixed", "seed")]
    for w in ("mixed", "seed"):
        rows += [(w, f"Hugging Face generate, {d}", d, r) for d, r in hf_by_dtype(ours.get(w)).items()]
    if not rows:
        return []
    lines = ["| workload | peer | peer seconds | qwen-npu vs peer | the dtype a user would pick here? |",
             "|---|---|---|---|---|"]
    for w, name, dtype, run in sorted(rows, key=lambda r: (r[0], r[1])):
        seconds = f"{run['seconds']:.1f} s" if run else "not run"
        lines.append(f"| `{w}` | {name} | {seconds} | {ratio_text(run, ours.get(w))} | "
                     f"{'yes' if dtype == user else 'no'} |")
    return lines


def floors_lines(res: dict) -> list[str]:
    """The machine's floors and the decode steps as ratios to them."""
    f = res.get("floors")
    if not f:
        return []
    lines = ["## The machine's floors", "",
             f"Measured by the same script (`qwen_npu/tools/bench_floors.py`, load average {f.get('load', '?')}): reading",
             f"memory ran at **{f['read_gb_s']:.1f} GB/s** (one pass over 1 GiB, best of five); torch's float32",
             f"product ran at **{f['fp32_gflops']:.0f} GFLOP/s** ([512, 4096] x [4096, 4096], best of three) and",
             f"its bf16 product at {f['bf16_gflops']:.0f} GFLOP/s, so a user runs a torch-based engine in",
             f"**{f['peer_dtype']}** here. A decode step reads {f['weight_bytes'] / 1e9:.2f} GB of weights and",
             f"multiplies {f['weight_params'] / 1e6:.0f} M of them by each row:", "",
             "| decode step | floor | floor (ms) | qwen-npu (ms) | ratio to the floor |", "|---|---|---|---|---|"]
    sc = res.get("scaling", {}).get("kernels", {}).get("cpu", {})
    ours = res.get("workloads", {})
    cases = [("batch 1", "weights read at the measured bandwidth", f["b1_read_ms"], "b1", "decode_ms_b1"),
             ("batch 16", "products at the float32 rate", f["b16_compute_ms"], "b16", "decode_ms_b16")]
    own = res.get("scaling", {})                       # the scaling part's floors, measured beside its forwards
    if own.get("read_gb_s") and own.get("fp32_gflops") and own.get("weight_params"):
        own = decode_floors(own, own["weight_bytes"], own["weight_params"])
    else:
        own = f
    own_floor = {"b1": own["b1_read_ms"], "b16": own["b16_compute_ms"]}
    for label, what, floor, key, probe in cases:
        if sc.get(key):
            lines.append(f"| {label}, forward only (scaling) | {what} | {own_floor[key]:.1f} | {sc[key]:.1f} | "
                         f"**{sc[key] / own_floor[key]:.2f}x** |")
        for w in ("mixed", "seed"):
            r = ours.get(w, {})
            if r.get(probe):
                lines.append(f"| {label}, whole step (`{w}` run's probe) | {what} | {floor:.1f} | {r[probe]:.1f} | "
                             f"{r[probe] / floor:.2f}x |")
    if f.get("bf16_gflops", 0) > f["fp32_gflops"]:
        bf16_floor = 32 * f["weight_params"] / f["bf16_gflops"] / 1e6
        for w in ("mixed", "seed"):
            r = ours.get(w, {})
            if r.get("decode_ms_b16"):
                lines.append(f"| batch 16, whole step (`{w}` run's probe) | products at the bf16 rate | "
                             f"{bf16_floor:.1f} | {r['decode_ms_b16']:.1f} | {r['decode_ms_b16'] / bf16_floor:.2f}x |")
    lines += ["", "Targets: batch 1 within 1.25x of the read floor, batch 16 within 1.5x of the compute floor.",
              "Each workload run also measures its own floors, before and after itself (`floors` in its",
              "results: the higher of each, and both in `drift`). Read bandwidth on a",
              "shared host drifts: on the 2-core EPYC of these figures the same measurement gave 32-67 GB/s",
              "within one day (a batch-1 floor of 37 to 18 ms), so a step is only compared with a floor",
              "measured in the same sitting.", ""]
    return lines
