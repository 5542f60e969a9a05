"""Run the npu kernel set on the CPU against a recording stand-in for torch_npu.

``StandIn`` takes the place of the torch_npu module: every op call is recorded (op name,
positional arguments, keyword arguments) and answered with the outputs the WHEEL's meta
registration infers for those arguments (ops without one, such as the ATB ops that write into
``out``, answer None). ``run_scenarios`` drives each kernel through the decode, prefill-chunk and
mixed cases with ``DEVICE_TYPE`` pointed at the scenario's stand-in device, so the fused paths
run instead of the reference fallbacks. The stand-in device is "meta" (shapes only, and
distinct from the cpu, so a host tensor passed where a device tensor belongs shows), except for
``write_kv``, whose slot values the checks read ("cpu").
"""
from __future__ import annotations

import dataclasses
import warnings
from unittest import mock

import torch
from meta_kit import MetaFunctions
from qwen_npu.kernels import AttentionMetadata
from qwen_npu.kernels import npu as npu_k


@dataclasses.dataclass
class Call:
    op: str
    args: tuple
    kwargs: dict
    result: object


class StandIn:
    """A torch_npu that records calls and answers with the wheel's meta shapes."""

    def __init__(self, meta: MetaFunctions):
        self.calls: list[Call] = []
        self._meta = meta

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


def attention_case(rows, block_size=BLOCK, seed=0, device=DEVICE):
    """rows: [(tokens computed before, query_len)] -> (query, key_cache, value_cache, meta), the
    host copies on the cpu and everything else on ``device``."""
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
    meta = AttentionMetadata.for_rows(rows, slots, bt, device)
    query = torch.randn(meta.num_tokens, KV_HEADS * GQA, HEAD_DIM, generator=gen).to(DTYPE)
    return query.to(device), kc.to(device), vc.to(device), meta


ATTENTION_ROWS = {
    "decode": ([(0, 1), (126, 1), (127, 1), (255, 1), (300, 1), (40, 1)], BLOCK),
    "decode, 256-token blocks": ([(0, 1), (255, 1), (600, 1)], 256),
    "prefill chunk": ([(100, 20), (128, 128), (0, 37)], BLOCK),
    "mixed": ([(0, 37), (300, 1), (5, 1), (250, 6)], BLOCK),
}


def _attention(rows, block_size):
    query, kc, vc, meta = attention_case(rows, block_size)
    out = npu_k.paged_attention(query, kc, vc, meta, HEAD_DIM ** -0.5)
    return out, [(tuple(query.shape), query.dtype)]


def _write_kv():
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(6, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    vc = torch.randn_like(kc)
    slots = torch.randperm(6 * BLOCK, generator=gen)[:40]
    slots[::3] = -1
    key = torch.randn(40, KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    return npu_k.write_kv(key, torch.randn_like(key), kc, vc, slots), [None]


def _rms_norm(shape):
    x = torch.randn(*shape).to(DTYPE).to(DEVICE)
    return npu_k.rms_norm(x, torch.ones(shape[-1], dtype=DTYPE, device=DEVICE), 1e-6), [(tuple(shape), DTYPE)]


def _add_rms_norm():
    x, res = (torch.randn(2, 7, 1024).to(DTYPE).to(DEVICE) for _ in range(2))
    out = npu_k.add_rms_norm(x, res, torch.ones(1024, dtype=DTYPE, device=DEVICE), 1e-6)
    return out, [((2, 7, 1024), DTYPE)] * 2


def _rope():
    t = 9
    q = torch.randn(t, KV_HEADS * GQA, HEAD_DIM).to(DTYPE).to(DEVICE)
    k = torch.randn(t, KV_HEADS, HEAD_DIM).to(DTYPE).to(DEVICE)
    cos, sin = torch.randn(t, HEAD_DIM, device=DEVICE), torch.randn(t, HEAD_DIM, device=DEVICE)
    return npu_k.rope(q, k, cos, sin), [(tuple(q.shape), DTYPE), (tuple(k.shape), DTYPE)]


SCENARIOS = {   # name: (stand-in device, run)
    **{name: (DEVICE, lambda rows=rows, bs=bs: _attention(rows, bs)) for name, (rows, bs) in ATTENTION_ROWS.items()},
    "write_kv": ("cpu", _write_kv),
    "rms_norm, hidden": (DEVICE, lambda: _rms_norm((5, 1024))),
    "rms_norm, per head": (DEVICE, lambda: _rms_norm((5, 8, HEAD_DIM))),
    "add_rms_norm": (DEVICE, _add_rms_norm),
    "rope": (DEVICE, _rope),
}


def run_with_stand_in(meta: MetaFunctions, device: str, run):
    """(result of run(), recorded calls, fallback warnings) with torch_npu replaced by a StandIn
    and ``device`` taken for the npu."""
    stand_in = StandIn(meta)
    npu_k.warn_fallback.cache_clear()
    try:
        with mock.patch.object(npu_k, "load_torch_npu", lambda: stand_in), \
                mock.patch.object(npu_k, "DEVICE_TYPE", device), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run()
    finally:
        npu_k.warn_fallback.cache_clear()
    fell_back = [str(w.message) for w in caught if "running the reference kernel" in str(w.message)]
    return result, stand_in.calls, fell_back


def run_scenarios(meta: MetaFunctions) -> dict[str, Scenario]:
    """Every scenario through the npu kernel set, torch_npu replaced by a StandIn. Raises if any
    kernel fell back to the reference (then nothing of it would be checked)."""
    out = {}
    for name, (device, run) in SCENARIOS.items():
        (output, expected), calls, fell_back = run_with_stand_in(meta, device, run)
        if fell_back:
            raise AssertionError(f"scenario {name!r} fell back to the reference: {fell_back}")
        out[name] = Scenario(calls, output, expected)
    return out
