"""Weights as 16-column panels (kernels/panels.py) and their product (csrc/linear_packed.cpp):
the layout, exactness against float64, the same bits for every row count, thread count and
layout of the work, the routing of ``cpu.linear``, clear errors, and a Session that holds its
matrices so (the form the cpu set uses on a CPU without native bf16; forced here on any CPU).
"""
from __future__ import annotations

import pytest
import torch
from test_reference import TOL

from qwen_npu import SamplingParams, Session
from qwen_npu.kernels import cpu, cpu_features, panels
from qwen_npu.model.qwen3 import dense_weight
from qwen_npu.testing import make_tiny_qwen3

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"cpu kernels: {cpu.availability()[1]}")


def _case(rows, n, k, xdtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed + 7 * rows + 13 * n + k)
    x = torch.randn(rows, k, generator=gen).to(xdtype)
    w = (torch.randn(n, k, generator=gen) * 0.2).bfloat16()
    return x, w


def test_a_panel_holds_sixteen_outputs_of_each_k_in_the_widening_order():
    w = torch.arange(32 * 3, dtype=torch.float32).reshape(32, 3).bfloat16()
    p = panels.pack(w)
    assert p.shape == (2, 3, 16) and p.is_contiguous() and p.dtype == torch.bfloat16
    for q in range(2):
        for k in range(3):
            assert [int(v) for v in p[q, k].float()] == [int(w[16 * q + c, k].float()) for c in panels.ORDER]
    assert torch.equal(panels.unpack(p), w) and panels.out_features(p) == 32 and panels.out_features(w) == 32


@pytest.mark.parametrize("weight", [torch.randn(1, 24).bfloat16().expand(48, 24), torch.randn(24, 32).bfloat16().T,
                                    torch.randn(64, 5).bfloat16()[::2]], ids=["rows broadcast", "transposed", "every other row"])
def test_pack_always_makes_contiguous_panels_of_their_own(weight):
    p = panels.pack(weight)
    assert p.is_contiguous() and p.untyped_storage().nbytes() == p.nbytes == weight.numel() * 2
    assert p.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    assert torch.equal(panels.unpack(p), weight)
    x = torch.randn(3, weight.shape[1])
    torch.testing.assert_close(cpu.linear(x, p).double(), x.double() @ weight.double().T, **TOL[torch.float32])


@pytest.mark.parametrize("weight, what", [(torch.zeros(40, 8, dtype=torch.bfloat16), "40, 8"),
                                          (torch.zeros(32, 8), "float32"),
                                          (torch.zeros(32, dtype=torch.bfloat16), "(32,)"),
                                          (torch.zeros(32, 0, dtype=torch.bfloat16), "32, 0")])
def test_pack_refuses_what_it_cannot_hold_and_says_what(weight, what):
    assert not panels.packs(weight)
    with pytest.raises(ValueError, match="multiple of 16 rows") as e:
        panels.pack(weight)
    assert what in str(e.value)


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16, 45, cpu.WIDEN_ROWS, cpu.WIDEN_ROWS + 5])
@pytest.mark.parametrize("n, k", [(16, 1), (80, 520), (64, 40), (48, 7)])
def test_product_on_panels_matches_float64(n, k, rows, xdtype):
    """One row against 4 panels at a time and 5 panels (4 + 1); groups of 6 rows and the rest;
    k in blocks of 256 and a tail (520), k below one vector (1, 7); both layouts of the work."""
    x, w = _case(rows, n, k, xdtype)
    y = cpu.linear(x, panels.pack(w))
    assert y.shape == (rows, n) and y.dtype == xdtype
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, **TOL[xdtype])


@pytest.mark.parametrize("n, k", [(80, 520), (160, 1024), (32, 300)])
def test_every_row_count_thread_count_and_layout_gives_the_same_bits(n, k):
    x, w = _case(cpu.WIDEN_ROWS + 3, n, k)
    p = panels.pack(w)
    few = cpu.ops().linear_packed(x, p, 1 << 30)          # every row count by the few-rows layout
    assert torch.equal(cpu.ops().linear_packed(x, p, 1), few)       # ... and by the widening one
    for rows in (1, 2, 6, 7, 16):
        for widen_rows in (1, 1 << 30):
            assert torch.equal(cpu.ops().linear_packed(x[:rows], p, widen_rows), few[:rows]), (rows, widen_rows)
    assert torch.equal(cpu.ops().linear_packed(x[5:6], p, 1 << 30), few[5:6])
    threads = torch.get_num_threads()
    try:
        for t in {1, 2, 3} - {threads}:
            torch.set_num_threads(t)
            for widen_rows in (1, 1 << 30):
                assert torch.equal(cpu.ops().linear_packed(x, p, widen_rows), few), (t, widen_rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("widen_rows", [1, 1 << 30])
def test_bf16_results_are_the_fp32_sums_rounded_as_torch_rounds(widen_rows):
    """bf16 x: each output rounded once to bf16 as it is stored, bit for bit what torch's
    conversion of the fp32 result gives, infinities included; a NaN (row 3 carries one) stays a
    NaN (stored as the one quiet NaN c10::BFloat16 makes, whatever torch's vector path keeps)."""
    x, w = _case(9, 48, 520, torch.bfloat16)
    x[3, 11] = float("nan")
    x[4, :2], w[0, :2] = 3e38, 1.0                 # 6e38 and the rest: past fp32's largest
    p = panels.pack(w)
    got = cpu.ops().linear_packed(x, p, widen_rows)
    want = cpu.ops().linear_packed(x.float(), p, widen_rows).bfloat16()
    nan = want.isnan()
    assert got.dtype == torch.bfloat16 and torch.equal(got.isnan(), nan) and nan[3].all() and nan.sum() == 48
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]) and got[4, 0] == float("inf")


def test_linear_keeps_leading_dims_and_reads_views():
    x, w = _case(12, 48, 64, torch.bfloat16)
    p = panels.pack(w)
    flat = cpu.linear(x, p)
    assert torch.equal(cpu.linear(x.reshape(3, 4, 64), p), flat.reshape(3, 4, 48))
    wide = torch.cat([x, x], dim=1)[:, :64]                        # a strided view of x
    assert torch.equal(cpu.linear(wide, p), flat)
    assert cpu.linear(x[:0], p).shape == (0, 48)


def test_a_mismatched_call_says_what_is_wrong():
    x, w = _case(2, 32, 40)
    with pytest.raises(RuntimeError, match=r"x \[..., K\] and panels \[P, K, 16\] disagree"):
        cpu.ops().linear_packed(x[:, :39], panels.pack(w), cpu.WIDEN_ROWS)
    with pytest.raises(RuntimeError, match="panels must be a contiguous bf16"):
        cpu.ops().linear_packed(x, panels.pack(w).float(), cpu.WIDEN_ROWS)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("panels") / "m", vocab_size=320, head_dim=32,
                           hidden_size=128, intermediate_size=256, dtype=torch.bfloat16, seed=4)


def test_a_session_on_panels_holds_them_and_matches_the_reference_set(ckpt, monkeypatch):
    """As on a CPU without native bf16: every matrix and the LM head (320 rows) in panels, the
    memory report counting the head's copy, greedy tokens and logits as the reference set's."""
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: (False, "as an AVX2 machine"))
    fast = Session.from_pretrained(ckpt, kernels="cpu", dtype="bfloat16", num_blocks=64)
    ref = Session.from_pretrained(ckpt, kernels="reference", dtype="bfloat16", num_blocks=64)
    model = fast.model
    for layer, plain in zip(model.layers, ref.model.layers, strict=True):
        for n in ("qkv", "o", "gate_up", "down"):
            assert panels.is_packed(getattr(layer, n)) and torch.equal(dense_weight(getattr(layer, n)), getattr(plain, n))
    assert panels.is_packed(model.head) and torch.equal(dense_weight(model.head), model.lm_head)
    assert fast.memory().weights == ref.memory().weights + model.head.nbytes
    prompt = list(range(3, 70))
    outs = []
    for sess in (fast, ref):
        req = sess.add_request(prompt, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
        step = sess.prefill()
        outs.append(step.logits.to_host().float())
        sess.sample(step)
        while not req.is_done:
            sess.step()
        outs.append(req.output_token_ids)
    (fast_logits, fast_tokens), (ref_logits, ref_tokens) = (outs[:2], outs[2:])
    assert (fast_logits - ref_logits).abs().max() <= 0.05 * ref_logits.abs().max()
    assert fast_tokens == ref_tokens


def test_a_packed_lm_head_fills_a_logits_buffer_of_the_models_dtype(ckpt, monkeypatch):
    """The model's forward writes logits of its own dtype into ``logits_out`` by ``torch.mm`` on
    a plain head, through the set's ``linear`` on a packed one: both as the reference set's."""
    from qwen_npu.model.qwen3 import Qwen3Model
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: (False, "as an AVX2 machine"))
    original = Qwen3Model.forward

    def forward(self, input_ids, meta, kv, logits_index, *, logits_out=None, **kw):
        mine = torch.empty(logits_out.shape, dtype=self.dtype)               # bf16, not the runner's fp32
        out = original(self, input_ids, meta, kv, logits_index, logits_out=mine, **kw)
        assert out is mine
        return logits_out.copy_(mine)
    monkeypatch.setattr(Qwen3Model, "forward", forward)
    monkeypatch.setattr(Qwen3Model, "__call__", forward)
    logits = []
    for kernels in ("cpu", "reference"):
        sess = Session.from_pretrained(ckpt, kernels=kernels, dtype="bfloat16", num_blocks=64)
        assert panels.is_packed(sess.model.head) == (kernels == "cpu")
        sess.add_request(list(range(3, 20)), SamplingParams(max_new_tokens=2, temperature=0.0))
        logits.append(sess.prefill().logits.to_host().float())
    assert (logits[0] - logits[1]).abs().max() <= 0.05 * logits[1].abs().max()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("n, k", [(6144, 1024), (128, 64), (96, 32), (32, 48)])
def test_gate_up_silu_on_panels_gives_the_bits_of_the_product_then_silu_mul(n, k):
    """Every row count below WIDEN_ROWS (one row against four panels, passes of at most six rows), an
    item of fewer than four panels (n 96: three gate panels), NaN, inf and huge sums."""
    w = panels.pack((torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.2).bfloat16())
    gen = torch.Generator().manual_seed(k)
    for rows in (1, 2, 5, 6, 7, 13, 16, 40, cpu.WIDEN_ROWS - 1):
        x = (torch.randn(rows, k, generator=gen) * 4).bfloat16()
        if rows > 2:
            x[1, 0], x[2, 1], x[-1] = float("nan"), float("inf"), 1e30
        fused = cpu.gate_up_silu(x, w)
        assert fused is not None and fused.shape == (rows, n // 2)
        assert torch.equal(_bits(fused), _bits(cpu.silu_mul(cpu.linear(x, w)))), rows


def test_gate_up_silu_on_panels_declines_what_it_cannot_take():
    w = panels.pack(torch.randn(128, 64).bfloat16())
    x = torch.randn(4, 64).bfloat16()
    assert cpu.gate_up_silu(torch.randn(cpu.WIDEN_ROWS, 64).bfloat16(), w) is None   # the many-rows layout
    assert cpu.gate_up_silu(x.float(), w) is None                                     # not bf16
    assert cpu.gate_up_silu(torch.randn(4, 32).bfloat16(), w) is None                 # K disagrees
    assert cpu.gate_up_silu(x, panels.pack(torch.randn(48, 64).bfloat16())) is None   # three panels: no halves
    assert cpu.gate_up_silu(x, torch.randn(128, 64).bfloat16()) is None              # a plain weight
    with pytest.raises(RuntimeError, match="gate_up_silu_packed"):
        cpu.ops().gate_up_silu_packed(torch.randn(4, 64), w, cpu.WIDEN_ROWS)            # fp32 x past the check


def test_a_session_on_panels_fuses_the_gate_up_product_with_the_same_logits(ckpt, monkeypatch):
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: (False, "as an AVX2 machine"))

    def run() -> torch.Tensor:
        sess = Session.from_pretrained(ckpt, kernels="cpu", dtype="bfloat16", num_blocks=64)
        reqs = [sess.add_request([5 + i] * (9 + i), SamplingParams(max_new_tokens=3, ignore_eos=True)) for i in range(3)]
        logits = []
        while not all(r.is_done for r in reqs):
            logits.append(sess.step().logits.to_host())
        return torch.cat(logits)

    real, used = cpu.gate_up_silu, []
    monkeypatch.setattr(cpu, "decoder_layers", None)      # the layers' separate calls are what is compared

    def counted(x, weight):
        out = real(x, weight)
        used.append(out is not None)
        return out
    monkeypatch.setattr(cpu, "gate_up_silu", counted)
    fused = run()
    assert used and all(used)                      # every step here has fewer than WIDEN_ROWS tokens
    monkeypatch.setattr(cpu, "gate_up_silu", lambda x, weight: None)
    assert torch.equal(fused, run())
