"""The cpu set's optional fused kernels (qk_norm_rope, silu_mul) against the reference kernels.

Tolerances as for the rest of the cpu set (tests/kernels/test_cpu.py): float32 atol = rtol =
1e-5; bfloat16 atol = rtol = 2e-2. ``qk_norm_rope`` must also be bit-identical to the set's own
``rms_norm`` then ``rope``. Skipped where the set cannot run (no AVX2 or no C++ compiler).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_reference import TOL, bits

from qwen_npu import SamplingParams, Session
from qwen_npu.kernels import cpu
from qwen_npu.kernels import reference as ref
from qwen_npu.testing import make_tiny_qwen3

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"cpu kernels: {cpu.availability()[1]}")
DTYPES = list(TOL)


def rope_tables(tokens: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [tokens, head_dim] fp32 at scattered positions, as the model gathers them."""
    pos = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(seed)).double()
    freqs = pos[:, None] * (1.0 / 1e6 ** (torch.arange(0, head_dim, 2).double() / head_dim))[None]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().float(), emb.sin().float()


# --- qk_norm_rope -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim",
                         [(1, 16, 8, 128), (5, 4, 2, 16), (3, 5, 1, 24), (7, 3, 3, 10), (2, 2, 1, 2)],
                         ids=["decode-0.6b", "vector-half", "odd-half-12", "half-5", "tiny"])
def test_qk_norm_rope_matches_norm_then_rope(tokens, heads, kv_heads, head_dim, dtype):
    """On views of a fused qkv output (token stride > heads * head_dim), as the model passes them:
    within tolerance of the reference kernels, bit-identical to this set's two-call path."""
    gen = torch.Generator().manual_seed(tokens * 31 + head_dim)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = (torch.randn(tokens, q_size + 2 * kv_size, generator=gen) * 3).to(dtype)
    q_in, k_in, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q_in, k_in = q_in.reshape(tokens, heads, head_dim), k_in.reshape(tokens, kv_heads, head_dim)
    assert tokens == 1 or not q_in.is_contiguous()                    # really a strided view
    qw, kw = ((torch.rand(head_dim, generator=gen) + 0.5).to(dtype) for _ in range(2))
    cos, sin = rope_tables(tokens, head_dim, seed=head_dim)
    before = qkv.clone()
    q, k = cpu.qk_norm_rope(q_in, k_in, qw, kw, 1e-6, cos, sin)
    assert q.shape == (tokens, heads, head_dim) and k.shape == (tokens, kv_heads, head_dim)
    assert q.dtype == k.dtype == dtype and q.is_contiguous() and k.is_contiguous()
    assert torch.equal(bits(qkv), bits(before))                       # inputs untouched
    want_q, want_k = ref.rope(ref.rms_norm(q_in, qw, 1e-6), ref.rms_norm(k_in, kw, 1e-6), cos, sin)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    two_q, two_k = cpu.rope(cpu.rms_norm(q_in, qw, 1e-6), cpu.rms_norm(k_in, kw, 1e-6), cos, sin)
    assert torch.equal(bits(q), bits(two_q)) and torch.equal(bits(k), bits(two_k))


def test_qk_norm_rope_falls_back_for_other_dtypes_and_refuses_bad_shapes():
    q, k = torch.randn(2, 2, 8, dtype=torch.float64), torch.randn(2, 1, 8, dtype=torch.float64)
    w = torch.ones(8, dtype=torch.float64)
    cos, sin = rope_tables(2, 8, seed=1)
    got = cpu.qk_norm_rope(q, k, w, w, 1e-6, cos, sin)
    want = ref.rope(ref.rms_norm(q, w, 1e-6), ref.rms_norm(k, w, 1e-6), cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(RuntimeError, match="cos/sin"):
        cpu.qk_norm_rope(q.float(), k.float(), w.float(), w.float(), 1e-6, cos[:1], sin[:1])


# --- silu_mul -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3072), (16, 3072), (3, 13), (2, 3, 40), (600, 24), (1, 1)],
                         ids=["decode-1", "decode-16", "odd", "leading-dims", "parallel", "one"])
def test_silu_mul_matches_the_two_torch_ops(shape, dtype):
    gen = torch.Generator().manual_seed(shape[-1])
    gate_up = (torch.randn(*shape[:-1], 2 * shape[-1], generator=gen) * 4).to(dtype)
    act = cpu.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert act.shape == gate.shape and act.dtype == dtype
    torch.testing.assert_close(act, F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_reads_strided_rows_and_extreme_values(dtype):
    extremes = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4, 3.0, -3.0])
    wide = torch.randn(4, 40, generator=torch.Generator().manual_seed(9))
    wide[:, :12] = extremes
    wide = wide.to(dtype)
    gate_up = wide[:, :24]                                         # rows strided by 40
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = cpu.silu_mul(gate_up)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.isfinite(got).all()
    nan = cpu.silu_mul(torch.tensor([[float("nan"), 2.0]], dtype=dtype))
    assert torch.isnan(nan).all()


def test_silu_mul_refuses_an_odd_width():
    with pytest.raises(RuntimeError, match="even last dimension"):
        cpu.silu_mul(torch.randn(2, 7))


# --- in the model --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("cpu_fused_bf16"), vocab_size=512, seed=5, hidden_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                           dtype=torch.bfloat16)


def test_the_model_fuses_without_hooks_and_keeps_hook_points_exact(bf16_ckpt, monkeypatch):
    """Without a hook the forward calls qk_norm_rope and the SiLU-mul once per layer (silu_mul, or
    gate_up_silu where the set fuses it with the product); with one it takes the separate calls for
    q and k, so a hook sees q and k before RoPE and its edits take effect."""
    calls = {"qk_norm_rope": 0, "silu_mul": 0}
    monkeypatch.setattr(cpu, "decoder_layers", None)      # the layers' separate calls are what is counted
    for name, part in (("qk_norm_rope", "qk_norm_rope"), ("silu_mul", "silu_mul"), ("gate_up_silu", "silu_mul")):
        def counted(*args, _fn=getattr(cpu, name), _part=part):
            out = _fn(*args)
            calls[_part] += out is not None
            return out
        monkeypatch.setattr(cpu, name, counted)
    sess = Session.from_pretrained(bf16_ckpt, kernels="cpu", max_batch=2, chunk_size=16, max_model_len=64,
                                   prefix_cache=False)
    layers = sess.model_config.num_hidden_layers
    prompt, params = list(range(5, 25)), SamplingParams(max_new_tokens=3, ignore_eos=True)
    plain = sess.generate([prompt], params, progress=False)[0].token_ids
    forwards = 2 + 2                                       # two prefill chunks (16 + 4), two decode steps
    assert calls == {"qk_norm_rope": forwards * layers, "silu_mul": forwards * layers}

    calls.update(qk_norm_rope=0, silu_mul=0)
    names = ["layers.0.attn.q_pre_rope", "layers.0.attn.k_pre_rope", "layers.0.attn.q", "layers.0.attn.k"]
    with sess.capture(names) as cap:
        req = sess.add_request(prompt, params)
        while not req.is_done:
            sess.step()
    assert calls == {"qk_norm_rope": 0, "silu_mul": forwards * layers}
    assert list(req.output_token_ids) == list(plain)
    cos, sin = (table[cap.positions(req.id)] for table in (sess.model.cos, sess.model.sin))
    want_q, want_k = cpu.rope(cap.stack(names[0], req.id), cap.stack(names[1], req.id), cos, sin)
    assert torch.equal(cap.stack(names[2], req.id), want_q) and torch.equal(cap.stack(names[3], req.id), want_k)

    with sess.intervene("layers.0.attn.q_pre_rope", lambda x: x * 0), sess.capture(["layers.0.attn.q"]) as cap:
        edited = sess.add_request(prompt, params)
        while not edited.is_done:
            sess.step()
    assert calls["qk_norm_rope"] == 0
    assert torch.count_nonzero(cap.stack("layers.0.attn.q", edited.id)) == 0    # RoPE of the edited q


# --- greedy_health ----------------------------------------------------------------------------

def _awkward_logits(vocab: int, seed: int) -> torch.Tensor:
    """Rows a stream can produce: ordinary, tied maxima (in a vector and in the tail), a NaN
    (early, late), an inf, all -inf, all zero (with a -0.0), all equal."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(10, vocab, generator=gen)
    x[1, :] = 0.5
    x[1, vocab // 2:] = 2.0                      # ties: the first one wins
    x[2, -1] = 99.0                              # the max in the tail
    x[3, vocab - 1] = float("nan")
    x[4, 0] = float("nan")
    x[4, -1] = float("nan")
    x[5, vocab // 3] = float("inf")
    x[6, :] = float("-inf")
    x[7, :] = 0.0
    x[7, 0] = -0.0
    x[8, :] = 3.25
    x[9, :] = -1e30
    x[9, vocab // 4] = float("-inf")
    return x


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 16, 31, 1000, 151936])
def test_greedy_health_is_argmax_and_the_health_codes_exactly(vocab):
    from qwen_npu.engine.sampler import health_codes
    x = _awkward_logits(vocab, vocab)
    ids, codes = cpu.greedy_health(x)
    assert ids.dtype == codes.dtype == torch.int64
    assert torch.equal(ids, x.argmax(dim=-1)), (ids, x.argmax(dim=-1))
    assert torch.equal(codes, health_codes(x)), (codes, health_codes(x))
    strided = torch.cat([x, x], dim=1)[:, ::2]    # a view the kernel copies first
    assert torch.equal(cpu.greedy_health(strided)[0], strided.argmax(dim=-1))


def test_greedy_health_declines_what_it_does_not_take():
    assert cpu.greedy_health(torch.randn(3, 8).bfloat16()) is None
    assert cpu.greedy_health(torch.randn(8)) is None
    assert cpu.greedy_health(torch.empty(2, 0)) is None
    ids, codes = cpu.greedy_health(torch.empty(0, 8))
    assert ids.shape == codes.shape == (0,)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_session_samples_the_same_tokens_and_health_with_and_without_the_fused_reads(monkeypatch, tmp_path,
                                                                                      dtype):
    """Greedy and seeded rows, a row under min_new_tokens (masked logits: the fused argmax is not
    used for it), through the cpu set with its LM head's fused read (``lm_head``, which holds a
    bf16 model's head), without it (``greedy_health`` over the logits), and without either:
    the same tokens, health and logits."""
    path = make_tiny_qwen3(tmp_path / "m", vocab_size=320, dtype=getattr(torch, dtype))
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    params = [SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=6, temperature=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_new_tokens=6, temperature=0.0, min_new_tokens=3)]
    calls = {"lm_head": 0, "greedy_health": 0}

    def counted(name):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a: calls.__setitem__(name, calls[name] + 1) or real(*a))
    counted("lm_head")
    counted("greedy_health")

    def run():
        with Session.from_pretrained(path, kernels="cpu", dtype=dtype) as sess:
            out = [(c.token_ids, c.finish_reason) for c in sess.generate(prompts, params, progress=False)]
            return out, [s.health for s in sess.history], sess.history[-1].logits.to_host()
    fused = run()
    if dtype == "bfloat16":                  # the head held in the set's own form: the LM head reads
        assert calls["lm_head"] >= 6 and calls["greedy_health"] == 0, calls
    else:                                    # a plain float32 head: the logits are read once after it
        assert calls["greedy_health"] >= 6, calls
    monkeypatch.delattr(cpu, "lm_head")
    second = run()
    monkeypatch.delattr(cpu, "greedy_health")
    for other in (second, run()):
        assert other[:2] == fused[:2]
        assert torch.equal(other[2], fused[2])
