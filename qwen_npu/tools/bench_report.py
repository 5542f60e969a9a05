"""The text of a ``qwen-npu bench`` result: the run's figures, and each beside the limit it has."""
from __future__ import annotations


DRIFT_NOTED = 0.10        # limits that moved more than this between before and after the run are flagged


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def _pct(share: float) -> str:
    return f"{100 * share:.0f}%"


def memory_lines(r: dict) -> list[str]:
    """Peak resident memory, and what it is made of: the process before the checkpoint loaded,
    the weights, the KV cache, the dispatch and output buffers, and the rest."""
    line = f"  memory     peak resident {_gib(r['peak_rss_bytes'])}"
    if "peak_device_bytes" in r:
        line += f", peak device {_gib(r['peak_device_bytes'])}"
    m = r.get("memory")
    if not m:
        return [line]
    parts = {"before load": m["before_load"], "weights": m["weights"], "KV cache": m["kv_cache"],
             "buffers": m["buffers"]}
    rest = r["peak_rss_bytes"] - sum(parts.values())
    shown = ", ".join(f"{k} {_gib(v)}" for k, v in parts.items())
    return [line + f" = {shown}, rest {_gib(rest)} ({_pct(rest / r['peak_rss_bytes'])}); "
                   f"resident at the end {_gib(m['rss_now'])}"]


def limit_lines(r: dict) -> list[str]:
    """The machine's limits and the run's shares of them (``bench_floors.for_run``)."""
    f = r["floors"]
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in f.get("peaks", {}).items()) or "none measured"
    lines = [f"  limits     read {f['read_gb_s']:.1f} GB/s; compute limit {f.get('peak_gflops', 0):.0f} GFLOP/s "
             f"({f.get('peak_kind', '?')}, for the model's dtype; multiply-add peaks {peaks}); torch's "
             f"float32 product {f['fp32_gflops']:.0f}, bf16 product {f['bf16_gflops']:.0f} GFLOP/s "
             f"(load {f['load']:.1f})"]
    if "before_error" in f:
        lines.append(f"  limits     {f['before_error']}")
    if "drift" in f:
        (r0, r1), (p0, p1) = f["drift"]["read_gb_s"], f["drift"]["peak_gflops"]
        moved = max(abs(r1 - r0) / max(r0, r1), abs(p1 - p0) / max(p0, p1))
        lines.append(f"  limits     before / after the run: read {r0:.1f} / {r1:.1f} GB/s, peak {p0:.0f} / {p1:.0f} "
                     f"GFLOP/s; each limit is the higher"
                     + (f" (they moved {_pct(moved)}: a busy machine, the shares are approximate)"
                        if moved > DRIFT_NOTED else ""))
    if "prefill_share" in r:
        lines.append(f"  vs limits  prefill {r['prefill_gflops']:.0f} GFLOP/s on the layers' products = "
                     f"{_pct(r['prefill_share'])} of the peak")
    if "decode_b1_vs_floor" in r:
        bound = "reading the weights" if f["b16_floor_ms"] == f["b1_read_ms"] else "the peak"
        lines.append(f"  vs limits  decode batch 1 {r['decode_b1_vs_floor']:.2f}x the read floor "
                     f"({f['b1_read_ms']:.1f} ms); batch {r.get('probe_batch', 16)} at "
                     f"{_pct(r['decode_b16_share'])} of its limit "
                     f"(floor {f['b16_floor_ms']:.1f} ms, set by {bound})")
    if "workload_share" in r:
        lines.append(f"  vs limits  the workload's floor {r['workload_floor_s']:.2f} s = "
                     f"{_pct(r['workload_share'])} of the run")
    return lines


def format_text(r: dict) -> str:
    """The human-readable report of a ``run_bench`` result."""
    def ms(v):
        return "n/a" if v is None else f"{v:.1f} ms"
    lines = [
        f"qwen-npu bench: workload {r['workload']} ({r['requests']} requests, {r['prompt_tokens']} prompt + "
        f"{r['out_tokens']} output tokens)",
        f"  model      {r['model']} ({r['dtype']}, {r['device']}, kernels {r['kernels']}, {r['threads']} threads, "
        f"prefix cache {'on' if r['prefix_cache'] else 'off'})",
        f"  load       {r['load_s']:.1f} s, warm-up {r['warmup_s']:.2f} s"
        f"{f', kernel build {b:.1f} s' if (b := r.get('build_s', 0)) >= 0.1 else ''} (not counted)",
        f"  total      {r['seconds']:.2f} s: {r['out_tok_s']:.1f} output tok/s, {r['total_tok_s']:.1f} total tok/s",
        f"  prefill    {r['prefill_tokens']} tokens computed in {r['prefill_s']:.2f} s: "
        f"{r['prefill_tok_s'] or 0:.1f} tok/s",
        f"  decode     {r['decode_steps']} steps in {r['decode_s']:.2f} s; median step at batch 16 in the "
        f"workload {ms(r['decode_ms_workload_b16'])}",
    ]
    if r.get("mixed_steps"):
        lines.append(f"  mixed      {r['mixed_step_count']} steps of decode rows + prefill chunks "
                     f"({r['mixed_tokens']} tokens) in {r['mixed_s']:.2f} s")
    if "decode_ms_b1" in r:
        lines.append(f"  decode     per step at context {r['probe_context']}: batch 1 {ms(r['decode_ms_b1'])}, "
                     f"batch {r.get('probe_batch', 16)} {ms(r['decode_ms_b16'])}")
    if "decode_host_ms_b16" in r:
        lines.append(f"  host       outside the forward: batch 1 {r['decode_host_ms_b1']:.2f} ms, batch "
                     f"{r.get('probe_batch', 16)} {r['decode_host_ms_b16']:.2f} ms "
                     f"({100 * r['decode_host_share_b16']:.1f}% of its step)")
    lines += memory_lines(r)
    lines.append(f"  transfers  {r['d2h_bytes_per_token']:.1f} B device-to-host per generated token "
                 f"({r['h2d_bytes_per_token']:.1f} B host-to-device)")
    if "floors" in r:
        lines += limit_lines(r)
    if "hf" in r:
        hf = r["hf"]
        for dtype, run in r.get("hf_by_dtype", {hf.get("dtype", "?"): hf}).items():
            verdict = ratio_text(run, r)
            lines.append(f"  vs hf      generate in {dtype} (groups of 16, left padding, static cache): "
                         f"{run['seconds']:.2f} s, {run['out_tok_s']:.1f} output tok/s -> qwen-npu is {verdict}")
    return "\n".join(lines)


def ratio_text(peer: dict | None, ours: dict | None, bold: bool = False) -> str:
    """A peer's seconds over ours as "N.NNx faster" (bold in Markdown on request) or "N.NNx slower";
    "–" when either run is missing."""
    if not peer or not ours:
        return "–"
    r = peer["seconds"] / ours["seconds"]
    return (f"**{r:.2f}x faster**" if bold else f"{r:.2f}x faster") if r >= 1 else f"{1 / r:.2f}x slower"
