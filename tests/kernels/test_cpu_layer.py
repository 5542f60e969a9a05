"""The cpu set's one-call decoder layers (csrc/layer.cpp, ``cpu.decoder_layers``): a forward that
takes it gives the bits of one that makes each layer's calls one by one (logits and every byte of
the KV cache), and it declines, computing and writing nothing, where those calls would not make
their products on panels."""
from __future__ import annotations

import types

import pytest
import torch

from qwen_npu.kernels import cpu, panels
from qwen_npu.kernels.metadata import AttentionMetadata
from qwen_npu.model.loader import load_checkpoint
from qwen_npu.model.qwen3 import Qwen3Model
from qwen_npu.testing import make_tiny_qwen3

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the cpu kernels cannot be built here")

BLOCK, BLOCKS = 16, 24


def panel_set(**extra):
    """The cpu set with every matrix held as 16-column panels on any CPU (as ``prepare_weight`` holds
    them on one without native bf16), without ``decoder_layers`` unless given."""
    names = {n: getattr(cpu, n) for n in dir(cpu) if not n.startswith("_") and n != "decoder_layers"}
    return types.SimpleNamespace(**{**names, "prepare_weight": panels.pack, **extra})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_qwen3(tmp_path_factory.mktemp("cpu_layer"), vocab_size=512, seed=11, hidden_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                           num_hidden_layers=3, dtype=torch.bfloat16)
    config, weights = load_checkpoint(path, dtype=torch.bfloat16)
    return Qwen3Model(config, weights, panel_set(), max_positions=256)


def caches(model):
    c = model.config
    shape = (BLOCKS, BLOCK, c.num_key_value_heads, c.head_dim)
    gen = torch.Generator().manual_seed(3)       # not zeros: a write to a wrong slot must show
    return [tuple(torch.randn(shape, generator=gen).bfloat16() for _ in range(2)) for _ in range(c.num_hidden_layers)]


def step(model, kv, rows, tables, seed):
    """One forward over ``rows`` [(computed before, computing now)], block tables ``tables``."""
    slots = [tables[r][p // BLOCK] * BLOCK + p % BLOCK for r, (d, q) in enumerate(rows) for p in range(d, d + q)]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata.for_rows(rows, slots, bt)
    ids = torch.randint(0, model.config.vocab_size, (len(slots),), generator=torch.Generator().manual_seed(seed))
    last = torch.tensor([sum(q for _, q in rows[:i + 1]) - 1 for i in range(len(rows))])
    return model(ids, meta, kv, last)


def run_both(model, script):
    """The logits of every step of ``script`` and the caches after it, with and without the one
    call, and how many steps it computed."""
    made = []

    def counted(*args, **kwargs):
        out = cpu.decoder_layers(*args, **kwargs)
        made.append(out is not None)
        return out

    results = []
    for kernels in (panel_set(decoder_layers=counted), panel_set()):
        model.kernels = kernels
        kv = caches(model)
        logits = [step(model, kv, *s) for s in script]
        results.append((logits, kv))
    return results, sum(made)


def same(a, b):
    (la, kva), (lb, kvb) = a, b
    return (len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))
            and all(torch.equal(x, y) for pa, pb in zip(kva, kvb) for x, y in zip(pa, pb)))


def test_the_one_call_gives_the_bits_of_the_separate_calls(model):
    tables = [[3, 7, 1], [12, 5]]
    script = [([(0, 20), (0, 9)], tables, 1),          # a prefill of two rows (29 tokens)
              ([(20, 1), (9, 1)], tables, 2),          # decode steps, the second across a block boundary
              ([(21, 1), (10, 6)], tables, 3),         # a mixed step: one decode row, a chunk of six
              ([(22, 1), (16, 1)], tables, 4)]
    (with_call, without), made = run_both(model, script)
    # every step goes through it; a step with a chunk only where paged_attention would take its C++
    # path too (not on a CPU with AMX whose tiles the kernels cannot use: SDPA there)
    steps = sum(all(q == 1 for _, q in rows) or not cpu.amx() or cpu.amx_tiles() for rows, _, _ in script)
    assert made == steps > 0
    assert same(with_call, without)


def test_the_one_call_declines_what_the_separate_calls_do_another_way(model):
    """From ``WIDEN_ROWS`` rows the products take the many-rows layout, so the forward makes the
    calls itself; the result is the same either way."""
    tables = [list(range(BLOCKS))]
    script = [([(0, cpu.WIDEN_ROWS)], tables, 5), ([(cpu.WIDEN_ROWS, 1)], tables, 6)]
    (with_call, without), made = run_both(model, script)
    assert made == 1                                   # the decode step only
    assert same(with_call, without)


def test_a_declined_call_computes_and_writes_nothing(model):
    kv = caches(model)
    before = [t.clone() for pair in kv for t in pair]
    meta = AttentionMetadata.for_rows([(0, 2)], [0, 1], torch.tensor([[0]], dtype=torch.int32))
    cos, sin = model.cos[meta.positions], model.sin[meta.positions]
    hidden = model.config.hidden_size
    args = (kv, meta, cos, sin, 4, 2, 1e-6, 0.1)
    x = torch.randn(2, hidden).bfloat16()
    assert cpu.decoder_layers(x.float(), model.layers, *args) is None                       # float32 rows
    assert cpu.decoder_layers(x, model.layers[:2], *args) is None                           # a layer short
    plain = types.SimpleNamespace(**{**vars(model.layers[2]), "o": panels.unpack(model.layers[2].o)})
    assert cpu.decoder_layers(x, [*model.layers[:2], plain], *args) is None                 # a plain matrix
    assert all(torch.equal(a, b) for a, b in zip(before, [t for pair in kv for t in pair]))


def test_the_one_call_refuses_a_wrong_layout_with_what_disagrees(model):
    x = torch.randn(2, model.config.hidden_size).bfloat16()
    keys, values = zip(*caches(model))
    with pytest.raises(RuntimeError, match="8 weights and a key and a value cache per layer"):
        cpu.ops().decoder_layers(x, [model.layers[0].qkv], list(keys), list(values), [], model.cos[:2],
                                 model.sin[:2], 4, 2, 1e-6, 0.1, cpu.WIDEN_ROWS, False, False, False)
    layer = model.layers[0]
    weights = [layer.input_norm, layer.qkv, layer.q_norm, layer.k_norm, layer.o, layer.post_norm, layer.gate_up,
               layer.down]
    with pytest.raises(RuntimeError, match="8 weights and 4 metadata tensors"):
        cpu.ops().decoder_layers(x, weights, list(keys[:1]), list(values[:1]), [], model.cos[:2], model.sin[:2],
                                 4, 2, 1e-6, 0.1, cpu.WIDEN_ROWS, False, False, False)
