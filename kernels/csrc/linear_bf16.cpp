// y = x @ w.T for bf16 x [M, K] and bf16 w [N, K] with the CPU's native bf16 dot products
// (AVX512-BF16: one vdpbf16ps multiplies 32 bf16 pairs and adds them, in pairs, into 16 fp32
// lanes). The products are exact in fp32 and the sums fp32, as in torch's own bf16 product.
//
// The work is the "few rows" layout of linear.cpp without the widening: NR = 6 weight rows are
// read once from memory, k in steps of 32, and dotted with up to MR = 4 x rows at a time (24
// accumulators: 4 x loads and 6 weight loads feed 24 dot products), every x row in turn while
// the 6 weight rows sit in L1. Against 3 x 8 tiles, 4 x 6 took about a fifth less time at 16 and
// 512 rows on the 0.6B shapes (one sitting, the AVX512-BF16 host of docs/benchmarks.md). Memory bound for
// decode-sized M; from about 24 rows torch's own product (oneDNN) is faster, and cpu.py hands
// those to it (BF16_DOT_ROWS), except in the batch-invariant form, which takes this kernel for
// every M.
//
// One order per output, for every M: an output's accumulator takes its 16-lane dot products k
// step by k step, and its 16 lanes are summed by one tree (tree_sum), whatever tile computed it.
// So a row's bits do not depend on how many rows share the call.
//
// Compiled for AVX-512 with a function attribute, so the extension still builds with AVX2 flags;
// cpu.py calls it only where the CPU reports avx512_bf16 (``has_bf16_dot`` says whether this
// build has it at all: a compiler too old for the attribute leaves it out).
#include "vec.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <stdexcept>


namespace qwen_npu_cpu {

#ifdef QN_BF16_DOT
namespace {

#define QN_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

constexpr int MR_ROWS = 4;
constexpr int NR_ROWS = 6;
constexpr int64_t ROW_BLOCK_BYTES = 256 << 10;    // x rows per pass over the weights: 256 KiB of them

QN_AVX512_BF16 inline __m512bh load_bh(const uint16_t* p, __mmask32 m) {
  return (__m512bh)(m == ~__mmask32(0) ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(m, p));
}

// The one tree by which every output's 16 lanes are summed: (x0 + x2) + (x1 + x3) in each
// quarter, then (q0 + q2) + (q1 + q3); float addition commutes exactly, so only the pairing matters.
QN_AVX512_BF16 inline float tree_sum(__m512 v) {
  const __m512 a = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));          // lanes [2, 3, 0, 1] of a quarter
  const __m512 b = _mm512_add_ps(a, _mm512_permute_ps(a, 0xB1));          // lanes [1, 0, 3, 2]
  const __m512 c = _mm512_add_ps(b, _mm512_shuffle_f32x4(b, b, 0x4E));    // quarters [2, 3, 0, 1]
  const __m512 d = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0xB1));    // quarters [1, 0, 3, 2]
  return _mm512_cvtss_f32(d);
}

// One k step of 32 (the lanes past a tail's mask read as zeros) into the MR x NR accumulators.
template <int MR, int NR>
QN_AVX512_BF16 inline __attribute__((always_inline)) void step(__m512 (&acc)[MR][NR], const uint16_t* x,
                                                               const uint16_t* w, int64_t K, int64_t k, __mmask32 m) {
  __m512bh xv[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) xv[i] = load_bh(x + i * K + k, m);
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    const __m512bh wv = load_bh(w + j * K + k, m);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
  }
}

// MR rows of x (row stride K) against NR rows of w (row stride K) -> y[i * ldy + j]; a k tail
// shorter than 32 is read with a mask.
template <int MR, int NR>
QN_AVX512_BF16 inline void tile(const uint16_t* x, const uint16_t* w, int64_t K, float* y, int64_t ldy) {
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step<MR, NR>(acc, x, w, K, k, ~__mmask32(0));
  if (k < K) step<MR, NR>(acc, x, w, K, k, static_cast<__mmask32>((1u << (K - k)) - 1u));   // a k tail, masked
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = tree_sum(acc[i][j]);
}

// Every x row against NR weight rows, MR x rows at a time.
template <int NR>
QN_AVX512_BF16 void rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + MR_ROWS <= M; m += MR_ROWS) tile<MR_ROWS, NR>(x + m * K, w, K, y + m * ldy, ldy);
  switch (M - m) {
    case 3: tile<3, NR>(x + m * K, w, K, y + m * ldy, ldy); break;
    case 2: tile<2, NR>(x + m * K, w, K, y + m * ldy, ldy); break;
    case 1: tile<1, NR>(x + m * K, w, K, y + m * ldy, ldy); break;
    default: break;
  }
}

}  // namespace

bool bf16_dot_available() { return true; }

void linear_bf16_kernel(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
  constexpr int NR = NR_ROWS;
  const int64_t groups = N / NR;
  // x in blocks of ROW_BLOCK rows (kept in L2 while every weight group passes); a block's rows
  // are summed as any others, so blocking changes no bits
  const int64_t block = std::max<int64_t>(MR_ROWS, ROW_BLOCK_BYTES / (2 * K) / MR_ROWS * MR_ROWS);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t mb = std::min(block, M - m0);
    const uint16_t* xb = x + m0 * K;
    float* yb = y + m0 * N;
    at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) rows<NR>(xb, mb, K, w + g * NR * K, yb + g * NR, N);
    });
    for (int64_t n = groups * NR; n < N; ++n) rows<1>(xb, mb, K, w + n * K, yb + n, N);
  }
}

#else

bool bf16_dot_available() { return false; }

void linear_bf16_kernel(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, float*) {
  throw std::runtime_error("cpu linear_bf16: this build has no AVX512-BF16 kernel (compiler too old)");
}

#endif

}  // namespace qwen_npu_cpu
