// RMSNorm (optionally after a residual add) and rotary embedding, each in one pass, with the
// roundings of the reference kernels: values are rounded to the storage dtype at the same
// points as there, and only the summation order of the mean square differs.
#include "vec.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace qwen_npu_cpu {
namespace {

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

// Rows [r0, r1) of x [rows, n]: out = w * round(x * rsqrt(mean(x^2) + eps)); with a residual,
// x is first replaced by round(x + residual), which is also written to sum_out.
template <typename T>
void rms_rows(const T* x, const T* residual, const T* w, int64_t n, float eps, T* out, T* sum_out,
              int64_t r0, int64_t r1, std::vector<float>& tmp) {
  tmp.resize(n);
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * n;
    float* t = tmp.data();
    if (residual != nullptr) {
      const T* rr = residual + r * n;
      T* sr = sum_out + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const T s = round_to<T>(to_f(xr[i]) + to_f(rr[i]));
        sr[i] = s;
        t[i] = to_f(s);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) t[i] = to_f(xr[i]);
    }
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(t + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; i < n; ++i) ss += t[i] * t[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    T* o = out + r * n;
    for (i = 0; i < n; ++i) o[i] = round_to<T>(to_f(w[i]) * to_f(round_to<T>(t[i] * inv)));
  }
}

}  // namespace

template <typename T>
void rms_norm_kernel(const T* x, const T* residual, const T* w, int64_t rows, int64_t n, float eps, T* out,
                     T* sum_out) {
  // 64K elements per thread at least: a decode step's norms run inline, with no parallel region
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> tmp;
    rms_rows(x, residual, w, n, eps, out, sum_out, r0, r1, tmp);
  });
}

// qo = q * cos + rotate_half(q) * sin for q [T, H, D], and the same for k [T, KV, D] into ko, with
// cos/sin [T, D] fp32 rounded to T first and each product rounded, as the reference computes it.
template <typename T>
void rope_kernel(const T* q, const T* k, const float* cos, const float* sin, int64_t tokens, int64_t heads,
                 int64_t kv_heads, int64_t d, T* qo, T* ko) {
  const int64_t half = d / 2;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>((heads + kv_heads) * d, 1));
  at::parallel_for(0, tokens, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> c(d), s(d), x(d);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = 0; i < d; ++i) {
        c[i] = to_f(round_to<T>(cos[t * d + i]));
        s[i] = to_f(round_to<T>(sin[t * d + i]));
      }
      for (int which = 0; which < 2; ++which) {
        const int64_t nh = which == 0 ? heads : kv_heads;
        const T* src = (which == 0 ? q : k) + t * nh * d;
        T* dst = (which == 0 ? qo : ko) + t * nh * d;
        for (int64_t h = 0; h < nh; ++h) {
          const T* v = src + h * d;
          T* o = dst + h * d;
          for (int64_t i = 0; i < d; ++i) x[i] = to_f(v[i]);
          for (int64_t i = 0; i < d; ++i) {
            const float rot = i < half ? -x[i + half] : x[i - half];
            const float a = to_f(round_to<T>(x[i] * c[i]));
            const float b = to_f(round_to<T>(rot * s[i]));
            o[i] = round_to<T>(a + b);
          }
        }
      }
    }
  });
}

template void rms_norm_kernel<float>(const float*, const float*, const float*, int64_t, int64_t, float, float*,
                                     float*);
template void rms_norm_kernel<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                                             int64_t, int64_t, float, c10::BFloat16*, c10::BFloat16*);
template void rope_kernel<float>(const float*, const float*, const float*, const float*, int64_t, int64_t, int64_t,
                                 int64_t, float*, float*);
template void rope_kernel<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const float*, const float*,
                                         int64_t, int64_t, int64_t, int64_t, c10::BFloat16*, c10::BFloat16*);

}  // namespace qwen_npu_cpu
