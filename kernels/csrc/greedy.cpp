// Greedy sampling and the stream-health check in one read of the logits: per row its argmax
// (the first maximal index; the first NaN where the row has one, as torch's argmax gives it) and
// its health code (0 healthy, 1 NaN or inf, 2 all zero, 3 all equal; engine/sampler.py).
//
// Pass 1 takes the row's max, min and whether any entry is NaN, eight lanes at a time; pass 2
// finds the first index holding the max (or the first NaN), stopping there. A row of the 0.6B
// model's vocabulary (600 KB of float32) stays in the core's L2 between the passes. Rows are
// shared out over torch's threads.
#include "vec.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>

namespace qwen_npu_cpu {
namespace {

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline float hmin(__m256 v) {
  __m128 s = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_min_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_min_ss(s, _mm_movehdup_ps(s)));
}

void one_row(const float* p, int64_t n, int64_t* id, int64_t* code) {
  const float inf = std::numeric_limits<float>::infinity();
  __m256 vmax = _mm256_set1_ps(-inf), vmin = _mm256_set1_ps(inf), vnan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    vmax = _mm256_max_ps(v, vmax);                 // a NaN lane keeps the running value
    vmin = _mm256_min_ps(v, vmin);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float hi = hmax(vmax), lo = hmin(vmin);
  bool nan = _mm256_movemask_ps(vnan) != 0;
  for (; i < n; ++i) {
    const float v = p[i];
    if (v != v) nan = true;
    else { hi = v > hi ? v : hi; lo = v < lo ? v : lo; }
  }
  int64_t at = 0;
  if (nan) {
    while (at < n && p[at] == p[at]) ++at;
    *id = at;
    *code = 1;
    return;
  }
  const __m256 target = _mm256_set1_ps(hi);
  int64_t found = -1;
  for (; at + 8 <= n && found < 0; at += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + at), target, _CMP_EQ_OQ));
    if (mask) found = at + __builtin_ctz(mask);
  }
  for (; at < n && found < 0; ++at)
    if (p[at] == hi) found = at;
  *id = found < 0 ? 0 : found;                     // an empty row: 0, as torch's argmax has no answer
  if (!std::isfinite(hi) || !std::isfinite(lo)) *code = 1;
  else if (hi == lo) *code = hi == 0.0f ? 2 : 3;
  else *code = 0;
}

}  // namespace

void greedy_health_kernel(const float* x, int64_t rows, int64_t vocab, int64_t* ids, int64_t* codes) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) one_row(x + r * vocab, vocab, ids + r, codes + r);
  });
}

}  // namespace qwen_npu_cpu
