"""What the cuda kernel set costs, counted on the CPU: kernels per decode step, largest tensor.

Kernels are counted as the aten ops dispatched (``TorchDispatchMode``), views left out: each
other op launches at least one kernel on a GPU. Sizes are the bytes of every tensor an op
returns; the 32B-model case runs under ``FakeTensorMode`` (CPU tensors without storage: the ops,
shapes and dtypes are those of a real CPU run, nothing is computed), so a 512-token chunk at 8k
context costs no memory here. Both sets' figures are printed (``pytest -s``).
"""
from __future__ import annotations

import pytest
import torch
from qwen_npu.kernels import AttentionMetadata, cuda
from qwen_npu.kernels import reference as ref
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from qwen_npu import SamplingParams, Session
from qwen_npu.testing import make_tiny_qwen3

LAYERS = 6
PER_LAYER, PER_STEP = 16, 48          # the cuda set's budget in write_kv + paged_attention
MIB = 2 ** 20


def is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class Ops(TorchDispatchMode):
    """Counts the non-view ops dispatched and the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.count, self.largest, self.names = 0, (0, ""), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not is_view(func):
            self.count += 1
            self.names.add(str(func))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor) and o.numel() * o.element_size() > self.largest[0]:
                    self.largest = (o.numel() * o.element_size(), str(func))
        return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("budgets"), vocab_size=512, num_hidden_layers=LAYERS)


def decode_step_ops(ckpt, kernels: str, rows: int, monkeypatch) -> tuple[int, int]:
    """(ops in the kernel set's write_kv and paged_attention, ops in the whole step) of one sampled
    decode step: greedy and temperature rows, contexts of 9 to 44 tokens."""
    sess = Session.from_pretrained(ckpt, device="cpu", kernels=kernels, block_size=4, num_blocks=128,
                                   max_batch=rows, max_model_len=96)
    for i in range(rows):
        sess.add_request(list(range(8 + 12 * i)), SamplingParams(
            max_new_tokens=8, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True))
    while not sess.history or sess.history[-1].kind != "decode":
        sess.step()
    module = sess.model.kernels
    inside = [0]
    def counting(f):
        def counted(*a, **kw):
            with Ops() as o:
                r = f(*a, **kw)
            inside[0] += o.count
            return r
        return counted
    for name in ("write_kv", "paged_attention"):
        monkeypatch.setattr(module, name, counting(getattr(module, name)))
    with Ops() as whole:
        step = sess.step()
    monkeypatch.undo()
    assert step.kind == "decode" and step.batch_size == rows
    return inside[0], whole.count


def test_a_decode_step_launches_a_fixed_few_kernels_per_layer(ckpt, monkeypatch):
    got = {k: decode_step_ops(ckpt, k, 4, monkeypatch) for k in ("reference", "cuda")}
    print(f"\nops per decode step, {LAYERS} layers, 4 rows: (write_kv + paged_attention, whole step) {got}")
    budget = PER_LAYER * LAYERS + PER_STEP
    assert got["cuda"][0] <= budget, f"cuda set: {got['cuda'][0]} ops in its kernels, budget {budget}"
    assert got["reference"][0] > budget, f"the reference set fits the budget too ({got['reference'][0]})"
    assert got["cuda"][1] < got["reference"][1]
    assert decode_step_ops(ckpt, "cuda", 2, monkeypatch)[0] == got["cuda"][0], "the count grew with the rows"


def chunk_case(q_len: int, ctx: int, heads=64, kv=8, head_dim=128, block_size=16):
    """One row computing positions ctx - q_len .. ctx - 1, in bf16 (Qwen3-32B's attention shape)."""
    blocks = ctx // block_size
    meta = AttentionMetadata(
        positions=torch.arange(ctx - q_len, ctx), slot_mapping=torch.arange(ctx - q_len, ctx),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None], seq_lens=torch.tensor([ctx], dtype=torch.int32),
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32), query_lens_host=(q_len,),
        seq_lens_host=(ctx,), is_decode=q_len == 1)
    kc = torch.empty(blocks, block_size, kv, head_dim, dtype=torch.bfloat16)
    return meta, torch.empty(q_len, heads, head_dim, dtype=torch.bfloat16), kc, torch.empty_like(kc)


def largest(kernels, case) -> tuple[int, str]:
    meta, query, kc, vc = case
    with Ops() as o:
        kernels.paged_attention(query, kc, vc, meta, 128 ** -0.5)
    return o.largest


def test_a_512_token_chunk_at_8k_context_allocates_no_score_matrix():
    with FakeTensorMode():
        case = chunk_case(512, 8192)
        got = {k.NAME: largest(k, case) for k in (ref, cuda)}
    print(f"\nlargest tensor in paged_attention, 512 tokens at 8k, 64 heads / 8 kv heads x 128: {got}")
    assert got["reference"][0] >= 1024 * MIB                 # its float32 scores [8, 8, 512, 8192]
    assert got["cuda"][0] <= 16 * MIB, got["cuda"]           # the gathered K (or V) of the context
    assert got["reference"][0] >= 64 * got["cuda"][0]


def test_decode_rows_are_not_padded_to_the_longest():
    """16 rows, one at 8k context, fifteen at 300: the cuda set gathers what they hold."""
    ctxs = [8192] + [300] * 15
    with FakeTensorMode():
        table = torch.arange(512, dtype=torch.int32).repeat(16, 1)       # 8192 positions, rows share blocks
        meta = AttentionMetadata(positions=torch.tensor(ctxs) - 1, slot_mapping=torch.tensor(ctxs) - 1,
                                 block_tables=table, seq_lens=torch.tensor(ctxs, dtype=torch.int32),
                                 query_start_loc=torch.arange(17, dtype=torch.int32),
                                 query_lens_host=(1,) * 16, seq_lens_host=tuple(ctxs), is_decode=True)
        kc = torch.empty(512, 16, 8, 128, dtype=torch.bfloat16)
        query = torch.empty(16, 64, 128, dtype=torch.bfloat16)
        got = {k.NAME: largest(k, (meta, query, kc, torch.empty_like(kc))) for k in (ref, cuda)}
    print(f"\nlargest tensor in a decode step, contexts 8192 + 15 x 300: {got}")
    padded = 16 * 8192 * 8 * 128 * 2                          # every row's K at the longest context
    held = (8192 + 15 * cuda.TILE * 2) * 8 * 128 * 2           # each row's tiles (300 -> 2 tiles)
    assert got["reference"][0] >= padded
    assert got["cuda"][0] <= held
    assert got["reference"][0] >= 4 * got["cuda"][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_run_the_fused_cpu_kernel_that_the_fake_run_counts(dtype):
    """A real (small) run takes the op the fake run measured, not SDPA's math fallback."""
    meta, query, kc, _ = chunk_case(64, 1024, heads=16, kv=4, head_dim=64)
    query, kc = torch.randn(query.shape).to(dtype), torch.randn(kc.shape).to(dtype)
    with Ops() as o:
        out = cuda.paged_attention(query, kc, kc, meta, 0.125)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in o.names, sorted(o.names)
    assert o.largest[0] < 64 * 1024 * 16 * 4, o.largest               # no [heads, 64, 1024] fp32 scores
    torch.testing.assert_close(out.float(), ref.paged_attention(query, kc, kc, meta, 0.125).float(),
                               atol=2e-2, rtol=2e-2)
