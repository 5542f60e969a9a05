"""Regenerate docs/benchmarks.md: both shared workloads beside the peers, the machine's floors, decode scaling.

    python docs/bench/run_benchmarks.py                      # everything (two hours or more on 2 cores)
    python docs/bench/run_benchmarks.py --only scaling       # one part; the others come from results.json
    python docs/bench/run_benchmarks.py --only render        # rewrite the page from results.json

A smoke run of the harness (a few minutes; tiny model, nothing under docs/ touched):

    python -c "from qwen_npu.testing import make_tiny_qwen3; make_tiny_qwen3('/tmp/tiny', vocab_size=151936)"
    python docs/bench/run_benchmarks.py --model /tmp/tiny --only floors --only workloads \
        --only vllm --results /tmp/bench.json --page /tmp/bench.md

Parts, each saved into the results file (default docs/bench/results.json) as it finishes:
  floors     the machine's floors (qwen_npu/tools/bench_floors.py): read bandwidth over 1 GiB, torch's
             float32 and bf16 product rates, and the dtype a user would run the peers in here
             (bfloat16 only where torch's bf16 product is the faster: native bf16 instructions)
  workloads  `qwen-npu bench --workload W --json --compare hf --peer-dtype D` in a fresh process
             per workload (with its own floors and the decode probes' ratios to them)
  vllm       the vLLM CPU build on the same workloads (peers/bench_vllm.py in its own virtual
             environment, as peers/run-peers sets it up), once per peer dtype (PEER_DTYPE);
             skipped when that environment is missing
  profile    where the time of a step goes (docs/bench/profile_steps.py), by kernel set: decode at
             batch 1 and 16 (context 128) and one 512-token prefill
  scaling    one decode forward for batch 1..16 x context 128..4096 (KV blocks of distinct memory
             per row, filled with random values), the same at batch 1 / 16 by kernel set, and the
             floors again (read bandwidth, float32 rate) for the ratios of those forwards
Then the page and the plot (docs/bench/decode_scaling.png) are written from the results. The
stderr of every run goes to $TMPDIR/qwen-npu-bench/.

--peer-dtype: both (default: the peers in float32 and in bf16, the user's choice as the headline,
the other labelled beside it), auto (only the user's choice), float32 or bfloat16.
Keep the machine otherwise idle while it runs: every figure is a wall-clock time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = HERE / "results.json"
PAGE = ROOT / "docs" / "benchmarks.md"
PARTS = ["floors", "workloads", "profile", "scaling", "deterministic", "speculative", "vllm"]
LOGS = Path(tempfile.gettempdir()) / "qwen-npu-bench"          # each run's stderr
PEERS = ROOT.parent / "shared" / "peers"
VLLM_PY = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwen-npu-peers" / "vllm" / "bin" / "python"
BATCHES = (1, 2, 4, 8, 16)
CONTEXTS = (128, 256, 512, 1024, 2048, 4096)
REPS = 5
MIXED_STEPS = "mixed, mixed steps"          # results key: the mixed workload with mixed_steps=True


def machine() -> dict:
    import torch
    from qwen_npu.kernels import cpu_features
    info = {"python": platform.python_version(), "torch": torch.__version__, "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_cap": cpu_features.isa_cap()}
    try:            # the first processor's fields: "model name", "cpu family", "model", "flags", ...
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
        info["cpu"] = fields["model name"]
        if "cpu family" in fields and "model" in fields:      # a virtual machine's model name may say little
            info["cpu_family_model"] = f"family {fields['cpu family']} model {fields['model']}"
        info["bf16_or_amx"] = sorted(f for f in fields["flags"].split()
                                     if "bf16" in f or f.startswith(("amx", "avx512")))
    except (OSError, KeyError):
        pass
    return info


def load() -> float:
    return os.getloadavg()[0]


def run_json(cmd: list[str], log: Path, env=None) -> dict:
    """Run ``cmd``, its stderr into ``log``; the last JSON line it prints."""
    LOGS.mkdir(exist_ok=True)
    with open(log, "w") as err:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}); see {log}")
    return json.loads(lines[-1])


def save(results: dict) -> None:
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def part_floors(model: str, results: dict) -> dict:
    from qwen_npu import Session
    from qwen_npu.tools import bench_floors
    floors = bench_floors.measure()
    sess = Session.from_pretrained(model, kernels="reference", max_model_len=64, num_blocks=8)
    floors.update(bench_floors.decode_floors(floors, *bench_floors.model_weights(sess.model)))
    sess.close()
    print(f"floors: {floors}", flush=True)
    return floors


def peer_dtypes(choice: str, results: dict) -> list[str]:
    """The dtypes to run the peers in, the user's choice on this machine first."""
    from qwen_npu.tools import bench
    from qwen_npu.tools import bench_floors
    user = results.get("floors", {}).get("peer_dtype") or bench_floors.user_dtype("cpu")
    return bench.peer_dtypes(choice, user)


def part_workloads(model: str | None, hf: bool, peer: str, results: dict) -> None:
    out = results.setdefault("workloads", {})
    for w in ("mixed", "seed"):
        cmd = [sys.executable, "-m", "qwen_npu.tools.cli", "bench", "--workload", w, "--json"]
        cmd += ["--model", model] if model else []
        cmd += ["--compare", "hf", "--peer-dtype", peer] if hf else []
        before = load()
        out[w] = run_json(cmd, LOGS / f"{w}.txt")
        out[w]["load_before"], out[w]["load_after"] = round(before, 2), round(load(), 2)
        save(results)
        print(f"{w}: {out[w]['seconds']} s", flush=True)
    # the mixed workload again with decode rows and prefill chunks sharing steps (ours only)
    cmd = [sys.executable, "-m", "qwen_npu.tools.cli", "bench", "--workload", "mixed", "--json", "--mixed-steps",
           "--no-probes", "--no-floors"] + (["--model", model] if model else [])
    before = load()
    out[MIXED_STEPS] = run_json(cmd, LOGS / "mixed-steps.txt")
    out[MIXED_STEPS]["load_before"], out[MIXED_STEPS]["load_after"] = round(before, 2), round(load(), 2)
    save(results)
    print(f"mixed with mixed steps: {out[MIXED_STEPS]['seconds']} s", flush=True)


def part_vllm(model: str, dtypes: list[str], results: dict) -> None:
    if not VLLM_PY.is_file():
        print(f"no vLLM environment at {VLLM_PY}; run {PEERS / 'run-peers'} once to make it", flush=True)
        return
    out = results.setdefault("vllm", {})
    if any("seconds" in v for v in out.values()):                     # the older layout: one bf16 run each
        out = results["vllm"] = {}
    # as run-peers sets it; one model step of the bf16 build can take minutes on a CPU without bf16
    # instructions, so the step timeout is raised from its default of 300 s
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
               VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS="7200")
    for dtype in dtypes:
        runs = out.setdefault(dtype, {})
        for w in ("seed", "mixed"):
            before = load()
            runs[w] = run_json([str(VLLM_PY), str(PEERS / "bench_vllm.py"), model, w],
                               LOGS / f"vllm-{dtype}-{w}.txt", env=dict(env, PEER_DTYPE=dtype))
            runs[w]["load_before"], runs[w]["load_after"] = round(before, 2), round(load(), 2)
            save(results)
            print(f"vllm {dtype} {w}: {runs[w]['seconds']} s", flush=True)


def _decode_ms(model, kv, batch: int, context: int, block_size: int, reps: int = REPS) -> float:
    """Median ms of one decode forward: ``batch`` rows, each at ``context`` cached tokens."""
    import torch
    from qwen_npu.kernels import AttentionMetadata
    per_row = -(-(context + 1) // block_size)
    tables = torch.arange(batch * per_row, dtype=torch.int32).view(batch, per_row)  # distinct blocks per row
    pos = torch.full((batch,), context, dtype=torch.int64)
    slots = tables[:, context // block_size].long() * block_size + context % block_size
    meta = AttentionMetadata(positions=pos, slot_mapping=slots, block_tables=tables,
                             seq_lens=torch.full((batch,), context + 1, dtype=torch.int32),
                             query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
                             query_lens_host=(1,) * batch, seq_lens_host=(context + 1,) * batch, is_decode=True)
    ids = torch.randint(100, 150000, (batch,))
    rows = torch.arange(batch)
    times = []
    with torch.no_grad():
        for i in range(reps + 1):
            t = time.perf_counter()
            model(ids, meta, kv, rows)
            if i:
                times.append(time.perf_counter() - t)
    return round(1e3 * statistics.median(times), 2)


def part_profile(model_dir: str | None) -> dict:
    from profile_steps import profile
    from qwen_npu import Session
    from qwen_npu.tools.bench import ensure_default_model
    path = Path(model_dir) if model_dir else ensure_default_model()
    out = {}
    for kernels in ("cpu", "reference"):
        sess = Session.from_pretrained(path, kernels=kernels, max_model_len=2048, num_blocks=16 * 12)
        out[kernels] = {"decode b1": profile(sess, batch=1, context=128, decode_steps=4),
                        "decode b16": profile(sess, batch=16, context=128, decode_steps=2),
                        "prefill 512": profile(sess, batch=1, context=512, decode_steps=0)}
        print(f"profile {kernels}: {out[kernels]}", flush=True)
        sess.close()
    return out


def part_scaling(model_dir: str | None) -> dict:
    import torch
    from qwen_npu.tools import bench_floors
    from qwen_npu import Session
    from qwen_npu.tools.bench import ensure_default_model
    path = Path(model_dir) if model_dir else ensure_default_model()
    block = 16
    grid, by_kernels = {}, {}
    for kernels in ("cpu", "reference"):
        sess = Session.from_pretrained(path, kernels=kernels, max_model_len=max(CONTEXTS) + block, num_blocks=16)
        model, mc = sess.model, sess.model_config
        contexts = CONTEXTS if kernels == "cpu" else (128,)
        blocks = max(BATCHES) * -(-(max(contexts) + 1) // block)
        pattern = torch.randn(block, mc.num_key_value_heads, mc.head_dim).to(model.dtype)
        kv = []
        for _ in range(mc.num_hidden_layers):
            k = torch.empty(blocks, block, mc.num_key_value_heads, mc.head_dim, dtype=model.dtype)
            k.copy_(pattern.expand_as(k))
            kv.append((k, k.clone()))
        if kernels == "cpu":
            weight_bytes, weight_params = bench_floors.model_weights(model)      # read by one decode step
            for c in contexts:
                for b in BATCHES:
                    grid[f"{b},{c}"] = _decode_ms(model, kv, b, c, block)
                    print(f"scaling batch {b} context {c}: {grid[f'{b},{c}']} ms", flush=True)
        by_kernels[kernels] = {"b1": _decode_ms(model, kv, 1, 128, block, 3),
                               "b16": _decode_ms(model, kv, 16, 128, block, 3)}
        print(f"{kernels}: {by_kernels[kernels]}", flush=True)
        del kv, model
        sess.close()
    return {"grid": grid, "kernels": by_kernels, "read_gb_s": bench_floors.read_bandwidth(),
            "fp32_gflops": bench_floors.gemm_rate(), "weight_bytes": weight_bytes, "weight_params": weight_params,
            "load": round(load(), 2)}


def main(argv=None) -> int:
    global RESULTS                                   # save() writes where --results says
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint (default: the Qwen3-0.6B-shaped random one)")
    p.add_argument("--only", choices=PARTS + ["render"], action="append",
                   help="run this part only (repeatable); the others come from the results file")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face comparison")
    p.add_argument("--peer-dtype", choices=["both", "auto", "float32", "bfloat16"], default="both",
                   help="dtypes of the peers (default both, the user's choice here as the headline)")
    p.add_argument("--results", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    p.add_argument("--page", type=Path, default=PAGE, help=f"page to write (default {PAGE}; the plot beside it)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from qwen_npu.tools.bench import ensure_default_model
    model = args.model or str(ensure_default_model())
    RESULTS = args.results
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    parts = args.only or PARTS
    for part in parts:
        if part == "render":
            continue
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        results.setdefault("measured", {})[part] = stamp
        results["machine"] = machine()
        if part == "floors":
            results["floors"] = part_floors(model, results)
        elif part == "workloads":
            part_workloads(args.model, not args.no_hf, args.peer_dtype, results)
        elif part == "vllm":
            part_vllm(model, peer_dtypes(args.peer_dtype, results), results)
        elif part == "profile":
            results["profile"] = part_profile(args.model)
        elif part == "scaling":
            results["scaling"] = part_scaling(args.model)
        elif part == "deterministic":
            from deterministic_cost import measure
            results["deterministic"] = measure(model)
        elif part == "speculative":
            from speculative_cost import measure as measure_speculation
            results["speculative"] = measure_speculation(model)
        save(results)
    from render_benchmarks import render
    png = args.page.parent / "bench" / "decode_scaling.png"           # the page links bench/decode_scaling.png
    png.parent.mkdir(parents=True, exist_ok=True)
    render(results, args.page, png)
    print(f"wrote {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
