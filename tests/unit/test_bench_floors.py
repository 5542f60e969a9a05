"""The machine's floors of `qwen-npu bench`: what is measured and the decode floors worked out from it."""
from __future__ import annotations

import pytest
import torch

from qwen_npu.tools import bench_floors
from qwen_npu.testing import make_tiny_qwen3


def test_decode_floors_are_bytes_over_bandwidth_and_flops_over_rate():
    floors = {"read_gb_s": 20.0, "fp32_gflops": 100.0}
    out = bench_floors.decode_floors(floors, weight_bytes=2_000_000_000, weight_params=500_000_000, batches=(1, 16))
    assert out["b1_read_ms"] == pytest.approx(100.0)                  # 2 GB at 20 GB/s
    assert out["b1_compute_ms"] == pytest.approx(10.0)                # 1 GFLOP at 100 GFLOP/s
    assert out["b16_compute_ms"] == pytest.approx(160.0)
    assert out["weight_bytes"] == 2_000_000_000 and out["weight_params"] == 500_000_000


def test_measure_reports_rates_and_the_faster_dtype(monkeypatch):
    monkeypatch.setattr(bench_floors, "READ_BYTES", 1 << 20)
    monkeypatch.setattr(bench_floors, "FP32_SHAPE", (16, 32, 32))
    monkeypatch.setattr(bench_floors, "BF16_SHAPE", (16, 32, 32))
    f = bench_floors.measure()
    assert f["read_gb_s"] > 0 and f["fp32_gflops"] > 0 and f["bf16_gflops"] > 0
    assert f["peer_dtype"] in ("float32", "bfloat16") and f["threads"] == torch.get_num_threads()
    rates = {torch.float32: 80.0, torch.bfloat16: 190.0}
    monkeypatch.setattr(bench_floors, "gemm_rate", lambda dtype, *shape, **kw: rates[dtype])
    monkeypatch.setattr(bench_floors, "compute_peaks", lambda: {"avx2_fma": 160.0, "avx512_fma": 320.0})
    f = bench_floors.measure()
    assert (f["fp32_gflops"], f["bf16_gflops"], f["peer_dtype"]) == (80.0, 190.0, "bfloat16")
    assert (f["peak_gflops"], f["peak_kind"]) == (320.0, "avx512_fma")
    # a product measured faster than the loop (a disturbed loop, or no loop at all) is the limit
    monkeypatch.setattr(bench_floors, "compute_peaks", lambda: {"avx2_fma": 150.0})
    f = bench_floors.measure()
    assert (f["peak_gflops"], f["peak_kind"]) == (190.0, "torch bf16 product")
    monkeypatch.setattr(bench_floors, "compute_peaks", dict)
    assert bench_floors.measure()["peak_kind"] == "torch bf16 product" and f["peaks"] == {"avx2_fma": 150.0}


def test_the_peer_dtype_follows_the_faster_product(monkeypatch):
    rates = {torch.float32: 80.0, torch.bfloat16: 5.0}
    monkeypatch.setattr(bench_floors, "gemm_rate", lambda dtype, *shape, **kw: rates[dtype])
    assert bench_floors.user_dtype("cpu") == "float32"
    rates[torch.bfloat16] = 190.0
    assert bench_floors.user_dtype("cpu") == "bfloat16"
    assert bench_floors.user_dtype("cuda:0") == "bfloat16"


def test_model_weights_counts_every_tensor_read_by_a_decode_step(tmp_path):
    from qwen_npu import Session
    path = make_tiny_qwen3(tmp_path / "m", vocab_size=512, dtype=torch.bfloat16)
    sess = Session.from_pretrained(path, kernels="reference")
    try:
        nbytes, params = bench_floors.model_weights(sess.model)
        m = sess.model
        layers = [t for layer in m.layers for t in vars(layer).values()]
        matrices = sum(t.numel() for t in layers if t.dim() == 2)
        assert params == matrices + 512 * 64                          # the layers' matrices + the LM head
        assert nbytes == 2 * sum(t.numel() for t in layers) + 2 * 512 * 64 + 2 * 64
        cfg = sess.model_config
        per_layer = 64 * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim \
            + cfg.num_attention_heads * cfg.head_dim * 64 + 3 * 64 * cfg.intermediate_size
        assert matrices == cfg.num_hidden_layers * per_layer
    finally:
        sess.close()


def test_for_run_gives_the_probes_ratios_to_their_floors(monkeypatch, tmp_path):
    from qwen_npu import Session
    monkeypatch.setattr(bench_floors, "measure", lambda: {"read_gb_s": 10.0, "fp32_gflops": 50.0})
    path = make_tiny_qwen3(tmp_path / "m", vocab_size=512, dtype=torch.bfloat16)
    sess = Session.from_pretrained(path, kernels="reference")
    try:
        out = bench_floors.for_run(sess.model, {"decode_ms_b1": 2.0, "decode_ms_b16": 4.0})
        assert "decode_b1_vs_floor" not in bench_floors.for_run(sess.model, {})
    finally:
        sess.close()
    f = out["floors"]
    assert out["decode_b1_vs_floor"] == pytest.approx(2.0 / f["b1_read_ms"], rel=0.02)
    assert out["decode_b16_vs_floor"] == pytest.approx(4.0 / f["b16_floor_ms"], rel=0.02)


def test_decode_floors_divide_by_the_peak_when_there_is_one():
    floors = {"read_gb_s": 20.0, "fp32_gflops": 100.0, "peak_gflops": 400.0}
    out = bench_floors.decode_floors(floors, weight_bytes=2_000_000_000, weight_params=500_000_000, batches=(16,))
    assert out["b16_compute_ms"] == pytest.approx(40.0)              # 16 GFLOP at 400 GFLOP/s, not at 100
    assert out["b16_floor_ms"] == pytest.approx(100.0)               # the 2 GB read takes longer


def test_the_workload_floor_is_the_larger_of_read_and_compute_per_step():
    floors = {"read_gb_s": 10.0, "peak_gflops": 100.0}
    shape = {"layer_bytes": 1e9, "layer_params": 5e8, "head_bytes": 2e8, "head_params": 1e8}
    decode = (16, 16)            # read 1.2 GB = 0.12 s; compute 2 * (16 * 5e8 + 16 * 1e8) = 19.2 GFLOP = 0.192 s
    prefill = (512, 0)           # no logits rows: read 0.1 s; compute 512 GFLOP = 5.12 s
    batch1 = (1, 1)              # read 0.12 s; compute 1.2 GFLOP = 0.012 s
    got = bench_floors.workload_floor(floors, shape, [decode, prefill, batch1])
    assert got == pytest.approx(0.192 + 5.12 + 0.12)


def test_compute_peaks_measure_the_kinds_the_cpu_has(monkeypatch):
    from qwen_npu.kernels import cpu, cpu_features
    if not cpu.available():
        pytest.skip(f"the cpu kernels cannot be built here: {cpu.availability()[1]}")
    peaks = bench_floors.compute_peaks(iters=200_000, reps=1)
    assert set(peaks) <= set(bench_floors.PEAK_KINDS) and peaks["avx2_fma"] > 0
    assert ("avx512_bf16_dot" in peaks) == cpu_features.avx512_bf16()
    assert ("avx512_fma" in peaks) == ("avx512f" in cpu_features.cpu_flags())
    # a limit, not a product: on one core no torch float32 product gets near twice the peak (the
    # loose bound absorbs a noisy machine; a loop that ran at a fraction of the units would fail)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peak1 = max(bench_floors.compute_peaks(iters=2_000_000, reps=3).values())
        torch_rate = bench_floors.gemm_rate(torch.float32, 256, 1024, 1024, reps=3)
    finally:
        torch.set_num_threads(threads)
    assert peak1 > 0.5 * torch_rate, (peak1, torch_rate)


def test_compute_peaks_under_the_avx2_cap_measure_only_avx2(monkeypatch):
    from qwen_npu.kernels import cpu, cpu_features
    if not cpu.available():
        pytest.skip(f"the cpu kernels cannot be built here: {cpu.availability()[1]}")
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    cpu_features.cpu_flags.cache_clear()
    try:
        assert set(bench_floors.compute_peaks(iters=100_000, reps=1)) == {"avx2_fma"}
    finally:
        monkeypatch.delenv(cpu_features.ISA_ENV)
        cpu_features.cpu_flags.cache_clear()


def test_for_run_gives_prefill_decode_and_workload_shares(monkeypatch, tmp_path):
    from qwen_npu import Session
    monkeypatch.setattr(bench_floors, "measure", lambda: {"read_gb_s": 10.0, "fp32_gflops": 50.0,
                                                          "peaks": {"avx2_fma": 100.0}})
    path = make_tiny_qwen3(tmp_path / "m", vocab_size=512, dtype=torch.bfloat16)
    sess = Session.from_pretrained(path, kernels="reference")
    try:
        shape = bench_floors.model_shape(sess.model)
        result = {"decode_ms_b1": 2.0, "decode_ms_b16": 4.0, "prefill_tokens": 1000, "prefill_s": 0.5,
                  "seconds": 3.0}
        out = bench_floors.for_run(sess.model, result, [(1000, 2), (16, 16)])
    finally:
        sess.close()
    f = out["floors"]
    assert f["b16_floor_ms"] == max(f["b1_read_ms"], f["b16_compute_ms"])
    assert out["decode_b16_share"] == pytest.approx(f["b16_floor_ms"] / 4.0, rel=0.02)
    rate = 2 * 1000 * shape["layer_params"] / 0.5 / 1e9
    assert out["prefill_gflops"] == pytest.approx(rate, rel=1e-3)
    assert out["prefill_share"] == pytest.approx(rate / 100.0, rel=1e-2)
    floor = bench_floors.workload_floor(f, shape, [(1000, 2), (16, 16)])
    assert out["workload_floor_s"] == pytest.approx(floor, rel=1e-3)
    assert out["workload_share"] == pytest.approx(floor / 3.0, rel=1e-3)


def test_the_limit_follows_the_model_dtype():
    floors = {"peaks": {"avx2_fma": 160.0, "avx512_fma": 320.0, "avx512_bf16_dot": 150.0, "amx_bf16": 3000.0},
              "fp32_gflops": 250.0, "bf16_gflops": 900.0}
    assert bench_floors.usable_peak(floors, torch.float32) == (320.0, "avx512_fma")      # no bf16 units
    assert bench_floors.usable_peak(floors, torch.bfloat16) == (3000.0, "amx_bf16")
    floors["peaks"] = {"avx2_fma": 100.0}
    assert bench_floors.usable_peak(floors, torch.float32) == (250.0, "torch float32 product")


def test_for_run_takes_the_probe_batch_and_the_model_dtype(monkeypatch, tmp_path):
    from qwen_npu import Session
    monkeypatch.setattr(bench_floors, "measure", lambda: {
        "read_gb_s": 10.0, "fp32_gflops": 50.0, "bf16_gflops": 400.0,
        "peaks": {"avx2_fma": 100.0, "amx_bf16": 4000.0}, "peak_gflops": 4000.0, "peak_kind": "amx_bf16"})
    path = make_tiny_qwen3(tmp_path / "m", vocab_size=512, dtype=torch.float32)
    sess = Session.from_pretrained(path, kernels="reference")
    try:
        out = bench_floors.for_run(sess.model, {"decode_ms_b1": 2.0, "decode_ms_b16": 4.0}, batch=4)
        params = bench_floors.model_weights(sess.model)[1]
    finally:
        sess.close()
    f = out["floors"]
    assert (f["peak_gflops"], f["peak_kind"]) == (100.0, "avx2_fma")                  # a float32 model
    assert f["b4_compute_ms"] == pytest.approx(2 * 4 * params / 100e9 * 1e3, abs=0.006)
    assert f["b16_floor_ms"] == f["b4_floor_ms"] and "b16_compute_ms" in f          # the probe's batch


def test_a_runs_limits_are_the_higher_of_before_and_after_and_keep_both():
    before = {"read_gb_s": 30.0, "fp32_gflops": 100.0, "bf16_gflops": 300.0, "load": 0.5,
              "peaks": {"avx2_fma": 180.0, "amx_bf16": 2000.0}, "peak_gflops": 2000.0, "peak_kind": "amx_bf16"}
    after = {"read_gb_s": 20.0, "fp32_gflops": 120.0, "bf16_gflops": 250.0, "load": 1.5,
             "peaks": {"avx2_fma": 200.0, "amx_bf16": 1500.0}, "peak_gflops": 1500.0, "peak_kind": "amx_bf16"}
    f = bench_floors.higher_of(before, after)
    assert (f["read_gb_s"], f["fp32_gflops"], f["bf16_gflops"]) == (30.0, 120.0, 300.0)
    assert f["peaks"] == {"avx2_fma": 200.0, "amx_bf16": 2000.0} and f["load"] == 1.5
    assert (f["peak_gflops"], f["peak_kind"]) == (2000.0, "amx_bf16")
    assert f["drift"] == {"read_gb_s": [30.0, 20.0], "peak_gflops": [2000.0, 1500.0]}
    # a float32 model's limit and drift leave out the bf16 instructions
    f = bench_floors.higher_of(before, after, torch.float32)
    assert (f["peak_gflops"], f["peak_kind"]) == (200.0, "avx2_fma")
    assert f["drift"]["peak_gflops"] == [180.0, 200.0]
    assert before["read_gb_s"] == 30.0 and after["read_gb_s"] == 20.0      # the inputs are left as they were


def test_the_report_says_when_the_limits_moved_during_the_run():
    from qwen_npu.tools import bench_report
    f = {"read_gb_s": 30.0, "fp32_gflops": 100.0, "bf16_gflops": 300.0, "load": 0.5, "peaks": {"avx2_fma": 200.0},
         "peak_gflops": 200.0, "peak_kind": "avx2_fma",
         "drift": {"read_gb_s": [30.0, 29.0], "peak_gflops": [200.0, 190.0]}}
    line = bench_report.limit_lines({"floors": f})[1]
    assert line == ("  limits     before / after the run: read 30.0 / 29.0 GB/s, peak 200 / 190 GFLOP/s; "
                    "each limit is the higher")
    f["drift"]["peak_gflops"] = [200.0, 150.0]                 # 25% apart: flagged
    line = bench_report.limit_lines({"floors": f})[1]
    assert line.endswith("each limit is the higher (they moved 25%: a busy machine, the shares are approximate)")
    del f["drift"]
    assert len(bench_report.limit_lines({"floors": f})) == 1    # a run measured once says nothing of it


def test_limits_measured_apart_run_in_a_child_with_this_process_settings(small_floors):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        f = bench_floors.measure_apart()
    finally:
        torch.set_num_threads(threads)
    assert f["threads"] == 1 and f["read_gb_s"] > 0 and f["fp32_gflops"] > 0
    assert (f["peak_gflops"], f["peak_kind"]) == bench_floors.usable_peak(f, torch.bfloat16)


def test_a_failed_or_stuck_child_is_an_error_that_says_so(monkeypatch):
    monkeypatch.setattr(bench_floors.sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match=r"child process failed \(exit 1\)"):
        bench_floors.measure_apart()
    monkeypatch.setattr(bench_floors.sys, "executable", "/bin/true")    # exits 0 and says nothing
    with pytest.raises(RuntimeError, match="gave no limits"):
        bench_floors.measure_apart()
    monkeypatch.undo()
    monkeypatch.setattr(bench_floors, "PEAK_ITERS", 10 ** 13)     # a loop of hours: the child is stopped
    with pytest.raises(RuntimeError, match="took longer than 2 s"):
        bench_floors.measure_apart(timeout_s=2)
