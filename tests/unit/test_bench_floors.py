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
    f = bench_floors.measure()
    assert (f["fp32_gflops"], f["bf16_gflops"], f["peer_dtype"]) == (80.0, 190.0, "bfloat16")


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
    assert out["decode_b16_vs_floor"] == pytest.approx(4.0 / f["b16_compute_ms"], rel=0.02)
