"""`qwen-npu bench`: the shared workloads and the report's fields (tiny checkpoint, no timings checked)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from qwen_npu.tools import bench_floors
from qwen_npu.tools import workloads
from qwen_npu.tools.bench import run_bench
from qwen_npu.tools.cli import main
from qwen_npu.errors import InvalidRequestError

SHARED_WORKLOADS = Path(__file__).resolve().parents[3] / "shared" / "peers" / "workloads.py"
RUN = ["--prompt-len", "8", "--output-len", "3", "--num-requests", "3"]


def test_the_workloads_have_their_documented_shape():
    mixed, seed = workloads.mixed(), workloads.seed_like()
    assert mixed == workloads.mixed() and len(mixed) == 32             # deterministic
    assert all(64 <= len(p) <= 512 and 32 <= n <= 128 for p, n in mixed)
    assert workloads.summary(mixed) == {"requests": 32, "prompt_tokens": 9502, "output_tokens": 2392}
    assert len(seed) == 16 and all(p == seed[0][0] and n == 64 for p, n in seed) and len(seed[0][0]) == 512
    assert seed[0][0] is not seed[1][0]                                  # copies, not one shared list
    ids = [t for p, _ in mixed + seed for t in p]
    assert min(ids) >= workloads.TOKEN_LOW and max(ids) < workloads.TOKEN_HIGH


@pytest.mark.skipif(not SHARED_WORKLOADS.is_file(), reason="the peers' workloads.py is not next to this checkout")
def test_the_workloads_are_token_for_token_those_the_peers_run():
    spec = importlib.util.spec_from_file_location("peer_workloads", SHARED_WORKLOADS)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    assert peer.WORKLOADS["mixed"]() == workloads.mixed()
    assert peer.WORKLOADS["seed"]() == workloads.seed_like()


def run_cli(capsys, *args) -> str:
    assert main(["bench", *args]) == 0
    return capsys.readouterr().out


def test_json_report_has_the_figures_and_the_hf_comparison(tiny_ckpt, capsys, small_floors):
    out = run_cli(capsys, "--model", str(tiny_ckpt), *RUN, "--json", "--compare", "hf")
    lines = out.strip().splitlines()
    assert len(lines) == 1                                               # one compact line, nothing else
    r = json.loads(lines[0])
    assert r["workload"] == "custom" and r["requests"] == 3
    assert r["out_tokens"] == 9 and r["prompt_tokens"] == 24 and r["prefill_tokens"] == 24
    for key in ("seconds", "out_tok_s", "total_tok_s", "prefill_tok_s", "decode_ms_b1", "decode_ms_b16"):
        assert r[key] > 0, key
    # "seconds" is rounded to the millisecond, the rates are not: compare within that rounding
    assert 9 / r["out_tok_s"] == pytest.approx(r["seconds"], rel=0.01, abs=6e-4)
    assert 33 / r["total_tok_s"] == pytest.approx(r["seconds"], rel=0.01, abs=6e-4)
    assert r["peak_rss_bytes"] > 1 << 20
    assert r["d2h_bytes_per_token"] == 8.0                               # only the int64 token ids cross
    assert r["decode_steps"] == 2                                        # 3 tokens: 1 from prefill + 2 decodes
    hf = r["hf"]
    assert hf["engine"] == "hf-generate" and hf["out_tokens"] == 9 and hf["seconds"] > 0
    assert r["hf_ratio"] == pytest.approx(hf["seconds"] / r["seconds"], rel=0.02, abs=0.01)
    f = r["floors"]
    assert f["read_gb_s"] > 0 and f["fp32_gflops"] > 0 and f["bf16_gflops"] > 0
    # measured before and after the run: each limit the higher of the two, both kept
    assert f["read_gb_s"] == max(f["drift"]["read_gb_s"]) and len(f["drift"]["read_gb_s"]) == 2
    assert f["peak_gflops"] >= max(f["drift"]["peak_gflops"]) and min(f["drift"]["peak_gflops"]) > 0
    assert f["peer_dtype"] in ("float32", "bfloat16")
    assert hf["dtype"] == f["peer_dtype"]                                # the peer in the user's dtype
    # the floors and ratios are rounded to 0.01: compare at that rounding, inputs' rounding included
    assert f["b1_read_ms"] == pytest.approx(f["weight_bytes"] / f["read_gb_s"] / 1e6, abs=0.0051)
    # the compute floor divides by the limit usable in the model's dtype, not by torch's product
    assert (f["peak_gflops"], f["peak_kind"]) == bench_floors.usable_peak(f, getattr(torch, r["dtype"]))
    assert f["b16_compute_ms"] == pytest.approx(32 * f["weight_params"] / f["peak_gflops"] / 1e6, abs=0.0051)
    assert f["b16_floor_ms"] == max(f["b1_read_ms"], f["b16_compute_ms"])
    assert_ratio_at_rounding(r["decode_b1_vs_floor"], r["decode_ms_b1"], f["b1_read_ms"])
    assert_ratio_at_rounding(r["decode_b16_vs_floor"], r["decode_ms_b16"], f["b16_floor_ms"])
    assert r["decode_b16_share"] == pytest.approx(f["b16_floor_ms"] / r["decode_ms_b16"], rel=0.01)
    # shares of limits measured on a busy machine may exceed 1: check how they are formed, not their size
    assert r["prefill_share"] > 0 and r["workload_floor_s"] > 0
    assert r["workload_share"] == pytest.approx(r["workload_floor_s"] / r["seconds"], rel=0.01)
    # host time: the step less its forward, never more than the step
    assert 0 < r["decode_host_ms_b16"] <= r["decode_ms_b16"] and 0 < r["decode_host_ms_b1"] <= r["decode_ms_b1"]
    m = r["memory"]
    assert m["weights"] > 0 and m["kv_cache"] > 0 and m["buffers"] > 0 and 0 < m["before_load"] < r["peak_rss_bytes"]


def assert_ratio_at_rounding(ratio, num, den, step=0.01):
    """``ratio`` is round(a / b, 2) for some a, b that round to ``num``, ``den`` at ``step``."""
    half = step / 2
    lo, hi = (num - half) / (den + half), (num + half) / max(den - half, 1e-12)
    assert lo - half - 1e-9 <= ratio <= hi + half + 1e-9, (ratio, num, den)


def test_ratio_at_rounding_accepts_only_what_the_rounding_allows():
    assert_ratio_at_rounding(0.09, 7.71, 87.87)              # 0.0877 rounds to 0.09
    with pytest.raises(AssertionError):
        assert_ratio_at_rounding(0.10, 7.71, 87.87)


def test_the_peer_runs_in_both_dtypes_labelled(tiny_ckpt, capsys, small_floors):
    out = run_cli(capsys, "--model", str(tiny_ckpt), *RUN, "--no-probes", "--compare", "hf", "--peer-dtype", "both")
    runs = [line for line in out.splitlines() if line.startswith("  vs hf")]
    assert len(runs) == 2 and "in float32" in out and "in bfloat16" in out
    assert "  limits     read" in out and "vs limits  decode" not in out         # no probes, no decode ratios
    r = run_bench([([300] * 8, 2)], model=tiny_ckpt, compare="hf", peer_dtype="float32", probes=False,
                  floors=False)
    assert r["hf"]["dtype"] == "float32" and "floors" not in r and "hf_by_dtype" not in r


def test_an_unknown_peer_dtype_is_refused_before_anything_runs(tiny_ckpt):
    with pytest.raises(InvalidRequestError, match="peer_dtype='float16'"):
        run_bench([([300] * 8, 2)], model=tiny_ckpt, compare="hf", peer_dtype="float16")

def test_text_report_names_every_figure(tiny_ckpt, capsys):
    out = run_cli(capsys, "--model", str(tiny_ckpt), *RUN, "--no-probes", "--no-floors", "--kernels", "reference")
    assert out.startswith("qwen-npu bench: workload custom (3 requests, 24 prompt + 9 output tokens)")
    for words in ("kernels reference", "output tok/s", "total tok/s", "prefill    24 tokens computed",
                  "decode     2 steps", "peak resident", "B device-to-host per generated token"):
        assert words in out, words
    assert "vs hf" not in out and "per step at context" not in out and "floors" not in out


@pytest.mark.parametrize("args, message", [
    (["--prompt-len", "8"], "needs --prompt-len, --output-len"),
    (["--workload", "seed", "--prompt-len", "8", "--output-len", "2"], "not both"),
    (["--prompt-len", "0", "--output-len", "2"], "each >= 1"),
])
def test_bad_arguments_are_refused_with_a_reason(tiny_ckpt, args, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "--model", str(tiny_ckpt), *args])


def test_a_checkpoint_without_the_qwen3_vocabulary_is_refused(tiny_ckpt_small_vocab):
    with pytest.raises(SystemExit, match="vocabulary has 512"):
        main(["bench", "--model", str(tiny_ckpt_small_vocab), "--workload", "seed"])


def test_text_report_gives_every_figure_beside_its_limit(tiny_ckpt, capsys, small_floors):
    out = run_cli(capsys, "--model", str(tiny_ckpt), *RUN)
    for words in ("  host       outside the forward: batch 1 ", "% of its step)",
                  "  limits     read ", "compute limit ", "  vs limits  prefill ", "% of the peak",
                  "  vs limits  decode batch 1 ", "x the read floor", "% of its limit",
                  "  vs limits  the workload's floor ", "% of the run",
                  "  limits     before / after the run: read ", "; each limit is the higher",
                  "= before load ", ", weights ", ", KV cache ", ", buffers ", ", rest ", "resident at the end"):
        assert words in out, words


def test_the_limits_measured_before_the_run_are_not_in_its_peak_memory(tiny_ckpt):
    """The read bandwidth's buffer (here 1.5 GiB) is measured before the run in a child process, so
    the run's peak resident memory, in a fresh process, stays far below weights + KV + buffers +
    the process before load + that buffer."""
    import subprocess
    import sys
    script = (
        "import json\n"
        "from qwen_npu.tools import bench_floors\n"
        "from qwen_npu.tools.bench import run_bench\n"
        "bench_floors.READ_BYTES = 1536 << 20\n"
        "bench_floors.FP32_SHAPE = bench_floors.BF16_SHAPE = (64, 128, 128)\n"
        "bench_floors.REPS, bench_floors.PEAK_ITERS = 1, 100_000\n"
        "work = [([11 + i] * 8, 3) for i in range(3)]\n"
        f"r = run_bench(work, model={str(tiny_ckpt)!r}, probes=False)\n"
        "m = r['memory']\n"
        "print(json.dumps({'rest': r['peak_rss_bytes'] - m['before_load'] - m['weights'] - m['kv_cache']"
        " - m['buffers'], 'drift': r['floors']['drift']}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(out["drift"]["read_gb_s"]) == 2                 # it was measured before the run as well
    assert out["rest"] < 768 << 20, out      # and its 1.5 GiB are not in the peak (the rest: torch's own)


def test_a_failed_measurement_before_the_run_leaves_the_run_and_says_so(tiny_ckpt, capsys, small_floors,
                                                                     monkeypatch):
    def fail():
        raise RuntimeError("measuring the machine's limits in a child process failed (exit 1): boom")
    monkeypatch.setattr(bench_floors, "measure_apart", fail)
    out = run_cli(capsys, "--model", str(tiny_ckpt), *RUN)
    assert ("  limits     measuring the machine's limits in a child process failed (exit 1): boom; the limits "
            "were measured after the run only") in out
    assert "  vs limits  the workload's floor " in out and "before / after the run" not in out
