"""What the torch-npu wheel's documentation requires of each call the npu kernel set makes.

Each rule takes the bound arguments of one recorded call ({name: value}, defaults filled in)
and raises RuleError naming the op and the argument. The source of every rule is given beside
it: ``docs`` = torch_npu/_op_plugin_docs.py (the op's docstring), ``header`` =
AtbOpsInterface.h, ``atb .so`` = a message compiled into torch_npu/lib/libop_plugin_atb.so.
The ATB ops have no docstring in the wheel, so their rules are the shapes the declaration and
the kernel contract imply.
"""
from __future__ import annotations

import itertools
import math

import torch
from schema_kit import BindError, bind

HALF = (torch.float16, torch.bfloat16)
MASK_SHAPES = {(2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048)}


class RuleError(AssertionError):
    pass


def need(ok: bool, op: str, arg: str, what: str) -> None:
    if not ok:
        raise RuleError(f"{op}: argument {arg!r} {what}")


def _tensor(a, op, name, dim=None, dtypes=None):
    t = a[name]
    need(isinstance(t, torch.Tensor), op, name, "must be a tensor")
    if dim is not None:
        need(t.dim() == dim, op, name, f"must be {dim}-D, got shape {list(t.shape)}")
    if dtypes is not None:
        need(t.dtype in dtypes, op, name, f"must be {'/'.join(map(str, dtypes))}, got {t.dtype}")
    return t


def scatter_kv(a, op="npu_scatter_pa_kv_cache"):
    # docs: cache_mode None/'Norm' = ND caches only (the default 'PA_NZ' wants the NZ layout)
    need(a["cache_mode"] == "Norm", op, "cache_mode", f"must be 'Norm' for ND caches, got {a['cache_mode']!r}")
    kc = _tensor(a, op, "key_cache", 4, HALF + (torch.float32,))   # [blocks, block_size, kv_heads, D]
    vc = _tensor(a, op, "value_cache", 4, (kc.dtype,))              # docs: 数据类型必须一致
    need(vc.shape == kc.shape, op, "value_cache", "must match key_cache")
    slots = _tensor(a, op, "slot_mapping", 1, (torch.int32, torch.int64))
    for name in ("key", "value"):                                    # docs scenario 2: [T, N, D]
        t = _tensor(a, op, name, 3, (kc.dtype,))
        need(t.shape == (slots.shape[0], *kc.shape[2:]), op, name,
             f"must be [tokens, kv_heads, head_dim] = {[slots.shape[0], *kc.shape[2:]]}, got {list(t.shape)}")
    for name in ("key", "value", "key_cache", "value_cache", "slot_mapping"):
        need(a[name].is_contiguous(), op, name, "must be contiguous (docs: 输入参数不支持非连续)")
    for name in ("compress_lens", "compress_seq_offsets", "seq_lens"):
        need(a[name] is None, op, name, "is for the compressed 4-D form only")


def scatter_kv_values(a, op="npu_scatter_pa_kv_cache"):
    slots, kc = _valued(a, op, "slot_mapping"), a["key_cache"]
    # docs: [0, num_blocks*block_size-1], no repeats; -1: skipped (vllm-ascend's tests of the op)
    need(bool(((slots >= -1) & (slots < kc.shape[0] * kc.shape[1])).all()), op, "slot_mapping",
         "must hold -1 (skip) or a cache slot 0 <= slot < blocks * block_size")
    kept = slots[slots >= 0]
    need(kept.unique().numel() == kept.numel(), op, "slot_mapping", "must not name one slot twice")


def paged_attention(a, op="_npu_paged_attention"):
    q = _tensor(a, op, "query", 3, HALF)                       # [rows, heads, D]
    kc = _tensor(a, op, "key_cache", 4, (q.dtype,))            # [blocks, block_size, kv_heads, D]
    _tensor(a, op, "value_cache", 4, (q.dtype,))
    need(a["num_heads"] == q.shape[1], op, "num_heads", f"must be query.shape[1] = {q.shape[1]}")
    need(a["num_kv_heads"] == kc.shape[2], op, "num_kv_heads", f"must be key_cache.shape[2] = {kc.shape[2]}")
    bt = _tensor(a, op, "block_table", 2, (torch.int32,))
    need(bt.device == q.device, op, "block_table", "must be on the query's device")
    need(bt.shape[0] == q.shape[0], op, "block_table", "must have one row per query row")
    # atb .so: "Expected CPU tensor, please check whether the input seqlen tensor device is correct."
    cl = _tensor(a, op, "context_lens", 1, (torch.int32,))
    need(cl.device.type == "cpu", op, "context_lens", "must be a host (cpu) tensor")
    need(cl.shape[0] == q.shape[0], op, "context_lens", "must have one length per query row")
    need(bool((cl >= 1).all()) and int(cl.max()) <= bt.shape[1] * kc.shape[1], op, "context_lens",
         "must be 1 <= length <= block_table.shape[1] * block_size")
    out = _tensor(a, op, "out")
    need(out.shape == q.shape and out.dtype == q.dtype, op, "out", "must have the query's shape and dtype")


def block_ids(a, op, num_blocks):
    """docs (FIA): block ids are not validated, the caller guarantees them; padding included."""
    bt = _valued(a, op, "block_table")
    need(int(bt.min()) >= 0 and int(bt.max()) < num_blocks, op, "block_table",
         f"must hold block ids 0 <= id < {num_blocks}, padding included (got {int(bt.min())}..{int(bt.max())})")


def paged_attention_values(a, op="_npu_paged_attention"):
    block_ids(a, op, a["key_cache"].shape[0])


def fused_infer_attention_values(a, op="npu_fused_infer_attention_score"):
    if a["block_table"] is not None:
        block_ids(a, op, a["key"].shape[0])


def _valued(a, op, name):
    t = a[name]
    need(t.device.type != "meta", op, name, "was recorded without values (meta): record on the cpu")
    return t


def fused_infer_attention(a, op="npu_fused_infer_attention_score"):
    q = _tensor(a, op, "query", 3, HALF)
    need(a["input_layout"] == "TND", op, "input_layout", "is expected to be 'TND' here")
    tokens, heads, head_dim = q.shape
    need(q.is_contiguous(), op, "query", "must be contiguous (docs: 不支持非连续的Tensor)")
    # docs: TND needs actual_seq_lengths, each value the sum of this and all earlier batches
    cum = a["actual_seq_lengths"]
    need(cum is not None and len(cum) > 0, op, "actual_seq_lengths", "is required for TND")
    need(all(x >= 0 for x in cum) and all(b >= p for p, b in itertools.pairwise(cum)) and cum[-1] == tokens,
         op, "actual_seq_lengths", f"must be cumulative query lengths ending at T = {tokens}, got {list(cum)}")
    qlens = [b - p for p, b in zip([0, *cum], cum)]
    kv = a["actual_seq_lengths_kv"]
    need(kv is not None and len(kv) == len(cum), op, "actual_seq_lengths_kv",
         f"is required with TND and holds one value per batch (B = {len(cum)})")
    key, value = _tensor(a, op, "key", 3, (q.dtype,)), _tensor(a, op, "value", 3, (q.dtype,))
    need(value.shape == key.shape, op, "value", "must have the key's shape")
    kv_heads = a["num_key_value_heads"]
    need(a["num_heads"] == heads, op, "num_heads", f"must be query.shape[1] = {heads}")
    need(kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= 64, op, "num_key_value_heads",
         "must divide num_heads with a ratio of at most 64")
    need(head_dim % 16 == 0, op, "query", "D must be a multiple of 16 for float16/bfloat16")
    if a["block_table"] is None:
        kvlens = _unpaged(a, op, key, kv, kv_heads, head_dim)
    else:
        kvlens = _paged(a, op, q, key, kv, kv_heads, head_dim, len(cum))
    # docs: sparse_mode 3 = rightDownCausal, with the optimised 2048x2048 mask
    need(a["sparse_mode"] == 3, op, "sparse_mode", "is expected to be 3 (rightDownCausal)")
    mask = _tensor(a, op, "atten_mask", dtypes=(torch.bool, torch.int8, torch.uint8))
    need(mask.device == q.device, op, "atten_mask", "must be on the query's device")
    need(tuple(mask.shape) in MASK_SHAPES, op, "atten_mask", f"must be 2048x2048, got {list(mask.shape)}")
    # docs: sparse_mode=3 refuses a batch whose actual_seq_lengths_kv - actual_seq_lengths < 0
    need(all(k >= n for k, n in zip(kvlens, qlens)), op, "actual_seq_lengths_kv",
         "must be at least each batch's query length (sparse_mode=3)")


def _unpaged(a, op, key, kv, kv_heads, head_dim):
    """docs (TND without page attention): actual_seq_lengths_kv cumulative, like the queries'."""
    need(all(b >= p for p, b in itertools.pairwise(kv)) and kv[0] >= 0 and kv[-1] == key.shape[0],
         op, "actual_seq_lengths_kv", f"must be cumulative kv lengths ending at {key.shape[0]}, got {list(kv)}")
    need(tuple(key.shape[1:]) == (kv_heads, head_dim), op, "key",
         f"must be [kv tokens, kv_heads, D] without a block_table, got {list(key.shape)}")
    need(key.is_contiguous() and a["value"].is_contiguous(), op, "key", "must be contiguous")
    return [b - p for p, b in zip([0, *kv], kv)]


def _paged(a, op, q, key, kv, kv_heads, head_dim, batches):
    """docs (page attention): block_table int32 2-D, B rows, at least the longest row's blocks;
    actual_seq_lengths_kv per batch; the (blocks, block_size, H) cache layout."""
    bt = _tensor(a, op, "block_table", 2, (torch.int32,))
    need(bt.device == q.device, op, "block_table", "must be on the query's device")
    need(bt.shape[0] == batches, op, "block_table", f"must have B = {batches} rows")
    need(key.shape[2] == kv_heads * head_dim, op, "key",
         f"must be (blocks, block_size, kv_heads * D), got {list(key.shape)}")
    need(kv_heads * head_dim <= 65535, op, "key", "KV_N * D must not exceed 65535 in (blocks, block_size, H)")
    bs = a["block_size"]
    need(bs == key.shape[1], op, "block_size", f"must be key.shape[1] = {key.shape[1]}")
    need(bs % 128 == 0 and 128 <= bs <= 512, op, "block_size", "must be a multiple of 128 in 128..512")
    need(all(bt.shape[1] >= math.ceil(n / bs) for n in kv), op, "block_table",
         "second dim must cover the longest actual_seq_lengths_kv")
    return list(kv)


def rms_norm(a, op="npu_rms_norm", x="self"):
    t = _tensor(a, op, x, dtypes=HALF + (torch.float32,))
    need(2 <= t.dim() <= 8, op, x, f"must be 2-D to 8-D, got {t.dim()}-D")   # docs: 输入shape支持2-8维
    g = _tensor(a, op, "gamma", dtypes=(t.dtype,))                           # docs: 数据类型需要和self保持一致
    need(tuple(g.shape) == tuple(t.shape[t.dim() - g.dim():]), op, "gamma", "must be x's trailing dims")


def add_rms_norm(a, op="npu_add_rms_norm"):
    rms_norm(a, op, "x1")
    x2 = _tensor(a, op, "x2", dtypes=(a["x1"].dtype,))
    need(x2.shape == a["x1"].shape, op, "x2", "must have x1's shape")


def rotary(a, op="npu_apply_rotary_pos_emb"):
    need(a["layout"] == "BSND", op, "layout", "is expected to be 'BSND' here")
    need(a["rotary_mode"] == "half", op, "rotary_mode", "must be 'half' (the only mode on A2/A3)")
    q = _tensor(a, op, "query", 4)
    for name in ("query", "key", "cos", "sin"):
        t = _tensor(a, op, name, 4, (q.dtype,))                               # docs: 数据类型必须相同
        need(t.shape[:2] == q.shape[:2], op, name, "must share B and S with query")
        need(t.shape[3] in (64, 128), op, name, "D must be 128 or 64 (A2/A3)")
        need(t.is_contiguous(), op, name, "must be contiguous")
    need(a["key"].shape[3] == q.shape[3], op, "key", "must have the query's D")
    for name in ("cos", "sin"):
        need(a[name].shape[2] == 1, op, name, "must be (B, S, 1, D)")


RULES = {   # every recorded call: the signature's types are bound first (check_call)
    "npu_scatter_pa_kv_cache": scatter_kv,
    "_npu_paged_attention": paged_attention,
    "npu_fused_infer_attention_score": fused_infer_attention,
    "npu_rms_norm": rms_norm,
    "npu_add_rms_norm": add_rms_norm,
    "npu_apply_rotary_pos_emb": rotary,
}

VALUE_RULES = {   # calls recorded with values (on the cpu): what shapes cannot show
    "npu_scatter_pa_kv_cache": scatter_kv_values,
    "_npu_paged_attention": paged_attention_values,
    "npu_fused_infer_attention_score": fused_infer_attention_values,
}

# the outputs of each functional op that the kernel contract needs (the rest, e.g. rstd, may go)
NEEDED_OUTPUTS = {
    "npu_fused_infer_attention_score": (0,),
    "npu_rms_norm": (0,),
    "npu_add_rms_norm": (0, 2),
    "npu_apply_rotary_pos_emb": (0, 1),
}


def no_empty_tensors(op: str, bound: dict) -> None:
    """No custom op gets an empty tensor (docs, rope: 不支持空Tensor on A2/A3; vllm-ascend never
    passes one): a call with nothing to do is skipped by the kernel."""
    for name, value in bound.items():
        if isinstance(value, torch.Tensor):
            need(value.numel() > 0, op, name, f"is an empty tensor {list(value.shape)}: skip the call instead")


def check_call(signatures, call, *, values: bool = False) -> dict:
    """Bind one recorded call to its op's signature and apply the op's rules (``values``: also
    the rules that read tensor contents): the bound arguments, or BindError / RuleError naming
    the op and the argument."""
    if call.op not in signatures:
        raise BindError(f"{call.op}: the wheel has no such op")
    bound = bind(signatures[call.op], call.args, call.kwargs)
    no_empty_tensors(call.op, bound)
    RULES[call.op](bound)
    if values and call.op in VALUE_RULES:
        VALUE_RULES[call.op](bound)
    return bound


def derives_from(tensor, source) -> bool:
    """``tensor`` is ``source`` or a view of it (through any chain of views)."""
    while tensor is not None:
        if tensor is source:
            return True
        tensor = tensor._base
    return False


def check_results_used(signatures, calls, outputs) -> None:
    """Every functional op's needed outputs (NEEDED_OUTPUTS) are among the kernel's ``outputs``
    (or views of them): a kernel that drops them returns something the op did not compute."""
    outputs = [o for o in (outputs if isinstance(outputs, tuple) else (outputs,)) if isinstance(o, torch.Tensor)]
    for call in calls:
        if not signatures[call.op].functional:
            continue
        results = call.result if isinstance(call.result, tuple) else (call.result,)
        for i in NEEDED_OUTPUTS[call.op]:
            need(any(derives_from(o, results[i]) for o in outputs), call.op, f"result {i}",
                 "is dropped: the kernel must return what the functional op returns")
