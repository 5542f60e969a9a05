// y = x @ w.T for bf16 weights held as 16-column panels (kernels/panels.py), with fp32
// arithmetic: how a Session's matrices are multiplied on a CPU without native bf16.
//
// Panel p of w [N, K] is [K][16] bf16: for each k the weights w[16 p + c][k] of its 16 columns,
// in the column order 0-3 8-11 4-7 12-15, so that one 32-byte load widens to fp32 columns 0-7
// and 8-15 in two in-lane interleaves with zeros (vec.h, widen_panel_k). The panels are made
// once at load: no product transposes weights (linear.cpp transposes 16 plain rows per block in
// every call, a third of the work at 16 rows). Two layouts of the work, by the number of rows:
//
//   few rows   (M < widen_rows)  x read in place; each x value broadcast against the 16 columns
//                                of a panel widened in registers. One row: against the 4 panels
//                                of a work item at a time (8 independent sums), bound by the stream
//                                of weights. More rows (and a last item of fewer panels): one
//                                panel at a time, a block of LINEAR_KC values of k in turn by
//                                passes of at most 6 rows, the rows shared evenly among the passes
//                                (16 as 6 5 5): the first pass streams the block in, prefetched
//                                2 KiB ahead, the others find it in L1, and each panel is one
//                                sequential stream. Decode (batch 16: bound by the multiply-adds
//                                on an AVX2 CPU) and the LM head.
//   many rows                    linear.cpp's layout (linear_panels_packed): two panels' blocks
//                                widened into fp32 once, x packed in 6-row groups: prefill,
//                                bound by the multiply-adds.
//
// The LM head's form (linear_packed_logits_kernel, few rows) stores the bf16-rounded values widened
// to fp32 into the logits and scans each row as it is stored (greedy.h), so that greedy sampling
// and the health check need no second read of the logits. The gate|up form (linear_packed_silu_kernel,
// few rows) makes each item of gate panels and the same item of up panels, and stores silu_mul of
// their bf16 values: no [M, 2 I] product is written or read.
//
// Every output is one fp32 sum per block of LINEAR_KC values of k, in k order, and the blocks'
// sums are added in order, rounded once to y's dtype as it is stored: the same bits for every
// number of rows, every split between the threads and both layouts (the cpu set's products on
// panels are batch invariant). Under torch.set_flush_denormal(True), which sets the mode of the
// calling thread only, the other threads keep subnormals, as in torch's own kernels.
#include "elementwise.h"
#include "greedy.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <type_traits>
#include <vector>

namespace qwen_npu_cpu {
namespace {

constexpr int64_t KC = LINEAR_KC;
constexpr int64_t AHEAD = 1024;       // bf16 elements (2 KiB) a panel's stream is prefetched ahead
constexpr int64_t PANELS = 4;         // panels per work item
constexpr int64_t GROUP = 6;          // x rows per pass at most

// MR rows of x (row i at x + i * ldx) against NP panels (panel j's values at b + j * ldp, [kc][16])
// for kc values of k. The sums of panel j, row i start from zero, have what is at `add` + j * lda +
// i * 16 added when it is not null, and go to `out` (same layout; it may be `add`). PREFETCH:
// each panel's stream is prefetched AHEAD elements ahead (off where the block is already in L1).
// Out of line so that its accumulators get the registers to themselves.
template <int MR, int NP, bool PREFETCH = true>
__attribute__((noinline)) void tile(const float* x, int64_t ldx, const uint16_t* b, int64_t ldp, int64_t kc,
                                   float* out, int64_t lda, const float* add) {
  __m256 c[MR][NP][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      c[i][j][0] = _mm256_setzero_ps();
      c[i][j][1] = _mm256_setzero_ps();
    }
  for (int64_t k = 0; k < kc; ++k) {
    __m256 lo[NP], hi[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      if (PREFETCH && k % 2 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(b + j * ldp + k * 16 + AHEAD), _MM_HINT_T0);
      widen_panel_k(b + j * ldp + k * 16, lo[j], hi[j]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) {
        c[i][j][0] = _mm256_fmadd_ps(a, lo[j], c[i][j][0]);
        c[i][j][1] = _mm256_fmadd_ps(a, hi[j], c[i][j][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      if (add) {
        c[i][j][0] = _mm256_add_ps(c[i][j][0], _mm256_loadu_ps(add + j * lda + i * 16));
        c[i][j][1] = _mm256_add_ps(c[i][j][1], _mm256_loadu_ps(add + j * lda + i * 16 + 8));
      }
      _mm256_storeu_ps(out + j * lda + i * 16, c[i][j][0]);
      _mm256_storeu_ps(out + j * lda + i * 16 + 8, c[i][j][1]);
    }
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t, const float*);
constexpr TileFn TILE[2][GROUP + 1] = {
    {nullptr, tile<1, 1, false>, tile<2, 1, false>, tile<3, 1, false>, tile<4, 1, false>, tile<5, 1, false>,
     tile<6, 1, false>},
    {nullptr, tile<1, 1>, tile<2, 1>, tile<3, 1>, tile<4, 1>, tile<5, 1>, tile<6, 1>}};

// The sums of work item ``item`` (panels [PANELS item, PANELS item + np), outputs [16 PANELS item, ..))
// for few rows into acc [panel][row][16]. Returns np.
int64_t item_sums(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t P, int64_t item, float* acc) {
  const int64_t ldp = 16 * K, p0 = item * PANELS, np = std::min(PANELS, P - p0);
  if (M == 1 && np == PANELS) {
    for (int64_t k0 = 0; k0 < K; k0 += KC)
      tile<1, PANELS>(x + k0, K, w + (p0 * K + k0) * 16, ldp, std::min(KC, K - k0), acc, 16, k0 > 0 ? acc : nullptr);
    return np;
  }
  // Passes of at most GROUP rows, as even as they go: 16 rows as 6 5 5, 8 as 4 4. A pass's
  // multiply-adds per widened line of weights are its rows, so an even split loses least to the
  // widening; the first pass of a block reads it from memory, the others from L1.
  const int64_t passes = (M + GROUP - 1) / GROUP, base = M / passes, more = M % passes;
  for (int64_t j = 0; j < np; ++j) {
    const uint16_t* b = w + (p0 + j) * ldp;
    float* sums = acc + j * M * 16;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      for (int64_t pass = 0, m0 = 0; pass < passes; ++pass) {
        const int64_t mr = base + (pass < more ? 1 : 0);
        TILE[pass == 0][mr](x + m0 * K + k0, K, b + k0 * 16, ldp, kc, sums + m0 * 16, M * 16,
                            k0 > 0 ? sums + m0 * 16 : nullptr);
        m0 += mr;
      }
    }
  }
  return np;
}

// Work items [i0, i1) of PANELS panels each (outputs [16 PANELS i0, 16 PANELS i1)) for few rows.
// Logits (Y float, ``scans`` set): the sums rounded to bf16 and widened back as they are stored,
// each row's stored values scanned into scans[row] (greedy.h).
template <typename Y>
void few_items(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t P, Y* y, int64_t i0, int64_t i1,
               greedy::Scan* scans) {
  std::vector<float> acc(PANELS * M * 16);     // the sums of the blocks done  [panel][row][16]
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t p0 = item * PANELS, np = item_sums(x, M, K, w, P, item, acc.data());
    if constexpr (std::is_same_v<Y, float>) {
      if (scans != nullptr) {
        for (int64_t r = 0; r < M; ++r) {
          float* out = y + r * 16 * P + p0 * 16;
          for (int64_t j = 0; j < np; ++j)
            for (int h = 0; h < 2; ++h)
              _mm256_storeu_ps(out + j * 16 + h * 8, elementwise::round8<c10::BFloat16>(
                                                         _mm256_loadu_ps(acc.data() + (j * M + r) * 16 + h * 8)));
          greedy::scan(scans[r], out, np * 16, p0 * 16);
        }
        continue;
      }
    }
    for (int64_t j = 0; j < np; ++j)
      elementwise::store_rows16(acc.data() + j * M * 16, M, y + (p0 + j) * 16, 16 * P);
  }
}

// The gate|up form, work items [i0, i1) of the PG = I / 16 gate panels: item i's gate panels and
// the same panels of the up half (PG further), rounded to bf16 as few_items stores them and put
// through silu_mul's 8-lane steps into act [M, I].
void silu_items(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t PG, c10::BFloat16* act, int64_t i0,
                int64_t i1) {
  std::vector<float> gate(PANELS * M * 16), up(PANELS * M * 16);
  const int64_t I = 16 * PG;
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t np = item_sums(x, M, K, w, PG, item, gate.data());
    item_sums(x, M, K, w + PG * K * 16, PG, item, up.data());
    for (int64_t j = 0; j < np; ++j)
      for (int64_t r = 0; r < M; ++r)
        for (int h = 0; h < 2; ++h) {
          const int64_t at = (j * M + r) * 16 + h * 8;
          const __m256 g = elementwise::round8<c10::BFloat16>(_mm256_loadu_ps(gate.data() + at));
          const __m256 u = elementwise::round8<c10::BFloat16>(_mm256_loadu_ps(up.data() + at));
          elementwise::store8(act + r * I + (item * PANELS + j) * 16 + h * 8, elementwise::act8<c10::BFloat16>(g, u));
        }
  }
}

// Outputs [0, 16 P) for few rows: work items of PANELS panels spread over the threads.
template <typename Y>
void linear_few(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t P, Y* y) {
  at::parallel_for(0, (P + PANELS - 1) / PANELS, 1,
                   [&](int64_t i0, int64_t i1) { few_items(x, M, K, w, P, y, i0, i1, nullptr); });
}

}  // namespace

template <typename Y>
void linear_packed_kernel(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t P, Y* y,
                          int64_t widen_rows) {
  if (M >= widen_rows) return linear_panels_packed(x, M, K, w, P, y);
  linear_few(x, M, K, w, P, y);
}
bool linear_packed_silu_kernel(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t P,
                               c10::BFloat16* act, int64_t widen_rows) {
  if (M < 1 || M >= widen_rows || P < 2 || P % 2 != 0) return false;
  const int64_t PG = P / 2;
  at::parallel_for(0, (PG + PANELS - 1) / PANELS, 1,
                   [&](int64_t i0, int64_t i1) { silu_items(x, M, K, w, PG, act, i0, i1); });
  return true;
}
bool linear_packed_logits_kernel(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t P, float* logits,
                                 int64_t* ids, int64_t* codes, int64_t widen_rows) {
  if (M < 1 || M >= widen_rows || P < 1) return false;
  greedy::in_runs((P + PANELS - 1) / PANELS, M, [&](int64_t i0, int64_t i1, greedy::Scan* scans) {
    few_items(x, M, K, w, P, logits, i0, i1, scans);
  }, ids, codes);
  return true;
}

template void linear_packed_kernel<float>(const float*, int64_t, int64_t, const uint16_t*, int64_t, float*, int64_t);
template void linear_packed_kernel<c10::BFloat16>(const float*, int64_t, int64_t, const uint16_t*, int64_t,
                                                  c10::BFloat16*, int64_t);

}  // namespace qwen_npu_cpu
