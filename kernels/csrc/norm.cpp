// RMSNorm (optionally after a residual add), rotary embedding, and the two together for the q/k
// heads, each in one vectorised pass, with the roundings of the reference kernels: values are
// rounded to the storage dtype at the same points as there, and only the summation order of the
// mean square differs (8 lanes, then the lanes, then the tail; the same order everywhere here, so
// qk_norm_rope is bit-identical to rms_norm followed by rope).
#include "elementwise.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace qwen_npu_cpu {
namespace {

using elementwise::grain_for;
using elementwise::round8;
using elementwise::store8;

template <typename T>
inline float rounded(float v) { return to_f(static_cast<T>(v)); }

// t[0..n) = x[0..n) widened to fp32.
template <typename T>
inline void widen(const T* x, int64_t n, float* t) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(t + i, load8(x + i));
  for (; i < n; ++i) t[i] = to_f(x[i]);
}

// o[0..n) = t[0..n) rounded to T.
template <typename T>
inline void narrow(const float* t, int64_t n, T* o) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(o + i, _mm256_loadu_ps(t + i));
  for (; i < n; ++i) o[i] = static_cast<T>(t[i]);
}

// 1 / sqrt(mean(t^2) + eps), the sum taken in 8 lanes, then across the lanes, then the tail.
inline float inv_rms(const float* t, int64_t n, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(t + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (; i < n; ++i) ss += t[i] * t[i];
  return 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
}

// t[i] = round(w[i] * round(t[i] * inv)), in place: the reference's weight * normed.to(dtype).
template <typename T>
inline void scale_by_weight(float* t, const T* w, int64_t n, float inv) {
  const __m256 vinv = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 normed = round8<T>(_mm256_mul_ps(_mm256_loadu_ps(t + i), vinv));
    _mm256_storeu_ps(t + i, round8<T>(_mm256_mul_ps(load8(w + i), normed)));
  }
  for (; i < n; ++i) t[i] = rounded<T>(to_f(w[i]) * rounded<T>(t[i] * inv));
}

// o = round(round(x * c) + round(rotate_half(x) * s)) for one head of d values; c and s are
// already rounded to T. Vectorised when the half head is a multiple of 8 lanes.
template <typename T>
inline void rope_head(const float* x, const float* c, const float* s, int64_t d, T* o) {
  const int64_t half = d / 2;
  if (half % 8 == 0) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 rot = i < half ? _mm256_xor_ps(_mm256_loadu_ps(x + i + half), sign) : _mm256_loadu_ps(x + i - half);
      const __m256 a = round8<T>(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(c + i)));
      const __m256 b = round8<T>(_mm256_mul_ps(rot, _mm256_loadu_ps(s + i)));
      store8(o + i, _mm256_add_ps(a, b));
    }
    return;
  }
  for (int64_t i = 0; i < d; ++i) {
    const float rot = i < half ? -x[i + half] : x[i - half];
    o[i] = static_cast<T>(rounded<T>(x[i] * c[i]) + rounded<T>(rot * s[i]));
  }
}

// c, s [d] = cos, sin [d] rounded to T (the reference casts the tables to q's dtype).
template <typename T>
inline void rope_row(const float* cos, const float* sin, int64_t d, float* c, float* s) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    _mm256_storeu_ps(c + i, round8<T>(_mm256_loadu_ps(cos + i)));
    _mm256_storeu_ps(s + i, round8<T>(_mm256_loadu_ps(sin + i)));
  }
  for (; i < d; ++i) {
    c[i] = rounded<T>(cos[i]);
    s[i] = rounded<T>(sin[i]);
  }
}

}  // namespace

// Rows of x [rows, n]: out = w * round(x * rsqrt(mean(x^2) + eps)); with a residual, x is first
// replaced by round(x + residual), which is also written to sum_out.
template <typename T>
void rms_norm_kernel(const T* x, const T* residual, const T* w, int64_t rows, int64_t n, float eps, T* out,
                     T* sum_out) {
  at::parallel_for(0, rows, grain_for(n), [&](int64_t r0, int64_t r1) {
    std::vector<float> tmp(n);
    float* t = tmp.data();
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * n;
      if (residual != nullptr) {
        const T* rr = residual + r * n;
        T* sr = sum_out + r * n;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
          const __m256 s = round8<T>(_mm256_add_ps(load8(xr + i), load8(rr + i)));
          store8(sr + i, s);
          _mm256_storeu_ps(t + i, s);
        }
        for (; i < n; ++i) {
          sr[i] = static_cast<T>(to_f(xr[i]) + to_f(rr[i]));
          t[i] = to_f(sr[i]);
        }
      } else {
        widen(xr, n, t);
      }
      scale_by_weight(t, w, n, inv_rms(t, n, eps));
      narrow(t, n, out + r * n);
    }
  });
}

// qo = q * cos + rotate_half(q) * sin for q [T, H, D], and the same for k [T, KV, D] into ko, with
// cos/sin [T, D] fp32 rounded to T first and each product rounded, as the reference computes it.
template <typename T>
void rope_kernel(const T* q, const T* k, const float* cos, const float* sin, int64_t tokens, int64_t heads,
                 int64_t kv_heads, int64_t d, T* qo, T* ko) {
  at::parallel_for(0, tokens, grain_for((heads + kv_heads) * d), [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(3 * d);
    float *c = buf.data(), *s = c + d, *x = s + d;
    for (int64_t t = t0; t < t1; ++t) {
      rope_row<T>(cos + t * d, sin + t * d, d, c, s);
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const T* src = h < heads ? q + (t * heads + h) * d : k + (t * kv_heads + h - heads) * d;
        T* dst = h < heads ? qo + (t * heads + h) * d : ko + (t * kv_heads + h - heads) * d;
        widen(src, d, x);
        rope_head(x, c, s, d, dst);
      }
    }
  });
}

template <typename T>
void qk_norm_rope_kernel(const T* q, int64_t q_tok, int64_t q_head, const T* k, int64_t k_tok, int64_t k_head,
                         const T* q_weight, const T* k_weight, const float* cos, const float* sin, int64_t tokens,
                         int64_t heads, int64_t kv_heads, int64_t d, float eps, T* qo, T* ko) {
  // Over (token, head) pairs, so that a decode step's few tokens still split across threads.
  const int64_t per_token = heads + kv_heads;
  at::parallel_for(0, tokens * per_token, grain_for(d), [&](int64_t p0, int64_t p1) {
    std::vector<float> buf(3 * d);
    float *c = buf.data(), *s = c + d, *x = s + d;
    int64_t cached_token = -1;                  // the token whose cos/sin are in c and s
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t = p / per_token, h = p % per_token;
      if (t != cached_token) {
        rope_row<T>(cos + t * d, sin + t * d, d, c, s);
        cached_token = t;
      }
      const bool is_q = h < heads;
      const T* src = is_q ? q + t * q_tok + h * q_head : k + t * k_tok + (h - heads) * k_head;
      T* dst = is_q ? qo + (t * heads + h) * d : ko + (t * kv_heads + h - heads) * d;
      widen(src, d, x);
      scale_by_weight(x, is_q ? q_weight : k_weight, d, inv_rms(x, d, eps));
      rope_head(x, c, s, d, dst);
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
template void qk_norm_rope_kernel<float>(const float*, int64_t, int64_t, const float*, int64_t, int64_t,
                                         const float*, const float*, const float*, const float*, int64_t, int64_t,
                                         int64_t, int64_t, float, float*, float*);
template void qk_norm_rope_kernel<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*,
                                                 int64_t, int64_t, const c10::BFloat16*, const c10::BFloat16*,
                                                 const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                                                 float, c10::BFloat16*, c10::BFloat16*);

}  // namespace qwen_npu_cpu
