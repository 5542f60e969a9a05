"""docs/benchmarks.md is written from results.json: the peers in the user's dtype as the headline,
the mixed-steps run beside it, and the decode probes as ratios to the machine's floors."""
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "docs" / "bench"


@pytest.fixture
def render(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    for name in ("render_benchmarks", "render_floors", "render_machines", "page_text", "run_benchmarks", "profile_steps"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import render_benchmarks

    def page(res, md, png, extra=()):
        return render_benchmarks.render(res, md, png, extra=list(extra))
    return page


def run(seconds, out_tok_s=10.0, **extra):
    return {"seconds": seconds, "out_tok_s": out_tok_s, **extra}


FLOORS = {"read_gb_s": 30.0, "fp32_gflops": 200.0, "bf16_gflops": 400.0, "peer_dtype": "bfloat16",
          "load": 0.5, "weight_bytes": 1.2e9, "weight_params": 6e8, "b1_read_ms": 40.0, "b1_compute_ms": 6.0,
          "b16_compute_ms": 96.0}
RESULTS = {
    "machine": {"cpu": "Test CPU", "cores": 2, "torch": "2.13.0+cpu", "threads": 2, "cpu_capability": "AVX512"},
    "measured": {"workloads": "2026-12-01 17:00"},
    "floors": FLOORS,
    "workloads": {
        "mixed": run(50.0, decode_ms_b1=60.0, decode_ms_b16=120.0,
                     hf={"seconds": 150.0, "out_tok_s": 3.0, "dtype": "bfloat16"}),
        "seed": run(10.0, decode_ms_b1=50.0, decode_ms_b16=110.0,
                    hf={"seconds": 40.0, "out_tok_s": 2.0, "dtype": "bfloat16"}),
        "mixed, mixed steps": run(40.0),
    },
    "vllm": {"bfloat16": {"mixed": run(100.0), "seed": run(35.0)}},
}


def test_the_page_leads_with_the_peers_in_the_users_dtype_and_the_mixed_steps_run(render, tmp_path):
    md = tmp_path / "benchmarks.md"
    render(RESULTS, md, tmp_path / "plot.png")
    page = md.read_text()
    lines = page.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| workload | qwen-npu |"))
    assert "vLLM CPU 0.32, bfloat16" in lines[head] and "Hugging Face generate, bfloat16" in lines[head]
    mixed, mixed_steps, seed = lines[head + 2:head + 5]
    assert mixed.startswith("| `mixed`") and "50.0 s" in mixed and "**2.00x faster**" in mixed   # 100 / 50
    assert "`mixed_steps=True`" in mixed_steps and "40.0 s" in mixed_steps
    assert "**2.50x faster**" in mixed_steps and "**3.75x faster**" in mixed_steps             # 100 / 40, 150 / 40
    assert seed.startswith("| `seed`") and "**3.50x faster**" in seed and "**4.00x faster**" in seed
    # the decode probes against the floors: read floor for batch 1, float32 and bf16 rates for batch 16
    assert "| batch 1, whole step (`mixed` run's probe) | weights read at the measured bandwidth | 40.0 | 60.0 | 1.50x |" in page
    assert "| batch 16, whole step (`seed` run's probe) | products at the float32 rate | 96.0 | 110.0 | 1.15x |" in page
    assert "| batch 16, whole step (`seed` run's probe) | products at the bf16 rate | 48.0 | 110.0 | 2.29x |" in page


def test_a_page_without_the_mixed_steps_run_has_no_row_for_it(render, tmp_path):
    res = {**RESULTS, "workloads": {k: v for k, v in RESULTS["workloads"].items() if k != "mixed, mixed steps"}}
    md = tmp_path / "benchmarks.md"
    render(res, md, tmp_path / "plot.png")
    assert "| `mixed` with `mixed_steps=True`" not in md.read_text()      # no row (the prose may name it)


def test_another_machine_gets_its_section_with_every_run_beside_its_limits(render, tmp_path):
    limits = {"read_gb_s": 20.0, "peaks": {"avx2_fma": 160.0, "amx_bf16": 3000.0}, "peak_gflops": 3000.0,
              "peak_kind": "amx_bf16", "fp32_gflops": 150.0, "bf16_gflops": 600.0, "peer_dtype": "bfloat16",
              "drift": {"read_gb_s": [18.5, 20.0], "peak_gflops": [3000.0, 2400.0]}}
    mem = {"weights": 2**30, "kv_cache": 2**29, "buffers": 2**25, "before_load": 2**28}
    other = {"machine": {"cpu": "Other CPU", "cores": 2, "torch": "2.13.0+cpu", "threads": 2,
                         "cpu_capability": "AVX512", "isa_cap": None},
             "measured": {"workloads": "2026-12-02 00:30"},
             "workloads": {"mixed": run(60.0, floors=limits, prefill_gflops=300.0, prefill_share=0.1,
                                        decode_b1_vs_floor=1.1, decode_b16_share=0.5, workload_share=0.35,
                                        decode_host_ms_b16=2.5, decode_host_share_b16=0.018,
                                        peak_rss_bytes=2 * 2**30, memory=mem)},
             "vllm": {"bfloat16": {"mixed": run(40.0)}}}
    path = tmp_path / "results-other.json"
    import json
    path.write_text(json.dumps(other))
    md = tmp_path / "benchmarks.md"
    render(RESULTS, md, tmp_path / "plot.png", extra=[path])
    page = md.read_text()
    assert "### Other CPU, 2 cores" in page
    assert "| `mixed` | 60.0 s (10.0 out tok/s) | 40.0 s | 1.50x slower |" in page
    assert "(the limit is the fastest, or a product measured faster: **3000**, amx_bf16)" in page
    assert ("before and after itself and divides by the higher of each: across the runs, reading memory "
            "18.5-20.0 GB/s and the limit 2400-3000 GFLOP/s.") in page
    # 2 GiB peak = 1 + 0.5 + 0.03 + 0.25 GiB, rest 0.22 GiB (11%)
    assert "| `mixed` | 300 (10%) | 1.10x | 50% | 35% | 2.50 (1.8%) | 2.00: 1.00 + 0.50 + 0.03 + 0.25, rest 0.22 (11%) |" in page
