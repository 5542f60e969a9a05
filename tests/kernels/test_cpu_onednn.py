"""Weights reordered once for oneDNN (kernels/onednn.py): where the cpu set does it, that the
product on a reordered weight is torch's bf16 product bit for bit, and what a Session built on
them holds, reports and computes.

On a CPU without native bf16 (or capped with ``QWEN_NPU_CPU_ISA=avx2``) nothing is reordered: the
bf16 matrices are packed into 16-column panels instead (kernels/panels.py, tests in
test_cpu_panels.py), and the tests that compare reordered products are skipped with that reason;
the others assert the panels there.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from qwen_npu.kernels import cpu, cpu_features, onednn, panels

from qwen_npu import SamplingParams, Session
from qwen_npu.config import ModelConfig
from qwen_npu.model.loader import load_checkpoint
from qwen_npu.model.qwen3 import Qwen3Model, dense_weight
from qwen_npu.testing import make_tiny_qwen3

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"cpu kernels: {cpu.availability()[1]}")

NATIVE = cpu_features.native_bf16()[0]
needs_native = pytest.mark.skipif(not NATIVE, reason="no native bf16 here: weights stay plain")
MATRICES = ("qkv", "o", "gate_up", "down")


def _weight(n=48, k=40, dtype=torch.bfloat16, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_bf16_weights_are_reordered_where_the_cpu_has_native_bf16_and_packed_where_not():
    w = _weight()
    p = cpu.prepare_weight(w)
    assert p.is_mkldnn == NATIVE and panels.is_packed(p) == (not NATIVE)
    assert cpu.prepares_weights(torch.bfloat16) and not cpu.prepares_weights(torch.float32)
    assert torch.equal(dense_weight(p), w) and panels.out_features(p) == w.shape[0]


@pytest.mark.parametrize("weight", [_weight(dtype=torch.float32), _weight()[0], _weight()[:, :8], _weight(n=47)],
                         ids=["float32", "1-D", "strided view", "47 rows"])
def test_other_weights_are_left_as_they_are_or_read_contiguously(weight):
    p = cpu.prepare_weight(weight)
    if weight.dtype == torch.float32 or weight.dim() != 2 or (not NATIVE and weight.shape[0] % 16):
        assert p is weight
    elif NATIVE:
        assert p.is_mkldnn and torch.equal(dense_weight(p), weight)
    else:
        assert panels.is_packed(p) and torch.equal(dense_weight(p), weight)


def test_the_isa_cap_turns_reordering_into_panels(monkeypatch):
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: (False, "capped"))
    w = _weight()
    p = cpu.prepare_weight(w)
    assert panels.is_packed(p) and not p.is_mkldnn and torch.equal(dense_weight(p), w)


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 33, 130])
def test_product_on_a_reordered_weight_is_torchs_bf16_product_bitwise(rows):
    w = _weight(n=70, k=200, seed=rows)
    x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(1)).bfloat16()
    p = cpu.prepare_weight(w)
    got = cpu.linear(x, p)
    padded = torch.cat([x, x.new_zeros(max(onednn.MIN_ROWS - rows, 0), 200)])   # fewer rows are padded
    assert torch.equal(got, F.linear(padded, w)[:rows])
    want = x.double() @ w.double().T
    assert torch.allclose(got.double(), want, atol=2e-2, rtol=2e-2)
    x3 = x.reshape(1, rows, 200)                 # leading dims, as the model's views have
    assert torch.equal(cpu.linear(x3, p), got.reshape(1, rows, 70))


@needs_native
def test_a_mismatched_call_says_what_is_wrong():
    p = cpu.prepare_weight(_weight())
    with pytest.raises(TypeError, match="float32 but the reordered weight is torch.bfloat16"):
        onednn.linear(torch.zeros(2, 40), p)
    with pytest.raises(ValueError, match="x has 39 features but the weight \\[48, 40\\] takes 40"):
        onednn.linear(torch.zeros(2, 39, dtype=torch.bfloat16), p)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("onednn") / "m", vocab_size=300, head_dim=32,
                           hidden_size=128, intermediate_size=256, dtype=torch.bfloat16, seed=3)


def test_consuming_model_takes_the_matrices_out_of_the_dict_and_computes_the_same(ckpt):
    _, weights = load_checkpoint(ckpt, arena=False)
    cfg = ModelConfig.from_pretrained(ckpt)
    keep = Qwen3Model(cfg, dict(weights), cpu)
    left = dict(weights)
    took = Qwen3Model(cfg, left, cpu, consume=True)
    matrices = [n for n in weights if n.endswith("_proj.weight")]
    assert matrices and all(n not in left for n in matrices)
    assert "model.embed_tokens.weight" in left and "model.layers.0.input_layernorm.weight" in left
    for a, b in zip(keep.layers, took.layers):
        for name in MATRICES:
            assert torch.equal(dense_weight(getattr(a, name)), dense_weight(getattr(b, name)))


def _forced_logits(sess, prompt, tokens):
    """Logits of a prefill and then one decode step per forced token (the same stream in any set)."""
    sess.add_request(prompt, SamplingParams(max_new_tokens=len(tokens) + 1, temperature=0.0, ignore_eos=True))
    step, out = sess.prefill(), []
    for tok in tokens:
        out.append(step.logits.to_host().float())
        sess.sample(step, force=[tok])
        step = sess.decode_step()
    return out + [step.logits.to_host().float()]


def test_a_bf16_session_on_reordered_weights_matches_the_reference_set(ckpt):
    fast = Session.from_pretrained(ckpt, kernels="cpu", dtype="bfloat16", num_blocks=64)
    ref = Session.from_pretrained(ckpt, kernels="reference", dtype="bfloat16", num_blocks=64)
    model = fast.model
    assert all(getattr(layer, n).is_mkldnn == NATIVE for layer in model.layers for n in MATRICES)
    assert all(panels.is_packed(getattr(layer, n)) == (not NATIVE) for layer in model.layers for n in MATRICES)
    assert model.head.is_mkldnn == NATIVE and not model.lm_head.is_mkldnn and not model.embed.is_mkldnn
    assert NATIVE or model.head is model.lm_head          # 300 rows: not a whole number of panels
    for layer, plain in zip(model.layers, ref.model.layers):
        for n in MATRICES:
            assert torch.equal(dense_weight(getattr(layer, n)), getattr(plain, n))
    # the memory report counts the prepared matrices and the LM head's copy (tied: the embedding)
    assert fast.memory().weights == ref.memory().weights + (model.head.nbytes if NATIVE else 0)
    prompt, tokens = list(range(5, 60)), [7, 99, 3, 250]
    for got, want in zip(_forced_logits(fast, prompt, tokens), _forced_logits(ref, prompt, tokens), strict=True):
        assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_research_tools_read_the_plain_matrices_of_a_reordered_session(ckpt):
    """``sess.attention`` forwards with the reference set (which has no ``linear`` of its own) and
    the attribution reads o_proj: both see the same matrices as on a session of plain weights."""
    from qwen_npu.research import DLA_NAMES, direct_logit_attribution
    prompt = list(range(5, 30))
    runs = []
    for kernels in ("cpu", "reference"):
        sess = Session.from_pretrained(ckpt, kernels=kernels, dtype="bfloat16", num_blocks=64)
        req = sess.add_request(prompt, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
        with sess.capture(DLA_NAMES) as cap:
            sess.step()
        pattern = sess.attention(req, 1)
        dla = direct_logit_attribution(sess, cap, req, 7, 9)
        runs.append((pattern.probs, dla.heads, dla.actual))
    (p_fast, h_fast, a_fast), (p_ref, h_ref, a_ref) = runs
    assert torch.allclose(p_fast, p_ref, atol=2e-2)
    assert torch.allclose(h_fast, h_ref, atol=0.1, rtol=0.05) and abs(a_fast - a_ref) <= 0.1 + 0.05 * abs(a_ref)


@needs_native
def test_huge_pages_are_asked_for_whole_pages_only_and_change_no_value():
    small = cpu.prepare_weight(_weight(n=64, k=64))            # 8 KiB: holds no whole huge page
    assert not onednn.collapse_to_huge_pages(torch.ops.mkldnn.data_ptr(small), small.nbytes)
    w = _weight(n=4096, k=1024, seed=5)                           # 8 MiB: three or four whole pages
    p = cpu.prepare_weight(w)
    again = onednn.collapse_to_huge_pages(torch.ops.mkldnn.data_ptr(p), p.nbytes)
    assert isinstance(again, bool) and torch.equal(dense_weight(p), w)
