"""CPU kernels for x86-64 with AVX2 + FMA: the reference contract (README.md), faster.

On a CPU without native bf16 instructions, torch's bf16 matrix products take a slow generic
path (see docs/benchmarks.md). This set keeps bf16 storage (weights and KV cache)
but does all arithmetic in fp32:

    function         how                                              vs reference
    linear           C++ (csrc/linear.cpp): bf16 weights widened in   fp32 accumulation instead
                       registers; one row (batch-1 decode) streams      of bf16 products
                       4 weight rows at a time, prefetched ahead; few
                       rows (decode, LM head) stream each weight row
                       once, many rows (prefill) run
                       a 6 x 16 register tile: x packed in 6-row
                       groups, weights in transposed 16-row panels.
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

float32 models use torch's float32 matrix products for ``linear`` (already fast) and the C++
attention. Tolerances against the reference (tests/kernels/test_cpu.py): float32 atol = rtol
= 1e-5; bfloat16 atol = rtol = 2e-2.

The C++ sources (``csrc/``) are compiled once per machine by ``kernels/build.py`` (a C++ compiler,
the Python headers and ninja are needed; about a minute or two), when the first Session that uses the set
is made, or ahead of time with ``qwen-npu build-kernels`` / ``qwen_npu.build_kernels()``. The
build is cached under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), in a
folder named after a hash of the sources, flags, torch and Python versions, so an edited source is
rebuilt and never mixed with an old build. ``availability()`` says whether this machine can build
the set; ``kernels="auto"`` picks it wherever it can (``kernels/cpu_choice.py``).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

from . import build, cpu_features, onednn, reference
from .metadata import AttentionMetadata
from .onednn import prepares as prepares_weights  # noqa: F401

NAME = "cpu"
CSRC = Path(__file__).with_name("csrc")
SOURCES = ("module.cpp", "linear.cpp", "linear_bf16.cpp", "linear_amx.cpp", "attention.cpp", "attention_bf16.cpp", "attention_decode.cpp",
           "attention_decode_bf16.cpp", "attention_decode_amx.cpp", "attention_amx.cpp", "elementwise_avx512.cpp",
           "norm.cpp",
           "activation.cpp", "greedy.cpp", "peak.cpp")
HEADERS = ("vec.h", "vec512.h", "elementwise.h", "attention.h", "amx.h")
# -fopenmp: at::parallel_for is a header template; without it the kernels would run on one thread
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp")
# From this many x rows on, the weights are transposed in 16-row panels (see csrc/linear.cpp).
PANEL_ROWS = 16
# Up to this many x rows, a product on a weight reordered for oneDNN runs csrc/linear_amx.cpp on a CPU
# with AMX tiles (the same bits, the weights streamed 16-24% faster: docs/benchmarks.md).
AMX_ROWS = 16
# From this many x rows on, a CPU with AMX bf16 tiles runs torch's bf16 product (oneDNN on the tiles);
# below it the C++ kernels stream the weights as fast or faster (docs/benchmarks.md).
NATIVE_ROWS = 6
# Below this many x rows, a CPU with AVX512-BF16 and no AMX runs csrc/linear_bf16.cpp (bf16 dot products
# straight from bf16 x and weights), from it on torch's bf16 product: the crossing on the 0.6B shapes.
BF16_DOT_ROWS = 20
# From this many tokens on, a bf16 prefill row on a CPU with AMX tiles that the C++ kernels cannot use
# (``amx_tiles()`` false: a build or a process without them) runs torch's SDPA (paged_attention).
SDPA_ROWS = 16
# A causal row longer than SDPA_PAD_FROM tokens is zero-padded at its end to a multiple of SDPA_PAD
# for SDPA, which is up to twice as fast on such lengths (docs/benchmarks.md); the padding is
# past every real token, so the causal mask keeps it from their outputs.
SDPA_PAD, SDPA_PAD_FROM = 16, 128

HALF_OR_FLOAT = (torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=1)
def availability() -> tuple[bool, str]:
    """(can this machine build and run the set?, the reason in words). Compiles nothing; a build
    that was tried and failed is reported by ``build.build_status(extension())``."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return False, f"the CPU's vector capability is {cap}; these kernels need AVX2 + FMA"
    cxx = os.environ.get("CXX", "c++")              # what torch's builder runs
    if shutil.which(cxx) is None:
        return False, f"no C++ compiler: {cxx!r} (from {'CXX' if 'CXX' in os.environ else 'the default'}) is not on PATH"
    if build.ninja_path() is None:
        return False, "ninja is not installed (pip install ninja) to build the kernels"
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.exists():
        return False, f"the Python headers are missing ({header}; install python3-dev or the like)"
    return True, f"{cap} CPU, C++ compiler {shutil.which(cxx)}"


def available() -> bool:
    return availability()[0]


@functools.lru_cache(maxsize=1)
def extension() -> build.Extension:
    """The extension to build: its name carries a hash of everything that changes the binary."""
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    digest.update(f"{torch.__version__} {sys.version}".encode())
    for name in SOURCES + HEADERS:
        digest.update((CSRC / name).read_bytes())
    return build.Extension(name=f"qwen_npu_cpu_{digest.hexdigest()[:12]}",
                           sources=tuple(str(CSRC / n) for n in SOURCES), cflags=CFLAGS,
                           ldflags=("-fopenmp",), include_paths=(str(CSRC),))


def ensure_built(*, log=None, progress: bool = True):
    """Build (or load) the C++ extension now; ``build.KernelBuildError`` says why it cannot."""
    ok, reason = availability()
    if not ok:
        raise build.KernelBuildError(f"the cpu kernel set cannot be built here: {reason}")
    return build.ensure_built(extension(), log=log, progress=progress)


@functools.lru_cache(maxsize=1)
def ops():
    """The compiled extension (a Session builds it when it is made; this loads it if not)."""
    return ensure_built()


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

    A weight from ``prepare_weight`` (bf16 on a CPU with native bf16: how a Session holds its
    matrices there): oneDNN's product on the reordered weight (kernels/onednn.py); up to
    ``AMX_ROWS`` rows on a CPU with AMX tiles, csrc/linear_amx.cpp on the same bytes. Plain bf16
    weights: from ``torch_rows()`` rows on torch's bf16 product; fewer rows on a CPU with
    AVX512-BF16, csrc/linear_bf16.cpp (native bf16 dot products); everything else,
    csrc/linear.cpp (weights widened in registers)."""
    if weight.is_mkldnn:
        y = _amx_linear(x, weight)
        return y if y is not None else onednn.linear(x, weight)
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
    """The model's load: ``onednn.prepare_weight`` (reordered for oneDNN where the CPU has native
    bf16), and on a CPU with AMX tiles the AMX kernel's check of the result (``amx_agrees``) made
    then rather than in the first decode step."""
    prepared = onednn.prepare_weight(weight)
    if prepared.is_mkldnn:
        amx_agrees(prepared)
    return prepared


def _amx_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight.T through csrc/linear_amx.cpp for up to ``AMX_ROWS`` bf16 rows of x and a weight
    reordered for oneDNN that the kernel reads to oneDNN's bits (``amx_agrees``); None (oneDNN
    then multiplies) everywhere else."""
    n, k = weight.shape
    rows = x.numel() // max(k, 1)
    if not (0 < rows <= AMX_ROWS and x.dtype == weight.dtype == torch.bfloat16 and x.shape[-1] == k
            and amx_agrees(weight)):
        return None
    y = ops().linear_amx(x.reshape(rows, k), weight._amx_agrees[2], n)
    return None if y is None else y.view(*x.shape[:-1], n)


AGREEMENT_ROWS = (4, AMX_ROWS)      # the row counts amx_agrees multiplies at


def amx_agrees(weight: torch.Tensor) -> bool:
    """Does csrc/linear_amx.cpp give oneDNN's bits for this reordered weight, at this thread count?

    The kernel assumes oneDNN's blocked layout and sums K in order, as oneDNN does unless it splits
    the sum across threads (it may on hosts with many cores). So on a weight's first product at a
    thread count, both multiply random rows (``AGREEMENT_ROWS``) and must agree bit for bit; the
    answer is kept on the weight as (threads, answer, the address of the reordered bytes)."""
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
            ok = ok and y is not None and torch.equal(y, onednn.linear(x, weight))
        known = (threads, ok, address)
        weight._amx_agrees = known
    return known[1]


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
    split = _last_split
    if split is None or split[0] is not meta:            # once per step: every layer shares the metadata
        split = _split_rows(meta)
    out = torch.empty_like(query)
    for a, b, table, context, mask in split[1]:
        out[a:b] = _sdpa_row(query[a:b], key_cache, value_cache, table, context, mask, scale)
    if split[2] is not None:     # the rest (decode rows of a mixed step, short chunks) in one fp32 call
        tokens, tables, seq_lens, starts = split[2]
        out[tokens] = ops().paged_attention(query[tokens], key_cache, value_cache, tables, seq_lens, starts,
                                            float(scale), bf16_dot(), amx=amx_tiles())
    return out


_last_split: tuple | None = None


def _split_rows(meta: AttentionMetadata) -> tuple:
    """(meta, the SDPA rows [(token start, end, block table, context, mask or None)], the C++ rows
    (token index, block tables, seq_lens, query starts) or None), kept for the step's next layers."""
    global _last_split
    starts = [0, *itertools.accumulate(meta.query_lens_host)]
    long, short = [], []
    for r, n in enumerate(meta.query_lens_host):
        if n < SDPA_ROWS:
            short.append(r)
            continue
        context = meta.seq_lens_host[r]
        mask = None              # queries past a cached prefix: key j is visible to query i if j <= start + i
        if n < context:
            mask = torch.arange(context)[None, :] <= torch.arange(context - n, context)[:, None]
        long.append((starts[r], starts[r + 1], meta.block_tables[r], context, mask))
    rest = None
    if short:
        rows = torch.tensor(short)
        lens = [meta.query_lens_host[r] for r in short]
        rest = (torch.cat([torch.arange(starts[r], starts[r + 1]) for r in short]), meta.block_tables[rows],
                meta.seq_lens[rows], torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32))
    _last_split = (meta, long, rest)
    return _last_split


def _sdpa_row(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
              context: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One row's attention: q [L, H, D] at positions context-L .. context-1 over the row's K/V
    0 .. context-1, gathered from its blocks -> [L, H, D]; causal when ``mask`` is None (L == context)."""
    block_size = key_cache.shape[1]
    blocks = table[:-(-context // block_size)].long()
    q = q.transpose(0, 1)[None]                                              # [1, H, L, D]
    k = key_cache[blocks].flatten(0, 1)[:context].transpose(0, 1)[None]      # [1, KV, S, D]
    v = value_cache[blocks].flatten(0, 1)[:context].transpose(0, 1)[None]
    length = q.shape[2]
    if mask is None and length > SDPA_PAD_FROM and length % SDPA_PAD:        # causal: L == S
        pad = (0, 0, 0, -length % SDPA_PAD)
        q, k, v = F.pad(q, pad), F.pad(k, pad), F.pad(v, pad)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                       enable_gqa=True)              # 4-D: the flash path (3-D takes the slow one)
    return y[0, :, :length].transpose(0, 1)


def _fused(*tensors: torch.Tensor) -> bool:
    """Can the C++ elementwise kernels take these (cpu, one dtype, bf16 or fp32)? Called for every
    kernel call, so it reads only cheap attributes (``device`` builds a new object each time)."""
    dtype = tensors[0].dtype
    return dtype in HALF_OR_FLOAT and all(t.is_cpu and t.dtype == dtype for t in tensors)


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


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * I] -> ``F.silu(gate) * up`` [..., I], gate and up the two halves, in one pass
    (silu rounded to the dtype before the product, as the two torch ops round)."""
    if not _fused(gate_up) or gate_up.numel() == 0:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return ops().silu_mul(gate_up, wide())
