"""Every npu kernel against the reference, on random inputs, on a real NPU.

The oracle is the reference kernel run in float32 on the CPU from the same (rounded) inputs.
Tolerances: float16 atol = rtol = 5e-3, bfloat16 atol = rtol = 2e-2 (README.md). Each test also
checks that the fused op really ran (no "running the reference kernel" warning), so a fallback
cannot pass as conformance.

What only a card settles (docs/npu.md, "What still needs a card"): the prefill cases cover a
first chunk whose query length equals its context (row (0, 37)) and chunks that start
mid-context, so they settle the causal-mask alignment and polarity under sparse_mode=3 and TND
with a paged cache; the all-fresh cases (one with a token of slot -1) run FIA unpaged; decode
runs FIA over the paged cache with block tables padded with block 0, and ATB paged attention
with FIA hidden (where the stack has NNAL); write_kv covers skipped slots; the norm tests bound
the rounding. The Session runs of the CPU stand-in tests (``tests/npu_wheel/standin_session_kit.py``:
all-fresh prefill, chunks, prefix cache, pure decode, mixed steps) run here against a CPU
reference Session.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import pytest
import torch
from qwen_npu.kernels import AttentionMetadata
from qwen_npu.kernels import npu as npu_k
from qwen_npu.kernels import reference as ref

from qwen_npu.device.npu_runtime import installed_op_support

sys.path.insert(0, str(Path(__file__).parents[1] / "npu_wheel"))
import standin_session_kit as session_kit  # the runs the CPU stand-in tests compare

pytestmark = pytest.mark.device

TOL = {torch.float16: {"atol": 5e-3, "rtol": 5e-3}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = list(TOL)
BLOCK = 128
HEAD_DIM = 128


@contextlib.contextmanager
def fused_only():
    """Fail if any npu kernel fell back to the reference inside the block."""
    npu_k.warn_fallback.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    fallbacks = [str(w.message) for w in caught if "running the reference kernel" in str(w.message)]
    assert not fallbacks, fallbacks


def build_case(rows, kv_heads, gqa, dtype, device, seed=0, block_size=BLOCK, head_dim=HEAD_DIM, skipped=()):
    """rows: [(tokens computed before, query_len)]. Distinct random blocks per row, -1 padded
    tables, NaN in every slot outside a context; the tokens at the indices in ``skipped`` get
    slot -1 (their position's slot keeps its K/V). Returns (meta, query, key_cache, value_cache)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(done + q) // block_size) for done, q in rows]
    num_blocks = sum(need) + 3
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    kc = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    bt = torch.full((len(rows), max(need) + 2), -1, dtype=torch.int32)
    slots = []
    for r, ((done, q), table) in enumerate(zip(rows, tables)):
        bt[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
        ctx_slots = [table[p // block_size] * block_size + p % block_size for p in range(done + q)]
        kc.view(-1, kv_heads, head_dim)[ctx_slots] = torch.randn(done + q, kv_heads, head_dim, generator=gen).to(dtype)
        vc.view(-1, kv_heads, head_dim)[ctx_slots] = torch.randn(done + q, kv_heads, head_dim, generator=gen).to(dtype)
        slots += ctx_slots[done:]
    for t in skipped:
        slots[t] = -1
    meta = AttentionMetadata.for_rows(rows, slots, bt, device)
    query = torch.randn(meta.num_tokens, kv_heads * gqa, head_dim, generator=gen).to(dtype)
    return meta, query.to(device), kc.to(device), vc.to(device)


def cpu_float(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(**{f: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                for f, v in vars(meta).items()})


def reference_attention(query, kc, vc, meta, scale):
    return ref.paged_attention(query.cpu().float(), kc.cpu().float(), vc.cpu().float(), cpu_float(meta), scale)


DECODE_ROWS = [(0, 1), (126, 1), (127, 1), (255, 1), (300, 1), (40, 1)]    # partial and full last blocks
PREFILL_ROWS = [(0, 37), (100, 20), (128, 128), (5, 1), (250, 6)]          # fresh, mid-context, exact fill
FRESH_ROWS = [(0, 37), (0, 128), (0, 5), (0, 200)]                          # all fresh: FIA unpaged
FIA = "npu_fused_infer_attention_score"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [1, 2, 5])
@pytest.mark.parametrize("rows", [DECODE_ROWS, PREFILL_ROWS, FRESH_ROWS], ids=["decode", "prefill", "all-fresh"])
def test_paged_attention(npu, rows, gqa, dtype):
    meta, query, kc, vc = build_case(rows, 2, gqa, dtype, npu)
    scale = HEAD_DIM ** -0.5
    with fused_only():
        out = npu_k.paged_attention(query, kc, vc, meta, scale)
    assert out.shape == query.shape and out.dtype == dtype and out.device == query.device
    torch.testing.assert_close(out.cpu().float(), reference_attention(query, kc, vc, meta, scale), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_fresh_batch_with_a_skipped_token(npu, dtype):
    """Token 3 has slot -1: it reads its position's slot through the table, as the reference does
    (slot 0, which no row owns, holds NaN)."""
    meta, query, kc, vc = build_case([(0, 37), (0, 5)], 2, 2, dtype, npu, skipped=(3,))
    with fused_only():
        out = npu_k.paged_attention(query, kc, vc, meta, HEAD_DIM ** -0.5)
    assert torch.isfinite(out.cpu()).all()
    torch.testing.assert_close(out.cpu().float(), reference_attention(query, kc, vc, meta, HEAD_DIM ** -0.5),
                               **TOL[dtype])


@pytest.mark.parametrize("rows", [DECODE_ROWS, [(0, 1), (0, 1), (0, 1)]], ids=["decode", "all-fresh decode"])
def test_decode_by_atb_paged_attention_where_fia_is_hidden(npu, monkeypatch, rows):
    """With FIA hidden from the probe, decode runs ``_npu_paged_attention`` (ATB, NNAL needed)."""
    support = installed_op_support()
    if support.get("_npu_paged_attention") is not None:
        pytest.skip(f"no ATB decode on this stack: {support['_npu_paged_attention']}")
    monkeypatch.setattr(npu_k, "op_support", lambda: {**support, FIA: "hidden by the test"})
    meta, query, kc, vc = build_case(rows, 2, 2, torch.bfloat16, npu)
    with fused_only():
        out = npu_k.paged_attention(query, kc, vc, meta, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out.cpu().float(), reference_attention(query, kc, vc, meta, HEAD_DIM ** -0.5),
                               **TOL[torch.bfloat16])


@pytest.mark.parametrize("rows", [DECODE_ROWS, PREFILL_ROWS, FRESH_ROWS], ids=["decode", "prefill", "all-fresh"])
def test_paged_attention_256_token_blocks(npu, rows):
    """block_size 256: decode too goes through npu_fused_infer_attention_score here."""
    meta, query, kc, vc = build_case(rows, 2, 2, torch.bfloat16, npu, block_size=256)
    scale = HEAD_DIM ** -0.5
    with fused_only():
        out = npu_k.paged_attention(query, kc, vc, meta, scale)
    torch.testing.assert_close(out.cpu().float(), reference_attention(query, kc, vc, meta, scale),
                               **TOL[torch.bfloat16])


def test_decode_row_ignores_other_rows_blocks(npu):
    meta, query, kc, vc = build_case(DECODE_ROWS, 2, 2, torch.bfloat16, npu)
    with fused_only():
        base = npu_k.paged_attention(query, kc, vc, meta, 0.1)
        mine = set(meta.block_tables[0].cpu().tolist()) - {-1}
        others = [b for b in range(kc.shape[0]) if b not in mine]
        kc[others] = float("nan")
        vc[others] = float("nan")
        out = npu_k.paged_attention(query, kc, vc, meta, 0.1)
    assert torch.isfinite(base).all()
    assert torch.equal(out[0].cpu(), base[0].cpu())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", ["mixed", "all-skipped", "none-skipped"])
def test_write_kv(npu, pattern, dtype):
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(6, BLOCK, 2, HEAD_DIM, generator=gen).to(dtype).to(npu)
    vc = torch.randn(6, BLOCK, 2, HEAD_DIM, generator=gen).to(dtype).to(npu)
    slots = torch.randperm(6 * BLOCK, generator=gen)[:40]
    if pattern == "mixed":
        slots[::3] = -1
    elif pattern == "all-skipped":
        slots[:] = -1
    key = torch.randn(40, 2, HEAD_DIM, generator=gen).to(dtype).to(npu)
    value = torch.randn(40, 2, HEAD_DIM, generator=gen).to(dtype).to(npu)
    want_k, want_v = kc.clone(), vc.clone()
    ref.write_kv(key, value, want_k, want_v, slots.to(npu))
    with fused_only():
        npu_k.write_kv(key, value, kc, vc, slots.to(npu))
    assert torch.equal(kc.cpu(), want_k.cpu()) and torch.equal(vc.cpu(), want_v.cpu())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_add_rms_norm(npu, dtype):
    gen = torch.Generator().manual_seed(2)
    x, res = (torch.randn(2, 7, 1024, generator=gen) * 3).to(dtype).to(npu)
    w = (torch.rand(1024, generator=gen) + 0.5).to(dtype).to(npu)
    with fused_only():
        y = npu_k.rms_norm(x, w, 1e-6)
        y2, summed = npu_k.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(y.cpu().float(), ref.rms_norm(x.cpu().float(), w.cpu().float(), 1e-6), **TOL[dtype])
    want2, want_sum = ref.add_rms_norm(x.cpu().float(), res.cpu().float(), w.cpu().float(), 1e-6)
    torch.testing.assert_close(y2.cpu().float(), want2, **TOL[dtype])
    torch.testing.assert_close(summed.cpu().float(), want_sum, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [1, 2, 5])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
def test_rope(npu, gqa, dtype, head_dim):
    gen = torch.Generator().manual_seed(3)
    t = 9
    q = torch.randn(t, 2 * gqa, head_dim, generator=gen).to(dtype).to(npu)
    k = torch.randn(t, 2, head_dim, generator=gen).to(dtype).to(npu)
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2).double() / head_dim)
    freqs = torch.tensor([0, 1, 2, 50, 51, 300, 301, 4000, 4001]).double()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().float().to(npu), emb.sin().float().to(npu)
    q0, k0 = q.clone(), k.clone()
    with fused_only():
        rq, rk = npu_k.rope(q, k, cos, sin)
    assert torch.equal(q.cpu(), q0.cpu()) and torch.equal(k.cpu(), k0.cpu()), "rope changed its inputs"
    wq, wk = ref.rope(q.cpu().float(), k.cpu().float(), cos.cpu(), sin.cpu())
    torch.testing.assert_close(rq.cpu().float(), wq, **TOL[dtype])
    torch.testing.assert_close(rk.cpu().float(), wk, **TOL[dtype])


def test_float32_falls_back_to_the_reference_and_says_so_once(npu):
    meta, query, kc, vc = build_case(DECODE_ROWS, 2, 2, torch.float32, npu)
    npu_k.warn_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match="float32") as caught:
        outs = [npu_k.paged_attention(query, kc, vc, meta, 0.1) for _ in range(3)]
    assert sum("paged_attention" in str(w.message) for w in caught) == 1
    want = ref.paged_attention(query, kc, vc, meta, 0.1)
    assert all(torch.equal(o, want) for o in outs)


PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30], list(range(100, 160)), [7] * 130]


@pytest.mark.parametrize("dtype, tol", [("bfloat16", 5e-2), ("float16", 5e-2)])
def test_session_parity_npu_vs_cpu(tmp_path, dtype, tol):
    """head_dim 128 in a half dtype, so rope, attention and the norms all take their fused ops
    (a fallback fails the test); the CPU reference Session runs the same checkpoint."""
    from qwen_npu import SamplingParams, Session
    from qwen_npu.testing import make_tiny_qwen3
    path = make_tiny_qwen3(tmp_path / "tiny", vocab_size=512, hidden_size=128, head_dim=128,
                           intermediate_size=256, dtype=torch.bfloat16)
    logits = {}
    for dev in ("npu", "cpu"):
        with fused_only() if dev == "npu" else contextlib.nullcontext():
            sess = Session.from_pretrained(path, device=dev, kernels="npu" if dev == "npu" else "reference",
                                           dtype=dtype, max_batch=4, block_size=128)
            for p in PROMPTS:
                sess.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True))
            step = sess.prefill()
            logits[dev] = step.logits.to_host().float()
    torch.testing.assert_close(logits["npu"], logits["cpu"], atol=tol, rtol=tol)


class RecordingAttention:
    """torch_npu, with each FIA call noted: (paged?, cumulative query lengths, smallest block id)."""

    def __init__(self, module):
        self._module, self.fia = module, []

    def __getattr__(self, op):
        fn = getattr(self._module, op)
        if op != FIA:
            return fn

        def call(*args, **kwargs):
            table = kwargs.get("block_table")
            self.fia.append((table is not None, list(kwargs["actual_seq_lengths"]),
                             None if table is None else int(table.min().cpu())))
            return fn(*args, **kwargs)
        return call


@pytest.fixture
def recording(monkeypatch):
    rec = RecordingAttention(npu_k.load_torch_npu())
    monkeypatch.setattr(npu_k, "load_torch_npu", lambda: rec)
    return rec


@pytest.fixture(scope="module")
def session_checkpoint(tmp_path_factory):
    return session_kit.make_checkpoint(tmp_path_factory.mktemp("tiny-npu") / "ckpt")


def test_session_forced_steps_match_the_cpu_reference(npu, recording, session_checkpoint):
    """Every step of the stand-in tests' forced run, decode included: pure decode steps run FIA
    paged over tables padded with block 0, the first all-fresh prefill runs it unpaged."""
    with fused_only():
        got = session_kit.forced_run(session_kit.open_session(session_checkpoint, "npu", device=str(npu)))
    session_kit.assert_same_forced_runs(got, session_kit.forced_run(
        session_kit.open_session(session_checkpoint, "reference")))
    decode = [c for c in recording.fia if c[0] and c[1] == list(range(1, len(c[1]) + 1))]
    assert decode and all(c[2] >= 0 for c in recording.fia if c[0]), recording.fia
    assert any(not paged for paged, _, _ in recording.fia), "the first, all-fresh prefill runs unpaged"


def test_session_mixed_steps_match_the_cpu_reference(npu, session_checkpoint):
    with fused_only():
        got = session_kit.mixed_run(session_kit.open_session(session_checkpoint, "npu", device=str(npu),
                                                             mixed_steps=True))
    session_kit.assert_same_mixed_runs(got, session_kit.mixed_run(
        session_kit.open_session(session_checkpoint, "reference", mixed_steps=True)))
