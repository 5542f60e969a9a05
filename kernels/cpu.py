"""CPU kernels for x86-64 with AVX2 + FMA: the reference contract (README.md), faster.

On a CPU without native bf16 instructions, torch's bf16 matrix products take a slow generic
path (see docs/benchmarks.md). This set keeps bf16 storage (weights and KV cache)
but does all arithmetic in fp32:

    function         how                                              vs reference
    linear           C++: a Session's bf16 matrices packed at load     fp32 accumulation instead
                       into 16-column panels (``prepare_weight``,       of bf16 products
                       kernels/panels.py) and widened to fp32 in
                       registers (csrc/linear_packed.cpp): decode
                       streams each panel once, every block of it
                       taken by passes of up to 6 rows, prefill
                       (``WIDEN_ROWS`` rows on) widens two panels'
                       blocks into L1 for a 6 x 16 register tile (x
                       packed in 6-row groups, csrc/linear.cpp, which
                       also multiplies plain weights).
                       On a CPU with native bf16 (AVX512-BF16, AMX),    bf16 products (exact in
                       a Session's matrices are reordered once at load  fp32), fp32 sums
                       for oneDNN (``prepare_weight``, kernels/onednn.py)
                       and every product runs on them (up to 16 rows
                       on AMX tiles from the same bytes, csrc/
                       linear_amx.cpp: oneDNN's bits); plain bf16
                       weights below torch_rows() rows: C++
                       (csrc/linear_bf16.cpp) native bf16 dot products,
                       from it on torch's bf16 product
    paged_attention  C++ (csrc/attention*.cpp): each token reads only fp32 scores, softmax and
                       its own visible context through the block        weighted sum
                       table (no gather, no padding to the longest
                       row); a decode token takes all its KV heads
                       at once, so its K/V stream in memory order;
                       prefill tiles use a flash-style loop; on a CPU
                       with AVX512-BF16 both run on bf16 pairs (csrc/
                       attention_bf16.cpp, attention_decode_bf16.cpp:
                       P rounded to bf16 for P V); with AMX tiles
                       (``amx_tiles()``) a prefill row's products and a
                       decode token's scores run on the tiles (csrc/
                       attention_amx.cpp, attention_decode_amx.cpp);
                       the work split between threads by positions read
    write_kv         C++: one copy per token, negative slots skipped  identical
    rms_norm,        C++ (csrc/norm.cpp): one pass each instead of a   same roundings; the mean
      add_rms_norm,    dozen small torch ops per call; bf16 on 16       square's summation order
      rope             AVX-512 lanes where the CPU has them (csrc/      (norms only) differs;
                       elementwise_avx512.cpp, ``wide()``: the same     AVX-512 and AVX2 agree
                       bits as the 8-lane kernels)                      bit for bit
    qk_norm_rope     C++ (csrc/norm.cpp): both head norms and RoPE    bit-identical to rms_norm
                       in one pass over the qkv output's views          then rope of this set
    silu_mul         C++ (csrc/activation.cpp): silu(gate) * up       silu's exp: ~1e-7 relative
                       straight from the gate/up output                 in fp32
    decoder_layers   C++ (csrc/layer.cpp): every layer's calls above  the same bits as the
                       in one call from Python, for fewer than          separate calls
                       ``WIDEN_ROWS`` rows on panel weights

float32 models use torch's float32 matrix products for ``linear`` (already fast) and the C++
attention. Tolerances against the reference (tests/kernels/test_cpu.py): float32 atol = rtol
= 1e-5; bfloat16 atol = rtol = 2e-2.

The C++ sources (``csrc/``) are built once per machine by ``kernels/cpu_extension.py``.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import build, cpu_features, cpu_sdpa, onednn, panels, reference
from .cpu_extension import (CFLAGS, CSRC, HEADERS, SOURCES, availability, available,  # noqa: F401
                            ensure_built, extension, ops)
from .cpu_sdpa import SDPA_PAD, SDPA_PAD_FROM, SDPA_ROWS  # noqa: F401
from .metadata import AttentionMetadata

NAME = "cpu"
# From this many x rows on, plain weights are transposed in blocks of 16 rows (see csrc/linear.cpp).
PANEL_ROWS = 16
# From this many x rows on, a product on 16-column panels (kernels/panels.py) widens each panel's
# block into fp32 once for all rows (csrc/linear.cpp's layout); below, every row group widens it in
# registers (csrc/linear_packed.cpp). The same bits either way; the crossing on the 0.6B shapes.
WIDEN_ROWS = 96
# Up to this many x rows, a product on a weight reordered for oneDNN runs csrc/linear_amx.cpp on a CPU
# with AMX tiles (the same bits, the weights streamed 16-24% faster: docs/benchmarks.md).
AMX_ROWS = 16
# From this many x rows on, a CPU with AMX bf16 tiles runs torch's bf16 product (oneDNN on the tiles);
# below it the C++ kernels stream the weights as fast or faster (docs/benchmarks.md).
NATIVE_ROWS = 6
# Below this many x rows, a CPU with AVX512-BF16 and no AMX runs csrc/linear_bf16.cpp (bf16 dot products
# straight from bf16 x and weights), from it on torch's bf16 product: the crossing on the 0.6B shapes.
BF16_DOT_ROWS = 20
HALF_OR_FLOAT = (torch.bfloat16, torch.float32)


def native_bf16() -> bool:
    """Does this CPU multiply bf16 natively (AVX512-BF16 or AMX), so that torch's bf16 product is fast?"""
    return cpu_features.native_bf16()[0]


@functools.lru_cache(maxsize=1)
def bf16_dot() -> bool:
    """Can csrc/linear_bf16.cpp run here: a CPU with AVX512-BF16 and a build that has the kernel?"""
    if not cpu_features.avx512_bf16():
        return False
    try:
        return bool(ops().has_bf16_dot())
    except build.KernelBuildError:           # no build here: the set is not used at all
        return False


@functools.lru_cache(maxsize=1)
def wide() -> bool:
    """Do the bf16 norms and activation run on 16 AVX-512 lanes here (csrc/elementwise_avx512.cpp:
    a CPU with AVX-512 that no ``QWEN_NPU_CPU_ISA`` cap hides, and a build that has them)?"""
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_features.cpu_flags():
        return False
    try:
        return bool(ops().has_avx512_elementwise())
    except build.KernelBuildError:           # no build here: the set is not used at all
        return False


def amx() -> bool:
    """Does the CPU have AMX bf16 tiles (and no ``QWEN_NPU_CPU_ISA`` cap hides them)? torch's bf16
    product (oneDNN) runs on them."""
    return "amx_bf16" in cpu_features.cpu_flags()


@functools.lru_cache(maxsize=1)
def amx_tiles() -> bool:
    """Can the cpu set's own AMX kernels run here (csrc/linear_amx.cpp, csrc/attention*_amx.cpp):
    a CPU with AMX bf16 tiles and AVX512-BF16 that no ``QWEN_NPU_CPU_ISA`` cap hides, a build that
    has them, and the tile state granted by Linux?"""
    if not (amx() and cpu_features.avx512_bf16()):
        return False
    try:
        return bool(ops().has_amx_linear())
    except build.KernelBuildError:           # no build here: the set is not used at all
        return False


def torch_rows() -> int:
    """From how many x rows on bf16 products go to torch's (oneDNN's) product on this CPU: with
    AMX tiles from ``NATIVE_ROWS`` (they beat every vector kernel from a few rows), with only the
    AVX512-BF16 dot products from ``BF16_DOT_ROWS``; never without native bf16."""
    if not native_bf16():
        return 1 << 62
    return BF16_DOT_ROWS if bf16_dot() and not amx() else NATIVE_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T -> [..., N] in x's dtype, accumulated in fp32.

    A weight from ``prepare_weight`` (how a Session holds its bf16 matrices): on a CPU with
    native bf16, oneDNN's product on the reordered weight (kernels/onednn.py), up to ``AMX_ROWS``
    rows on a CPU with AMX tiles csrc/linear_amx.cpp on the same bytes; on one without, 16-column
    panels (kernels/panels.py, ``N`` = 16 x their first size) through csrc/linear_packed.cpp, x
    bf16 or fp32 on the CPU. Plain bf16
    weights: from ``torch_rows()`` rows on torch's bf16 product; fewer rows on a CPU with
    AVX512-BF16, csrc/linear_bf16.cpp (native bf16 dot products); everything else,
    csrc/linear.cpp (weights widened in registers)."""
    if weight.is_mkldnn:
        y = _amx_linear(x, weight)
        return y if y is not None else onednn.linear(x, weight)
    if weight.dim() == 3:          # 16-column panels: the only 3-D matrices (panels.is_packed)
        return ops().linear_packed(x, weight, WIDEN_ROWS)
    if weight.dtype == torch.float32 or x.device.type != "cpu":
        return F.linear(x, weight)
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.dim() > 0 and native_bf16():
        rows = x.numel() // max(x.shape[-1], 1)
        if rows >= torch_rows():
            return F.linear(x, weight)
        if bf16_dot():
            return ops().linear_bf16(x, weight)
    return ops().linear(x, weight, PANEL_ROWS)


def prepare_weight(weight: torch.Tensor) -> torch.Tensor:
    """The model's load: ``onednn.prepare_weight`` where the CPU has native bf16 (reordered for
    oneDNN; on a CPU with AMX tiles the AMX kernel's check of the result, ``amx_agrees``, made
    then rather than in the first decode step); without, bf16 matrices of a multiple of 16 rows
    as 16-column panels (kernels/panels.py), backed by huge pages. Anything else stays plain."""
    prepared = onednn.prepare_weight(weight)
    if prepared.is_mkldnn:
        amx_agrees(prepared)
    elif not native_bf16() and panels.packs(weight):
        prepared = panels.pack(weight)
        onednn.collapse_to_huge_pages(prepared.data_ptr(), prepared.nbytes)
    return prepared


def prepares_weights(dtype: torch.dtype) -> bool:
    """Does ``prepare_weight`` hold matrices of ``dtype`` in a form of its own (then the loader
    hands it plain tensors, each freed once its prepared form exists)? bf16: reordered for oneDNN
    on a CPU with native bf16, 16-column panels on one without."""
    return dtype == torch.bfloat16


def _amx_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight.T through csrc/linear_amx.cpp for up to ``AMX_ROWS`` bf16 rows of x and a weight
    reordered for oneDNN that the kernel reads to oneDNN's bits (``amx_agrees``); None (oneDNN
    then multiplies) everywhere else."""
    known = getattr(weight, "_amx_agrees", None)     # read here, not through amx_agrees: once per product
    if known is None or known[0] != torch.get_num_threads():
        amx_agrees(weight)
        known = weight._amx_agrees
    n, k = known[3]
    if not known[1] or x.dtype != torch.bfloat16 or x.shape[-1] != k:
        return None
    if x.dim() == 2:                                # the model's calls: no reshape to pay for
        return ops().linear_amx(x, known[2], n) if 0 < x.shape[0] <= AMX_ROWS else None
    rows = x.numel() // max(k, 1)
    if not 0 < rows <= AMX_ROWS:
        return None
    y = ops().linear_amx(x.reshape(rows, k), known[2], n)
    return None if y is None else y.view(*x.shape[:-1], n)


AGREEMENT_ROWS = (4, AMX_ROWS)      # the row counts amx_agrees multiplies at


def amx_agrees(weight: torch.Tensor) -> bool:
    """Does csrc/linear_amx.cpp give oneDNN's bits for this reordered weight, at this thread count?

    The kernel assumes oneDNN's blocked layout and sums K in order, as oneDNN does unless it splits
    the sum across threads (it may on hosts with many cores). So on a weight's first product at a
    thread count, both multiply random rows (``AGREEMENT_ROWS``) and must agree bit for bit (NaN
    where the other has NaN); the answer is kept on the weight as (threads, answer, the address of
    the reordered bytes, (N, K))."""
    threads = torch.get_num_threads()
    known = getattr(weight, "_amx_agrees", None)
    if known is None or known[0] != threads:
        n, k = weight.shape
        address = torch.ops.mkldnn.data_ptr(weight)
        ok = weight.dtype == torch.bfloat16 and n % 32 == 0 and k % 32 == 0 and amx_tiles()
        gen = torch.Generator().manual_seed(0)
        for rows in AGREEMENT_ROWS if ok else ():
            x = torch.randn(rows, k, generator=gen).bfloat16()
            y = ops().linear_amx(x, address, n)
            ok = ok and y is not None and same_bits(y, onednn.linear(x, weight))
        known = (threads, ok, address, (n, k))
        weight._amx_agrees = known
    return known[1]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Are ``a`` and ``b`` the same values, NaN where the other is NaN (a weight whose probe rows
    overflow still agrees)?"""
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """As ``reference.write_kv``: scatter by slot, negative slots never written."""
    ops().write_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """As ``reference.paged_attention`` (decode and prefill), computed in fp32 except where the
    CPU has native bf16 (the products in bf16, exact in fp32, within the bf16 tolerance of the
    fp32 loop). Where ``amx_tiles()`` says the C++ kernel can use AMX tiles, it runs every bf16
    row on them (csrc/attention_amx.cpp, csrc/attention_decode_amx.cpp); on a CPU whose tiles it
    cannot use, the bf16 prefill rows of ``SDPA_ROWS`` tokens or more go to torch's
    ``scaled_dot_product_attention`` on the row's gathered K/V instead."""
    if meta.is_decode or query.dtype != torch.bfloat16 or not amx() or amx_tiles():
        return ops().paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, float(scale), bf16_dot(), amx=amx_tiles())
    def rest(q, block_tables, seq_lens, query_start_loc):
        return ops().paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                     float(scale), bf16_dot(), amx=amx_tiles())
    return cpu_sdpa.paged_attention(query, key_cache, value_cache, meta, scale, rest)


def _fused(*tensors: torch.Tensor) -> bool:
    """Can the C++ elementwise kernels take these (cpu, one dtype, bf16 or fp32)? Called for every
    kernel call, so it reads only cheap attributes (``device`` builds a new object each time)."""
    dtype = tensors[0].dtype
    if dtype not in HALF_OR_FLOAT:
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype != dtype:
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As ``reference.rms_norm``, in one pass (same roundings; the mean's summation order differs)."""
    if not _fused(x, weight) or x.numel() == 0:
        return reference.rms_norm(x, weight, eps)
    return ops().rms_norm(x, weight, float(eps), wide())


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``reference.add_rms_norm``: (rms_norm(x + residual), x + residual) in one pass."""
    if not _fused(x, residual, weight) or x.shape != residual.shape or x.numel() == 0:
        return reference.add_rms_norm(x, residual, weight, eps)
    return tuple(ops().add_rms_norm(x, residual, weight, float(eps), wide()))


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``reference.rope`` (bit-identical): q [T, H, D], k [T, KV, D], cos/sin [T, D]."""
    if not _fused(q, k) or q.dim() != 3 or q.shape[0] == 0 or cos.device != q.device:
        return reference.rope(q, k, cos, sin)
    return tuple(ops().rope(q, k, cos, sin))


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos, sin)`` in one pass.

    q [T, H, D], k [T, KV, D] (views into the fused qkv output are read in place), weights [D],
    cos/sin [T, D] -> new contiguous (q, k). Bit-identical to this set's ``rms_norm`` then ``rope``.
    """
    if (not _fused(q, k, q_weight, k_weight) or q.dim() != 3 or k.dim() != 3 or q.shape[0] == 0
            or cos.device != q.device):
        return rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos, sin)
    return tuple(ops().qk_norm_rope(q, k, q_weight, k_weight, float(eps), cos, sin, wide()))


def greedy_health(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(``logits.argmax(-1)``, the health codes of ``engine/sampler.health_codes``) of float32
    logits [rows, vocab] in one read (csrc/greedy.cpp), identical to the torch calls, NaN rows
    included; None for logits it does not take (the sampler then makes the torch calls)."""
    if logits.dtype != torch.float32 or not logits.is_cpu or logits.dim() != 2 or logits.shape[1] == 0:
        return None
    return tuple(ops().greedy_health(logits))


def pack_greedy(ids: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> None:
    """``reference.pack_greedy`` in one call without a tensor operation (csrc/products.cpp)."""
    ops().pack_greedy(ids, codes, out)


def lm_head(x: torch.Tensor, weight: torch.Tensor,
            out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The LM head with greedy sampling's read fused: ``out.copy_(linear(x, weight))`` (float32
    logits [rows, N], contiguous) and ``greedy_health(out)``, the same bits, in one pass: each
    row's argmax and health code are made while its logits are stored (csrc/greedy.h), so no second
    read of the logits follows. For a weight the set multiplies in its own kernel (AMX tiles up to
    ``AMX_ROWS`` rows, panels below ``WIDEN_ROWS``); None, with nothing written, for the rest."""
    rows = x.shape[0] if x.dim() == 2 else -1
    if not (out.dtype == torch.float32 and out.is_contiguous() and out.shape[0] == rows and x.is_cpu and out.is_cpu):
        return None
    if weight.is_mkldnn:
        if not (x.dtype == torch.bfloat16 and rows <= AMX_ROWS and amx_agrees(weight)):
            return None
        found = ops().lm_head_amx(x, weight._amx_agrees[2], weight.shape[0], out)
    elif weight.dim() == 3 and x.dtype in HALF_OR_FLOAT:       # 16-column panels
        found = ops().lm_head_packed(x, weight, out, WIDEN_ROWS)
    else:
        return None
    return None if found[0] is None else found


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``silu_mul(linear(x, weight))`` in one pass over the gate|up weights, the same bits, where the
    set has that pass: on AMX tiles (csrc/linear_amx.cpp) for up to ``AMX_ROWS`` bf16 rows of a
    weight reordered for oneDNN whose products the tiles give to oneDNN's bits (``amx_agrees``),
    2 x a multiple of 32 outputs; on 16-column panels (csrc/linear_packed.cpp) below
    ``WIDEN_ROWS`` bf16 rows, an even number of panels. None, with nothing computed, elsewhere."""
    if not (x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] > 0 and x.is_cpu):
        return None
    if weight.dim() == 3:          # 16-column panels
        # the binding declines WIDEN_ROWS rows or more itself, before it converts or allocates
        return ops().gate_up_silu_packed(x, weight, WIDEN_ROWS) if x.shape[1] == weight.shape[1] else None
    if not (weight.is_mkldnn and x.shape[0] <= AMX_ROWS and amx_agrees(weight)):
        return None
    _, _, address, (n, k) = weight._amx_agrees
    if x.shape[1] != k or n % 64:
        return None
    return ops().gate_up_silu_amx(x, address, n)


def decoder_layers(x: torch.Tensor, layers, kv_caches, meta: AttentionMetadata, cos: torch.Tensor,
                   sin: torch.Tensor, heads: int, kv_heads: int, eps: float,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every decoder layer, none with a hook, in one call (csrc/layer.cpp): for each layer in turn
    the calls the model's forward makes through this set for it (norm, q|k|v, ``qk_norm_rope``,
    ``write_kv``, ``paged_attention``, o, norm, ``gate_up_silu``, down), in the same order on the
    same kernels, so the same bits; returns (x, residual) after the last layer. ``layers``: the
    model's ``LayerWeights``; ``kv_caches``: (key_cache, value_cache) per layer. For bf16 rows
    below ``WIDEN_ROWS`` and matrices held as 16-column panels (a CPU without native bf16), where
    the separate calls make these products too; None, with nothing computed, everywhere else (the
    forward then makes them one by one)."""
    if not (x.dtype == torch.bfloat16 and x.dim() == 2 and 0 < x.shape[0] < WIDEN_ROWS and x.is_cpu
            and cos.is_cpu and sin.is_cpu and heads > 0 and kv_heads > 0 and len(layers) == len(kv_caches) > 0
            and (meta.is_decode or not amx() or amx_tiles())):   # where paged_attention takes its C++ path
        return None
    weights = []
    for layer in layers:
        mats = (layer.qkv, layer.o, layer.gate_up, layer.down)
        norms = (layer.input_norm, layer.q_norm, layer.k_norm, layer.post_norm)
        if not (all(m.dim() == 3 for m in mats) and all(w.dtype == x.dtype and w.is_cpu for w in norms)):
            return None
        weights += (layer.input_norm, layer.qkv, layer.q_norm, layer.k_norm, layer.o, layer.post_norm,
                    layer.gate_up, layer.down)
    return tuple(ops().decoder_layers(
        x, weights, [k for k, _ in kv_caches], [v for _, v in kv_caches],
        [meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc], cos, sin, heads, kv_heads,
        float(eps), float(scale), WIDEN_ROWS, wide(), bf16_dot(), amx_tiles()))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * I] -> ``F.silu(gate) * up`` [..., I], gate and up the two halves, in one pass
    (silu rounded to the dtype before the product, as the two torch ops round)."""
    if not _fused(gate_up) or gate_up.numel() == 0:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return ops().silu_mul(gate_up, wide())
