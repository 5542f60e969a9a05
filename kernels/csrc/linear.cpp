// y = x @ w.T for bf16 (or fp32) weights w [N, K], with fp32 arithmetic.
//
// On CPUs without native bf16 instructions (AVX2 only) torch's bf16 matrix products take a slow
// generic path. Here every weight is read once as bf16 (half the bytes of fp32) and widened in
// registers; two layouts of the work, by the number of x rows M:
//
//   one row    (M == 1)           "row": NR = 4 weight rows, two accumulators each, the weights
//                                 prefetched 8 KiB ahead: the batch-1 decode case, where the
//                                 stream of weights is all there is.
//   few rows   (M < panel_rows)   "dots": NR = 3 weight rows x MR <= 4 x rows, dot products
//                                 along k (8 lanes), one horizontal sum per output. Streams the
//                                 weights once: the decode and LM-head case, memory bound.
//   many rows  (M >= panel_rows)  "panels": x is packed once into groups of 6 rows with the 6
//                                 values of one k adjacent; 16 weight rows x KC columns are
//                                 transposed into an fp32 block [KC][16], two such blocks at a
//                                 time (in L1), then group16 broadcasts each x value against 16
//                                 outputs, 6 x rows at a time, for both blocks: compute bound.
//
// "panels" also multiplies weights packed into 16-column panels (kernels/panels.py) from
// linear_packed.cpp, each block widened instead of transposed (linear_panels_packed).
//
// The three sum a row's products in different orders. panel_rows == 0 runs "dots" for every M:
// each output is one 8-lane accumulation along k and one horizontal sum, whatever the number of
// rows (batch invariance, kernels/invariant.py).
#include "elementwise.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>

namespace qwen_npu_cpu {
namespace {

constexpr int64_t KC = LINEAR_KC;    // columns per transposed block

#define QN_DOT_ACC(i, j) __m256 c##i##j = _mm256_setzero_ps();
#define QN_DOT_FMA(i, j) if constexpr (MR > i && NR > j) c##i##j = _mm256_fmadd_ps(x##i, w##j, c##i##j);
#define QN_DOT_OUT(i, j)                                                                   \
  if constexpr (MR > i && NR > j) {                                                          \
    float s = hsum(c##i##j);                                                                 \
    for (int64_t kk = k; kk < K; ++kk) s += x[i * K + kk] * to_f(w[j * K + kk]);            \
    y[i * ldy + j] = s;                                                                      \
  }
// MR (<= 4) rows of x against NR (<= 3) rows of w.
template <int MR, int NR, typename W>
inline void dot_tile(const float* x, const W* w, int64_t K, float* y, int64_t ldy) {
  QN_DOT_ACC(0, 0) QN_DOT_ACC(0, 1) QN_DOT_ACC(0, 2) QN_DOT_ACC(1, 0) QN_DOT_ACC(1, 1) QN_DOT_ACC(1, 2)
  QN_DOT_ACC(2, 0) QN_DOT_ACC(2, 1) QN_DOT_ACC(2, 2) QN_DOT_ACC(3, 0) QN_DOT_ACC(3, 1) QN_DOT_ACC(3, 2)
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 w0 = load8(w + k);
    const __m256 w1 = NR > 1 ? load8(w + K + k) : w0;
    const __m256 w2 = NR > 2 ? load8(w + 2 * K + k) : w0;
    const __m256 x0 = _mm256_loadu_ps(x + k);
    const __m256 x1 = MR > 1 ? _mm256_loadu_ps(x + K + k) : x0;
    const __m256 x2 = MR > 2 ? _mm256_loadu_ps(x + 2 * K + k) : x0;
    const __m256 x3 = MR > 3 ? _mm256_loadu_ps(x + 3 * K + k) : x0;
    QN_DOT_FMA(0, 0) QN_DOT_FMA(0, 1) QN_DOT_FMA(0, 2) QN_DOT_FMA(1, 0) QN_DOT_FMA(1, 1) QN_DOT_FMA(1, 2)
    QN_DOT_FMA(2, 0) QN_DOT_FMA(2, 1) QN_DOT_FMA(2, 2) QN_DOT_FMA(3, 0) QN_DOT_FMA(3, 1) QN_DOT_FMA(3, 2)
  }
  QN_DOT_OUT(0, 0) QN_DOT_OUT(0, 1) QN_DOT_OUT(0, 2) QN_DOT_OUT(1, 0) QN_DOT_OUT(1, 1) QN_DOT_OUT(1, 2)
  QN_DOT_OUT(2, 0) QN_DOT_OUT(2, 1) QN_DOT_OUT(2, 2) QN_DOT_OUT(3, 0) QN_DOT_OUT(3, 1) QN_DOT_OUT(3, 2)
}
#undef QN_DOT_ACC
#undef QN_DOT_FMA
#undef QN_DOT_OUT

template <int NR, typename W>
inline void dot_rows(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_tile<4, NR>(x + m * K, w, K, y + m * ldy, ldy);
  switch (M - m) {
    case 3: dot_tile<3, NR>(x + m * K, w, K, y + m * ldy, ldy); break;
    case 2: dot_tile<2, NR>(x + m * K, w, K, y + m * ldy, ldy); break;
    case 1: dot_tile<1, NR>(x + m * K, w, K, y + m * ldy, ldy); break;
    default: break;
  }
}

template <typename W>
inline void dot_rows_n(int nr, const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t ldy) {
  if (nr == 3) dot_rows<3>(x, M, K, w, y, ldy);
  else if (nr == 2) dot_rows<2>(x, M, K, w, y, ldy);
  else dot_rows<1>(x, M, K, w, y, ldy);
}

// Outputs [n_begin, N) by dot products, weight rows 3 at a time, spread over the threads. With
// more than one tile of x rows, the 3 weight rows are first widened into an fp32 buffer (in L1)
// so that each is converted once, not once per tile.
template <typename W>
void linear_dots(const float* x, int64_t M, int64_t K, const W* w, int64_t n_begin, int64_t N, float* y) {
  constexpr int NR = 3;
  const int64_t groups = (N - n_begin + NR - 1) / NR;
  const bool widen = M > 4 && K % 8 == 0;
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    std::vector<float> wide(widen ? NR * K : 0);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = n_begin + g * NR;
      const int nr = static_cast<int>(std::min<int64_t>(NR, N - n));
      if (widen) {
        // widen this group while the next one is fetched from memory, so that the dot products
        // below never wait on it
        const W* next = w + (n + NR) * K;
        for (int64_t i = 0; i < nr * K; i += 8) {
          if (i % 32 == 0 && g + 1 < g1) _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
          _mm256_storeu_ps(wide.data() + i, load8(w + n * K + i));
        }
        dot_rows_n(nr, x, M, K, static_cast<const float*>(wide.data()), y + n, N);
      } else {
        dot_rows_n(nr, x, M, K, w + n * K, y + n, N);
      }
    }
  });
}

// One x row against NR weight rows: two accumulators per row (k in steps of 16), so that the
// FMA chains do not wait on each other, and a prefetch PF elements ahead in each row, so that the
// rows' streams do not wait on memory. On the 0.6B decode weights (1.19 GB, far past the caches),
// one thread, against dot_tile<1, 3>: 22% less time with PF = 4096 (8 KiB of bf16), 16-18% with 2048
// or 1024, 3% without prefetch. A prefetch past the end of the weights is harmless.
template <int NR, int64_t PF, typename W>
inline void dot_row(const float* x, const W* w, int64_t K, float* y) {
  __m256 a[NR], b[NR];
  for (int j = 0; j < NR; ++j) a[j] = b[j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if (PF > 0 && k % 32 == 0)
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k + PF), _MM_HINT_T0);
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    for (int j = 0; j < NR; ++j) {
      a[j] = _mm256_fmadd_ps(x0, load8(w + j * K + k), a[j]);
      b[j] = _mm256_fmadd_ps(x1, load8(w + j * K + k + 8), b[j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    float s = hsum(_mm256_add_ps(a[j], b[j]));
    for (int64_t kk = k; kk < K; ++kk) s += x[kk] * to_f(w[j * K + kk]);
    y[j] = s;
  }
}

// Outputs [0, N) of one x row: weight rows 4 at a time over the threads, the last N % 4 alone.
template <typename W>
void linear_row(const float* x, int64_t K, const W* w, int64_t N, float* y) {
  constexpr int NR = 4;
  const int64_t groups = N / NR;
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) dot_row<NR, 4096>(x, w + g * NR * K, K, y + g * NR);
  });
  for (int64_t n = groups * NR; n < N; ++n) dot_row<1, 0>(x, w + n * K, K, y + n);
}

// The MR rows of one packed group (a is [kc][MR]: the group's x values of one k adjacent)
// against a 16-column block b [kc][16]: the block's sums, plus what `add` holds (rows of 16) when
// it is not null, stored into y (rows ldy apart; rounded to Y as stored). Kept out of line so
// that its twelve accumulators get the registers to themselves.
template <int MR, typename Y>
__attribute__((noinline)) void group16(const float* a, const float* b, int64_t kc, const float* add, Y* y,
                                       int64_t ldy) {
  tile16_sums<MR, MR>(a, 1, b, 16, kc, [&](int i, __m256 lo, __m256 hi) {
    if (add) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(add + i * 16));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(add + i * 16 + 8));
    }
    elementwise::store8(y + i * ldy, lo);
    elementwise::store8(y + i * ldy + 8, hi);
  });
}

template <typename Y>
using GroupFn = void (*)(const float*, const float*, int64_t, const float*, Y*, int64_t);
template <typename Y>
constexpr GroupFn<Y> GROUP16[7] = {nullptr,         group16<1, Y>, group16<2, Y>, group16<3, Y>,
                                   group16<4, Y>, group16<5, Y>, group16<6, Y>};
constexpr int64_t GROUP = 6;           // x rows per packed group

// x [M, K] -> xp: for each KC block of columns, the groups of GROUP rows one after another, each
// [kc][rows of the group]. Block kb starts at xp + k0 * M; its group at row m0 at + m0 * kc.
inline void pack_x(const float* x, int64_t M, int64_t K, float* xp) {
  const int64_t blocks = (K + KC - 1) / KC, groups = (M + GROUP - 1) / GROUP;
  at::parallel_for(0, blocks * groups, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t k0 = (i / groups) * KC, m0 = (i % groups) * GROUP;
      const int64_t kc = std::min(KC, K - k0), mr = std::min(GROUP, M - m0);
      float* dst = xp + k0 * M + m0 * kc;
      for (int64_t r = 0; r < mr; ++r) {
        const float* src = x + (m0 + r) * K + k0;
        for (int64_t k = 0; k < kc; ++k) dst[k * mr + r] = src[k];
      }
    }
  });
}

// The fp32 block [kc][16] of weight columns [16 p, 16 p + 16) and columns [k0, k0 + kc) that
// group16 multiplies by: transposed from 16 plain rows of w [N, K] (pack16), or widened from a
// panel of kernels/panels.py (panel p is [K][16] bf16 in the column order 0-3 8-11 4-7 12-15).
// `next` (0: none) is the offset in elements of what to prefetch meanwhile.
template <typename W>
struct PlainRows {
  const W* w;
  int64_t K;
  void operator()(int64_t p, int64_t k0, int64_t kc, float* buf, int64_t next) const {
    const W* rows[16];
    for (int r = 0; r < 16; ++r) rows[r] = w + (p * 16 + r) * K;
    pack16(rows, k0, kc, buf, next);
  }
  static constexpr int64_t NEXT_K = KC;     // the offset of the next block of k of these rows
};
struct PackedPanels {
  const uint16_t* w;
  int64_t K;
  void operator()(int64_t p, int64_t k0, int64_t kc, float* buf, int64_t next) const {
    const uint16_t* src = w + (p * K + k0) * 16;
    for (int64_t k = 0; k < kc; ++k) {
      if (next && k % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(src + k * 16 + next), _MM_HINT_T0);
      __m256 lo, hi;
      widen_panel_k(src + k * 16, lo, hi);
      _mm256_storeu_ps(buf + k * 16, lo);
      _mm256_storeu_ps(buf + k * 16 + 8, hi);
    }
  }
  static constexpr int64_t NEXT_K = KC * 16;  // the offset of the next block of k of this panel
};

// Outputs [0, 16 * panels) by fp32 blocks of 16 weight columns against packed x; K % 8 == 0.
// PANELS blocks are made together (2 x 16 KiB, in L1), and each packed x group is multiplied by
// all of them while it is in L1: x, past L2 at prefill sizes, is read once per PANELS blocks, not
// once per block. The sums of a block of k before the last are kept in rows of 16 (y's own rows,
// N apart, fall into few cache sets when N is a power of two); the last block's tile adds them
// and stores its rows into y as it finishes. The threads claim blocks one at a time, so that one
// slowed by other work on its core leaves no share behind for the others to wait on.
constexpr int64_t PANELS = 2;
template <typename Source, typename Y>
void linear_panels(const float* x, int64_t M, int64_t K, const Source& source, int64_t panels, Y* y,
                   int64_t ldy) {
  std::unique_ptr<float[]> xp(new float[M * K]);     // every element written by pack_x
  pack_x(x, M, K, xp.get());
  const int64_t blocks = (panels + PANELS - 1) / PANELS;
  std::atomic<int64_t> claimed{0};
  at::parallel_for(0, std::min<int64_t>(blocks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    std::vector<float> buf(PANELS * KC * 16), acc(K > KC ? PANELS * M * 16 : 0);
    for (int64_t b = claimed++; b < blocks; b = claimed++) {
      const int64_t p0 = b * PANELS, np = std::min(PANELS, panels - p0);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        const bool last = k0 + KC >= K;
        const int64_t next = last ? 0 : Source::NEXT_K;    // (the next 32 columns may be another thread's)
        for (int64_t j = 0; j < np; ++j) source(p0 + j, k0, kc, buf.data() + j * KC * 16, next);
        for (int64_t m0 = 0; m0 < M; m0 += GROUP) {
          const int64_t mr = std::min(GROUP, M - m0);
          const float* a = xp.get() + k0 * M + m0 * kc;
          for (int64_t j = 0; j < np; ++j) {
            float* sums = acc.empty() ? nullptr : acc.data() + (j * M + m0) * 16;
            const float* done = k0 > 0 ? sums : nullptr;
            if (last) GROUP16<Y>[mr](a, buf.data() + j * KC * 16, kc, done, y + m0 * ldy + (p0 + j) * 16, ldy);
            else GROUP16<float>[mr](a, buf.data() + j * KC * 16, kc, done, sums, 16);
          }
        }
      }
    }
  });
}

}  // namespace

template <typename W>
void linear_kernel(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t panel_rows) {
  if (panel_rows == 0) return linear_dots(x, M, K, w, 0, N, y);    // one reduction order for every M
  if (M == 1 && panel_rows > 1) return linear_row(x, K, w, N, y);
  int64_t done = 0;
  if (M >= panel_rows && K % 8 == 0 && N >= 16) {
    const int64_t panels = N / 16;
    linear_panels(x, M, K, PlainRows<W>{w, K}, panels, y, N);
    done = panels * 16;
  }
  if (done < N) linear_dots(x, M, K, w, done, N, y);
}

template <typename Y>
void linear_panels_packed(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t P, Y* y) {
  linear_panels(x, M, K, PackedPanels{w, K}, P, y, 16 * P);
}
template void linear_panels_packed<float>(const float*, int64_t, int64_t, const uint16_t*, int64_t, float*);
template void linear_panels_packed<c10::BFloat16>(const float*, int64_t, int64_t, const uint16_t*, int64_t,
                                                  c10::BFloat16*);

template void linear_kernel<float>(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t);
template void linear_kernel<c10::BFloat16>(const float*, int64_t, int64_t, const c10::BFloat16*, int64_t, float*,
                                           int64_t);

}  // namespace qwen_npu_cpu
