"""Write docs/benchmarks.md and the scaling plot from docs/bench/results.json (see run_benchmarks.py)."""
from __future__ import annotations

import json
from pathlib import Path

from render_floors import dtype_table, floors_lines, hf_by_dtype, user_dtype, vllm_by_dtype
from page_text import FAST, ROUTING
from render_machines import extra_results, machine_section, profile_table

from qwen_npu.tools.bench_report import ratio_text
from run_benchmarks import MIXED_STEPS


def _f(v, fmt="{:.1f}", none="–"):
    return none if v is None else fmt.format(v)


def workload_table(res: dict) -> list[str]:
    """The headline: the peers in the dtype a user would pick on this machine."""
    dtype = user_dtype(res) or "bfloat16"
    ours, vllm = res.get("workloads", {}), vllm_by_dtype(res).get(dtype, {})
    lines = [f"| workload | qwen-npu | vLLM CPU 0.32, {dtype} | Hugging Face generate, {dtype} | qwen-npu vs vLLM "
             "| qwen-npu vs HF |", "|---|---|---|---|---|---|"]
    for w, what in (("mixed", "32 requests, prompts 64–512, outputs 32–128"),
                    ("seed", "16 identical 512-token prompts, 64 outputs each")):
        o, v = ours.get(w), vllm.get(w)
        hf = hf_by_dtype(o).get(dtype)

        def cell(r):
            return f"{r['seconds']:.1f} s ({r['out_tok_s']:.1f} out tok/s)" if r else "not run"
        lines.append(f"| `{w}`: {what} | {cell(o)} | {cell(v)} | {cell(hf)} | {ratio_text(v, o, bold=True)} | {ratio_text(hf, o, bold=True)} |")
        mixed = ours.get(MIXED_STEPS) if w == "mixed" else None
        if mixed:
            hf = hf_by_dtype(o).get(dtype) if o else None
            lines.append(f"| `mixed` with `mixed_steps=True` (decode rows ride along with prefill chunks) | "
                         f"{cell(mixed)} | {cell(v)} | {cell(hf)} | {ratio_text(v, mixed, bold=True)} | "
                         f"{ratio_text(hf, mixed, bold=True)} |")
    return lines


def detail_table(res: dict) -> list[str]:
    lines = ["| figure | `mixed` | `seed` |", "|---|---|---|"]
    ours = res.get("workloads", {})
    rows = [("total seconds (workload only)", "seconds", "{:.2f}"), ("output tok/s", "out_tok_s", "{:.1f}"),
            ("total tok/s (prompt + output)", "total_tok_s", "{:.1f}"),
            ("prompt tokens computed (prefix cache hits excluded)", "prefill_tokens", "{:d}"),
            ("prefill tok/s", "prefill_tok_s", "{:.1f}"), ("decode steps", "decode_steps", "{:d}"),
            ("median batch-16 decode step in the workload (ms)", "decode_ms_workload_b16", "{:.1f}"),
            ("decode step at batch 1, context 128 (ms)", "decode_ms_b1", "{:.1f}"),
            ("decode step at batch 16, context 128 (ms)", "decode_ms_b16", "{:.1f}"),
            ("device-to-host bytes per generated token", "d2h_bytes_per_token", "{:.1f}"),
            ("load average before / after", None, None)]
    for label, key, fmt in rows:
        cells = []
        for w in ("mixed", "seed"):
            r = ours.get(w, {})
            if key is None:
                cells.append(f"{r.get('load_before', '–')} / {r.get('load_after', '–')}")
            else:
                cells.append(_f(r.get(key), fmt))
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    peak = [ours.get(w, {}).get("peak_rss_bytes") for w in ("mixed", "seed")]
    lines.append("| peak resident memory (GiB) | " + " | ".join(_f(p and p / 2 ** 30, "{:.2f}") for p in peak) + " |")
    return lines


def scaling_tables(sc: dict) -> tuple[list[str], list[str]]:
    from run_benchmarks import BATCHES, CONTEXTS
    grid = sc.get("grid", {})
    head = ["| batch \\ context | " + " | ".join(str(c) for c in CONTEXTS) + " |", "|---|" + "---|" * len(CONTEXTS)]
    ms = head + [f"| {b} | " + " | ".join(_f(grid.get(f"{b},{c}")) for c in CONTEXTS) + " |" for b in BATCHES]
    tok = head + [f"| {b} | " + " | ".join(_f(grid.get(f"{b},{c}") and 1e3 * b / grid[f"{b},{c}"], "{:.0f}")
                                             for c in CONTEXTS) + " |" for b in BATCHES]
    return ms, tok


def knee(sc: dict) -> list[str]:
    """Sentences on where the step time stops being flat in batch, and how context adds to it."""
    from run_benchmarks import BATCHES, CONTEXTS
    grid = sc.get("grid", {})
    out = []
    for c in (CONTEXTS[0], CONTEXTS[-1]):
        t = [grid.get(f"{b},{c}") for b in BATCHES]
        if None in t:
            continue
        flat = [b for b, v in zip(BATCHES, t) if v <= 1.5 * t[0]]
        grows = ", ".join(f"x{v / t[0]:.1f} at batch {b}" for b, v in zip(BATCHES[1:], t[1:]))
        out.append(f"- Context {c}: relative to batch 1 the step costs {grows}. Up to batch {max(flat)} a step "
                   f"costs at most 1.5x batch 1 (reading the weights dominates); past it the step grows "
                   f"about in proportion to the batch (the multiply-adds dominate): the knee is near batch "
                   f"{max(flat)}.")
    for b in (BATCHES[0], BATCHES[-1]):
        lo, hi = grid.get(f"{b},{CONTEXTS[0]}"), grid.get(f"{b},{CONTEXTS[-1]}")
        if lo and hi:
            out.append(f"- Batch {b}: from context {CONTEXTS[0]} to {CONTEXTS[-1]} the step goes from {lo:.1f} "
                       f"to {hi:.1f} ms (x{hi / lo:.2f}): every row reads its own K/V, "
                       f"{CONTEXTS[-1] * 28 * 8 * 128 * 2 * 2 / 2 ** 20:.0f} MiB per row at {CONTEXTS[-1]} tokens.")
    return out


def plot(sc: dict, png: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from run_benchmarks import BATCHES, CONTEXTS
    grid = sc.get("grid", {})
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for c in CONTEXTS:
        a.plot(BATCHES, [grid.get(f"{bb},{c}") for bb in BATCHES], marker="o", label=f"context {c}")
    a.set(xlabel="batch (rows per decode step)", ylabel="ms per decode step", title="decode step time",
          xticks=BATCHES)
    a.legend(fontsize=8)
    for c in CONTEXTS:
        b.plot(BATCHES, [grid.get(f"{bb},{c}") and 1e3 * bb / grid[f"{bb},{c}"] for bb in BATCHES], marker="o",
               label=f"context {c}")
    b.set(xlabel="batch", ylabel="generated tokens / s", title="decode throughput", xticks=BATCHES)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def deterministic_section(det: dict | None) -> list[str]:
    """``deterministic=True`` against the ordinary kernels (``deterministic_cost.py``)."""
    if not det:
        return []
    a, b = det["ordinary"], det["deterministic"]
    rows = [("prefill 512 tokens (tokens/s)", "prefill_tok_s", True), ("decode step, batch 1 (ms)", "decode_b1_ms", False),
            ("decode step, batch 16 (ms)", "decode_b16_ms", False)]
    out = ["## Deterministic mode", "",
           "`deterministic=True` runs batch-invariant kernels (`kernels/invariant.py`) in ordinary batched",
           "steps. Whole steps with `kernels=\"auto\"`, the two modes alternating round by round",
           "(`docs/bench/deterministic_cost.py`); the cost is how much longer the deterministic step takes:", "",
           "| figure | ordinary | deterministic | cost |", "|---|---|---|---|"]
    for label, key, rate in rows:
        cost = a[key] / b[key] if rate else b[key] / a[key]
        out.append(f"| {label} | {_f(a[key])} | {_f(b[key])} | {cost:.2f}x |")
    return out + ["", "The deterministic products are the C++ dot products of one summation order for every row",
                  "count (on this CPU's bf16 instructions where it has them), not oneDNN's blocked product; a",
                  "deterministic Session holds plain matrices. Attention runs every token, decode ones too,",
                  "through the prefill tile loop.", ""]


def speculative_section(spec: dict | None) -> list[str]:
    """n-gram speculation against plain decoding (``speculative_cost.py``)."""
    if not spec:
        return []
    out = ["## Speculative decoding", "",
           "`speculative=\"ngram\", num_speculative_tokens=3` against plain decoding, greedy, whole `generate`",
           "calls (`docs/bench/speculative_cost.py`): a copy-heavy workload (an 8-token sequence listed 6",
           "times, 32 new tokens per request) at batch 1 and 16, and `mixed`:", "",
           "| workload | plain (tokens/s) | ngram (tokens/s) | speed-up | drafts accepted | by draft position |",
           "|---|---|---|---|---|---|"]
    for name, r in spec.items():
        a, b = r["plain"], r["ngram"]
        rate = b["accepted"] / b["drafts"] if b["drafts"] else 0.0
        by = ", ".join(f"{x:.2f}" for x in b["by_position"]) or "–"
        out.append(f"| {name} | {_f(a['tok_s'])} | {_f(b['tok_s'])} | {b['tok_s'] / a['tok_s']:.2f}x | "
                   f"{b['accepted']} of {b['drafts']} ({rate:.0%}) | {by} |")
    return out + ["", "A verification row computes its last token and its drafts in one forward. At batch 1 the",
                  "step reads every weight once whatever its width, so each accepted draft is a token for almost",
                  "nothing; at batch 16 the CPU's multiply-adds are the limit and the drafts widen every",
                  "product, so even a high acceptance gains little. The checkpoint's random weights make its",
                  "greedy output fall into repeating itself, which the n-gram drafter predicts well (on `mixed`",
                  "too); a trained model on prompts its output does not repeat accepts fewer drafts.", ""]


def render(res: dict, md: Path, png: Path, extra: list[Path] | None = None) -> None:
    """Write the page for ``res``, then a section per other machine's results file (``extra``,
    by default every ``docs/bench/results-*.json``)."""
    m = res.get("machine", {})
    sc = res.get("scaling", {})
    when = res.get("measured", {})
    bw = sc.get("read_gb_s")
    ours = res.get("workloads", {})
    b1 = sc.get("kernels", {}).get("cpu", {}).get("b1")
    lines = [
        "# Benchmarks",
        "",
        "Regenerate everything on this page with `python docs/bench/run_benchmarks.py` (see its docstring for",
        "running one part). Raw figures: [`bench/results.json`](bench/results.json).",
        "",
        "## Method",
        "",
        "- **Model**: a checkpoint with the exact shapes of Qwen3-0.6B (vocabulary 151936, hidden 1024, 28",
        "  layers, 16 query / 8 KV heads, head_dim 128, intermediate 3072, tied embeddings) and random bf16",
        "  weights, which `qwen-npu bench` writes once into `~/.cache/qwen-npu/qwen3-0.6b-random`.",
        "- **Workloads** (`qwen_npu.tools.workloads`, token for token the lists the peer scripts use): `mixed`",
        "  and `seed`. Greedy, EOS ignored (every request produces exactly its count), `max_batch` 16,",
        "  `max_model_len` 2048, prefix cache on.",
        "- **Timing**: wall clock of the workload only, after loading and a 4-token warm-up; all requests",
        "  are added at once and `Session.step()` runs until they finish. One run per figure, every engine",
        "  on the same machine in one sitting, each in its own process.",
        "- **Peers** in the dtype a user would pick on the machine (float32 unless torch's bf16 product is",
        "  faster than its float32 one, i.e. native bf16 instructions; the other dtype listed beside it):",
        "  the vLLM CPU build 0.32 (`bench_vllm.py`: `LLM.generate`, `max_num_seqs` 16, its",
        "  prefix cache on, 4 GiB KV space, OpenMP bound to all cores) and Hugging Face `generate` (groups of 16",
        "  in workload order, left padding, static cache), run by `qwen-npu bench --compare hf` in the same",
        "  process right after ours.",
        "- **Decode probes**: batch 1 and batch 16 decode steps at context 128 (one shared 128-token prompt),",
        "  median of 8 steps, the whole step (schedule, checks, forward, sampling).",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')} "
        f"({m.get('cpu_capability', '?')}; bf16/AVX-512/AMX instructions: "
        f"{', '.join(m.get('bf16_or_amx') or []) or 'none'}), {m.get('threads', '?')} threads. "
        f"Measured: " + ", ".join(f"{k} {v}" for k, v in when.items()) + ".",
        "",
        "## The shared workloads",
        "",
        *workload_table(res),
        "",
        (f"The peers run in {user_dtype(res)}, the dtype a user would pick here (see the floors below). Ratios"
         if user_dtype(res) else "The peers ran in bfloat16 (these results predate the floors). Ratios"),
        "are the peer's seconds over ours (above 1: qwen-npu is faster). Every peer run, by dtype:",
        "",
        *dtype_table(res),
        "",
        "qwen-npu's figures in detail:",
        "",
        *detail_table(res),
        "",
        *floors_lines(res),
    ]
    wb = sc.get("weight_bytes")
    if b1 and bw and wb and not res.get("floors"):
        floor = wb / (bw * 1e9) * 1e3
        lines += [f"**Batch-1 decode against the memory floor.** Reading memory ran at {bw:.1f} GB/s here "
                  f"(one pass over 1 GiB, best of four), so a step that reads all {wb / 1e9:.2f} GB of weights "
                  f"cannot take less than {floor:.1f} ms; the batch-1 forward took {b1:.1f} ms "
                  f"({b1 / floor:.2f}x the floor)."]
        probes = [ours.get(w, {}).get("decode_ms_b1") for w in ("mixed", "seed")]
        probes = [v for v in probes if v]
        if probes:
            lines[-1] += (" In the workload runs the whole batch-1 step (scheduling and sampling included) took "
                          + " and ".join(f"{v:.1f}" for v in probes) + " ms, "
                          + " and ".join(f"{v / floor:.2f}x" for v in probes) + " that floor.")
        lines += ["", "This host is shared and its speed drifts: the same kernels ran 20-40% slower in some",
                  "hours than in others (compare the probe above with the forward in the kernel-set table",
                  "below, measured an hour later). Each part's time of measurement is given above; ratios",
                  "are only taken between figures of one sitting.", ""]
    prof = res.get("profile", {})
    if prof:
        lines += ["## Where the time goes", "",
                  "Milliseconds per step by part (`docs/bench/profile_steps.py`): each kernel function timed",
                  "from outside, `other` = the rest of the forward (embedding, activation, residual adds),",
                  "`engine` = the step outside the forward (scheduling, slot checks, buffers, sampling).", "",
                  *profile_table(prof), ""]
    ks = sc.get("kernels", {})
    if ks:
        lines += ["## Kernel sets", "",
                  "One decode forward at context 128 (model only, no scheduling or sampling), by kernel set:", "",
                  "| kernels | batch 1 (ms) | batch 16 (ms) |", "|---|---|---|"]
        lines += [f"| `{k}` | {_f(v.get('b1'))} | {_f(v.get('b16'))} |" for k, v in ks.items()]
        lines += ["", "`reference` is the pure-torch truth (bf16 matrix products through torch); `cpu` is the",
                  "C++ set in `kernels/cpu.py` (AVX2, fp32 arithmetic on bf16 storage; on a CPU with native",
                  "bf16, every product through oneDNN on weights reordered once at load and prefill attention",
                  "on bf16 pairs), which `kernels=\"auto\"` picks wherever it can be built.", ""]
    lines += deterministic_section(res.get("deterministic"))
    lines += speculative_section(res.get("speculative"))
    if sc.get("grid"):
        ms, tok = scaling_tables(sc)
        have_png = plot(sc, png)
        lines += ["## Decode scaling", "",
                  "One decode forward (model only) with every row at the given context; each row's K/V in",
                  "its own blocks. Milliseconds per step:", "", *ms, "", "Generated tokens per second:", "", *tok,
                  "", *knee(sc), ""]
        if have_png:
            lines += [f"![decode step time and throughput by batch and context](bench/{png.name})", ""]
    if ours:
        lines += ["## Earlier figures", "",
                  "An earlier version of this page was measured on a 2-core host without bf16 instructions,",
                  "with both peers in bf16. There torch's bf16 matrix products take a slow generic path (vLLM's",
                  "CPU build logs that it cannot create its oneDNN bf16 linear and falls back to torch's), so",
                  "its ratios (5.69x faster than vLLM on `mixed`, 7.84x on `seed`) measured the peers' fallback,",
                  "not the peers. On such a host a user runs the peers in float32; measured that way in one",
                  "sitting, qwen-npu was 1.29x faster than vLLM on `mixed` and 2.05x on `seed`. The tables above",
                  "run the peers in the dtype a user would pick on the machine measured.", ""]
    extra = extra_results() if extra is None else extra
    if extra:
        lines += ["## Other machines", "",
                  "Each measured in one sitting (`run_benchmarks.py --results docs/bench/results-NAME.json`),",
                  "every run of ours beside the limits it measured itself. Raw figures: "
                  + ", ".join(f"[`bench/{p.name}`](bench/{p.name})" for p in extra) + ".", ""]
    for path in extra:
        lines += machine_section(json.loads(path.read_text()))
    lines += [FAST, ROUTING]
    md.write_text("\n".join(lines))
