// Greedy sampling and the stream-health check as one scan of a row of float32 logits, in pieces:
// the whole row at once (greedy.cpp) or a product's outputs as they are stored (the LM head's
// fused read, linear_amx.cpp and linear_packed.cpp), each thread scanning its own consecutive
// columns and the pieces merged in column order. Either way the answer is the one definition:
//
//   argmax  the first column holding the row's largest value; the first NaN where the row has
//           one (as torch's argmax gives it); 0 for an empty row
//   code    0 healthy, 1 a NaN or an inf, 2 all zero, 3 all equal (engine/sampler.py)
#pragma once
#include "vec.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace qwen_npu_cpu {
namespace greedy {

constexpr float INF = std::numeric_limits<float>::infinity();

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline float hmin8(__m256 v) {
  __m128 s = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_min_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_min_ss(s, _mm_movehdup_ps(s)));
}

// What a scan of some consecutive columns of one row has seen so far. A piece costs a few vector
// operations unless it holds a new largest value (a handful of times in a row of random logits).
struct Scan {
  __m256 lo8 = _mm256_set1_ps(INF);   // the smallest values, per lane (NaN never counts)
  float lo = INF;                     // the smallest of the values that fill no lane (pieces' ends)
  float hi = -INF;                    // the largest value
  int64_t at = -1;                    // the first column holding hi; -1 while no value but NaN was seen
  int64_t nan_at = -1;                // the first NaN's column; -1: none
};

// The first j in [0, n) with p[j] == v, or -1.
inline int64_t find(const float* p, int64_t n, float v) {
  const __m256 target = _mm256_set1_ps(v);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + j), target, _CMP_EQ_OQ));
    if (mask) return j + __builtin_ctz(mask);
  }
  for (; j < n; ++j)
    if (p[j] == v) return j;
  return -1;
}

// Scan p[0, n), the row's columns col .. col + n, which follow every column s has seen.
inline void scan(Scan& s, const float* p, int64_t n, int64_t col) {
  __m256 vmax = _mm256_set1_ps(-INF), vmin = s.lo8, vnan = _mm256_setzero_ps();
  const int64_t n8 = n - n % 8;
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    vmax = _mm256_max_ps(v, vmax);                 // a NaN lane keeps the running value
    vmin = _mm256_min_ps(v, vmin);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  s.lo8 = vmin;
  if (s.nan_at < 0 && _mm256_movemask_ps(vnan)) {
    int64_t j = 0;
    while (p[j] == p[j]) ++j;
    s.nan_at = col + j;
  }
  if (n8 > 0 && (s.at < 0 || _mm256_movemask_ps(_mm256_cmp_ps(vmax, _mm256_set1_ps(s.hi), _CMP_GT_OQ)))) {
    const float hi = hmax8(vmax);                  // a new largest value (or the first value at all)
    const int64_t j = find(p, n8, hi);
    if (j >= 0) { s.hi = hi; s.at = col + j; }     // none: every value here was NaN
  }
  for (int64_t j = n8; j < n; ++j) {               // the values that fill no lane, in column order
    const float v = p[j];
    if (v != v) {
      if (s.nan_at < 0) s.nan_at = col + j;
      continue;
    }
    s.lo = std::min(s.lo, v);
    if (s.at < 0 || v > s.hi) { s.hi = v; s.at = col + j; }
  }
}

// The (argmax, code) of a row from the scans of its consecutive column ranges, in column order
// (parts[0], parts[stride], ...): a later range's equal maximum never wins.
inline void finish(const Scan* parts, int64_t count, int64_t stride, int64_t* id, int64_t* code) {
  float hi = -INF, lo = INF;
  int64_t at = -1, nan_at = -1;
  for (int64_t i = 0; i < count; ++i) {
    const Scan& s = parts[i * stride];
    if (nan_at < 0) nan_at = s.nan_at;
    lo = std::min(lo, std::min(s.lo, hmin8(s.lo8)));
    if (s.at >= 0 && (at < 0 || s.hi > hi)) { hi = s.hi; at = s.at; }
  }
  if (nan_at >= 0) { *id = nan_at; *code = 1; return; }
  *id = at < 0 ? 0 : at;                           // an empty row: 0, as torch's argmax has no answer
  if (!std::isfinite(hi) || !std::isfinite(lo)) *code = 1;
  else if (hi == lo) *code = hi == 0.0f ? 2 : 3;
  else *code = 0;
}

// A product's LM head form: run(i0, i1, scans) computes and stores work items [i0, i1), scanning
// its M rows into scans[0, M); the items are split into one consecutive run per thread, so that
// the runs' scans merge in column order into ids and codes.
template <typename Run>
void in_runs(int64_t items, int64_t M, const Run& run, int64_t* ids, int64_t* codes) {
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), items);
  std::vector<Scan> scans(parts * M);               // [part][row]
  at::parallel_for(0, parts, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) run(q * items / parts, (q + 1) * items / parts, scans.data() + q * M);
  });
  for (int64_t r = 0; r < M; ++r) finish(scans.data() + r, parts, M, ids + r, codes + r);
}

}  // namespace greedy
}  // namespace qwen_npu_cpu
