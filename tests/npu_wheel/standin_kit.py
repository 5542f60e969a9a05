"""Run the npu kernel set on the CPU against a recording stand-in for torch_npu.

``StandIn`` takes the place of the torch_npu module: every op call is recorded (op name,
positional arguments, keyword arguments) and answered with the outputs the WHEEL's meta
registration infers for those arguments (ops without one, such as the ATB ops that write into
``out``, answer None). ``run_scenarios`` drives each kernel through the decode, prefill-chunk, all-fresh
(one with a skipped token), mixed and empty cases with ``DEVICE_TYPE`` pointed at the scenario's stand-in device, so the
fused paths run instead of the reference fallbacks. The stand-in device is "meta" (shapes only,
and distinct from the cpu, so a host tensor passed where a device tensor belongs shows), except
for ``write_kv``, whose slot values the checks read ("cpu"); ``run_scenarios(meta, "cpu")``
records every scenario with values, for the rules that read them (block ids, slots).
"""
from __future__ import annotations

import dataclasses
import warnings
from unittest import mock

import torch
from meta_kit import MetaFunctions
from qwen_npu.kernels import AttentionMetadata
from qwen_npu.kernels import npu as npu_k

from qwen_npu.device.npu_runtime import ATB_OPS, CUSTOM_OPS


@dataclasses.dataclass
class Call:
    op: str
    args: tuple
    kwargs: dict
    result: object


ALL_OPS = {op: None for op in (*CUSTOM_OPS, *ATB_OPS)}   # op_support of a stack that has every op


class StandIn:
    """A torch_npu that records calls and answers with the wheel's meta shapes. ``support`` is
    what the kernel set's probe of the installed stack sees (``npu_runtime.op_support``)."""

    def __init__(self, meta: MetaFunctions, support: dict[str, str | None] | None = None):
        self.calls: list[Call] = []
        self._meta = meta
        self.support = dict(ALL_OPS if support is None else support)

    def __getattr__(self, op):
        if op.startswith("__"):
            raise AttributeError(op)

        def call(*args, **kwargs):
            result = self._meta.run(op, *args, **kwargs) if op in self._meta.registered else None
            self.calls.append(Call(op, args, dict(kwargs), result))
            return result
        return call


@dataclasses.dataclass
class Scenario:
    calls: list[Call]
    output: object          # what the kernel returned
    expected: object        # (shape, dtype) per output, from the kernel contract


DTYPE = torch.bfloat16
BLOCK = 128
HEAD_DIM = 128
KV_HEADS = 2
GQA = 4


DEVICE = "meta"


def attention_case(rows, block_size=BLOCK, seed=0, device=DEVICE, skipped=()):
    """rows: [(tokens computed before, query_len)] -> (query, key_cache, value_cache, meta), the
    host copies on the cpu and everything else on ``device``; the tokens at the indices in
    ``skipped`` get slot -1 (their position's slot in the table keeps what the cache holds)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(done + q) // block_size) for done, q in rows]
    free = (torch.randperm(sum(need) + 2, generator=gen) + 1).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    kc = torch.randn(sum(need) + 3, block_size, KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    vc = torch.randn_like(kc)
    bt = torch.full((len(rows), max(need) + 1), -1, dtype=torch.int32)
    for r, table in enumerate(tables):
        bt[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
    slots = [tables[r][p // block_size] * block_size + p % block_size
             for r, (done, q) in enumerate(rows) for p in range(done, done + q)]
    for t in skipped:
        slots[t] = -1
    meta = AttentionMetadata.for_rows(rows, slots, bt, device)
    query = torch.randn(meta.num_tokens, KV_HEADS * GQA, HEAD_DIM, generator=gen).to(DTYPE)
    return query.to(device), kc.to(device), vc.to(device), meta


ATTENTION_ROWS = {   # name: (rows, block size, tokens with slot -1)
    "decode": ([(0, 1), (126, 1), (127, 1), (255, 1), (300, 1), (40, 1)], BLOCK, ()),
    "decode, 256-token blocks": ([(0, 1), (255, 1), (600, 1)], 256, ()),
    "decode, all fresh": ([(0, 1), (0, 1), (0, 1)], BLOCK, ()),
    "prefill chunk": ([(100, 20), (128, 128), (0, 37)], BLOCK, ()),
    "prefill, all fresh": ([(0, 37), (0, 128), (0, 5), (0, 200)], BLOCK, ()),
    "prefill, all fresh, a skipped token": ([(0, 37), (0, 5)], BLOCK, (3,)),
    "mixed": ([(0, 37), (300, 1), (5, 1), (250, 6)], BLOCK, ()),
}
NO_FIA = {**ALL_OPS, "npu_fused_infer_attention_score": "the stand-in stack has no FIA"}


def _attention(device, rows, block_size, skipped=()):
    query, kc, vc, meta = attention_case(rows, block_size, device=device, skipped=skipped)
    out = npu_k.paged_attention(query, kc, vc, meta, HEAD_DIM ** -0.5)
    return out, [(tuple(query.shape), query.dtype)]


def no_tokens_case(device):
    """A step of no rows and no tokens: (query, key_cache, value_cache, meta)."""
    kc = torch.randn(3, BLOCK, KV_HEADS, HEAD_DIM).to(DTYPE).to(device)
    meta = AttentionMetadata(
        positions=torch.empty(0, dtype=torch.int64, device=device),
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        block_tables=torch.empty(0, 1, dtype=torch.int32, device=device),
        seq_lens=torch.empty(0, dtype=torch.int32, device=device),
        query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
        query_lens_host=(), seq_lens_host=(), is_decode=True)
    return torch.empty(0, KV_HEADS * GQA, HEAD_DIM, dtype=DTYPE, device=device), kc, torch.randn_like(kc), meta


def _attention_no_tokens(device):
    query, kc, vc, meta = no_tokens_case(device)
    return npu_k.paged_attention(query, kc, vc, meta, HEAD_DIM ** -0.5), [(tuple(query.shape), DTYPE)]


def _write_kv(device, pattern="mixed"):
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(6, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    vc = torch.randn_like(kc)
    n = 0 if pattern == "no tokens" else 40
    slots = torch.randperm(6 * BLOCK, generator=gen)[:n]
    slots[::3] = -1
    if pattern == "all skipped":
        slots[:] = -1
    key = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    kc, vc, slots, key = (t.to(device) for t in (kc, vc, slots, key))
    return npu_k.write_kv(key, torch.randn_like(key), kc, vc, slots), [None]


def _rms_norm(device, shape):
    x = torch.randn(*shape).to(DTYPE).to(device)
    return npu_k.rms_norm(x, torch.ones(shape[-1], dtype=DTYPE, device=device), 1e-6), [(tuple(shape), DTYPE)]


def _add_rms_norm(device, rows=7):
    x, res = (torch.randn(rows, 1024).to(DTYPE).to(device) for _ in range(2))
    out = npu_k.add_rms_norm(x, res, torch.ones(1024, dtype=DTYPE, device=device), 1e-6)
    return out, [((rows, 1024), DTYPE)] * 2


def _rope(device, t=9):
    q = torch.randn(t, KV_HEADS * GQA, HEAD_DIM).to(DTYPE).to(device)
    k = torch.randn(t, KV_HEADS, HEAD_DIM).to(DTYPE).to(device)
    cos, sin = torch.randn(t, HEAD_DIM, device=device), torch.randn(t, HEAD_DIM, device=device)
    return npu_k.rope(q, k, cos, sin), [(tuple(q.shape), DTYPE), (tuple(k.shape), DTYPE)]


SCENARIOS = {   # name: (stand-in device, run, what the stand-in stack has)
    **{name: (DEVICE, lambda d, rows=rows, bs=bs, skip=skip: _attention(d, rows, bs, skip), ALL_OPS)
       for name, (rows, bs, skip) in ATTENTION_ROWS.items()},
    "decode, ATB (no FIA)": (DEVICE, lambda d: _attention(d, ATTENTION_ROWS["decode"][0], BLOCK), NO_FIA),
    "decode, all fresh, ATB (no FIA)": (
        DEVICE, lambda d: _attention(d, ATTENTION_ROWS["decode, all fresh"][0], BLOCK), NO_FIA),
    "paged_attention, no tokens": (DEVICE, _attention_no_tokens, ALL_OPS),
    "write_kv": ("cpu", _write_kv, ALL_OPS),
    "write_kv, all skipped": ("cpu", lambda d: _write_kv(d, "all skipped"), ALL_OPS),
    "write_kv, no tokens": ("cpu", lambda d: _write_kv(d, "no tokens"), ALL_OPS),
    "rms_norm, hidden": (DEVICE, lambda d: _rms_norm(d, (5, 1024)), ALL_OPS),
    "rms_norm, per head": (DEVICE, lambda d: _rms_norm(d, (5, 8, HEAD_DIM)), ALL_OPS),
    "rms_norm, no rows": (DEVICE, lambda d: _rms_norm(d, (0, 1024)), ALL_OPS),
    "add_rms_norm": (DEVICE, _add_rms_norm, ALL_OPS),
    "add_rms_norm, no rows": (DEVICE, lambda d: _add_rms_norm(d, 0), ALL_OPS),
    "rope": (DEVICE, _rope, ALL_OPS),
    "rope, no tokens": (DEVICE, lambda d: _rope(d, 0), ALL_OPS),
}
EMPTY = ("write_kv, no tokens", "paged_attention, no tokens", "rms_norm, no rows", "add_rms_norm, no rows",
         "rope, no tokens")                             # nothing to compute: no op is called


def run_with_stand_in(meta: MetaFunctions, device: str, run, support=None, stand_in=None):
    """(result of run(), recorded calls, fallback warnings) with torch_npu replaced by a StandIn
    (or ``stand_in``) whose stack has the ops in ``support``, and ``device`` taken for the npu."""
    stand_in = stand_in or StandIn(meta, support)
    npu_k.warn_fallback.cache_clear()
    try:
        with mock.patch.object(npu_k, "load_torch_npu", lambda: stand_in), \
                mock.patch.object(npu_k, "op_support", lambda: stand_in.support), \
                mock.patch.object(npu_k, "DEVICE_TYPE", device), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run()
    finally:
        npu_k.warn_fallback.cache_clear()
    fell_back = [str(w.message) for w in caught if "running the reference kernel" in str(w.message)]
    return result, stand_in.calls, fell_back


def run_scenarios(meta: MetaFunctions, device: str | None = None) -> dict[str, Scenario]:
    """Every scenario through the npu kernel set, torch_npu replaced by a StandIn, on each
    scenario's device (``device``: all on that one, e.g. "cpu" to record values). Raises if any
    kernel fell back to the reference (then nothing of it would be checked)."""
    out = {}
    for name, (where, run, support) in SCENARIOS.items():
        on = device or where
        (output, expected), calls, fell_back = run_with_stand_in(
            meta, on, lambda run=run, on=on: run(on), support)
        if fell_back:
            raise AssertionError(f"scenario {name!r} fell back to the reference: {fell_back}")
        out[name] = Scenario(calls, output, expected)
    return out
