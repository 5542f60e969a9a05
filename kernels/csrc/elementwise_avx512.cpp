// The bf16 elementwise kernels of norm.cpp and activation.cpp on 16 AVX-512 lanes, for CPUs that
// have them (kernels/cpu.py passes ``wide``): RMSNorm with and without the residual add, the q/k
// head norms with RoPE, and silu(gate) * up. Bit-identical to the 8-lane kernels: every value is
// rounded to bf16 where they round it (tails through masked loads and stores), and the mean
// square is summed in their order (8 lanes, two FMAs per 16 values, then across the lanes, then
// the tail one by one), so a model's bits do not depend on which of the two a CPU runs.
// Each entry returns false, having written nothing, where the build or the shape cannot take it.
#include "elementwise.h"
#include "vec512.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>

namespace qwen_npu_cpu {

#ifdef QN_BF16_DOT
namespace {

using elementwise::grain_for;
using elementwise::SILU_CHUNK;
using vec512::act16;
using vec512::BF;
using vec512::first;
using vec512::load16;
using vec512::round16;
using vec512::store16;

constexpr int64_t MAX_HEAD_DIM = 256;           // qk_norm_rope keeps a head in registers


// The sum of squares of 16 values in the 8-lane order: lanes 0-7, then lanes 8-15, into acc.
QN_AVX512 inline __m256 add_squares(__m512 v, __m256 acc) {
  const __m256 lo = _mm512_castps512_ps256(v), hi = _mm512_extractf32x8_ps(v, 1);
  return _mm256_fmadd_ps(hi, hi, _mm256_fmadd_ps(lo, lo, acc));
}

// 1 / sqrt(mean + eps) from the 8-lane sum acc of whole groups of 8, then the tail t[0, rest) one
// by one, as norm.cpp's inv_rms sums.
QN_AVX512 inline float inv_rms(__m256 acc, const float* tail, int64_t rest, int64_t n, float eps) {
  float ss = hsum(acc);
  for (int64_t i = 0; i < rest; ++i) ss += tail[i] * tail[i];
  return 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
}

// One row: out = w * round(x * inv_rms(x)); with a residual, x is first round(x + residual),
// written to sum (and read back from it: a bf16 value widens exactly).
QN_AVX512 void norm_row(const BF* x, const BF* residual, const BF* w, int64_t n, float eps, BF* out, BF* sum) {
  __m256 acc = _mm256_setzero_ps();
  alignas(64) float tail[16];
  int64_t rest = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first(n - i);
    __m512 v = load16(x + i, m);
    if (residual != nullptr) {
      v = round16(_mm512_add_ps(v, load16(residual + i, m)));
      store16(sum + i, v, m);
    }
    if (n - i >= 16) {
      acc = add_squares(v, acc);
    } else {                                    // the last, partial group: 8 lanes if whole, then one by one
      _mm512_store_ps(tail, v);
      const int64_t whole = (n - i) / 8 * 8;
      if (whole) acc = _mm256_fmadd_ps(_mm512_castps512_ps256(v), _mm512_castps512_ps256(v), acc);
      rest = n - i - whole;
      if (whole) std::copy(tail + whole, tail + whole + rest, tail);
    }
  }
  const __m512 inv = _mm512_set1_ps(inv_rms(acc, tail, rest, n, eps));
  const BF* src = residual != nullptr ? sum : x;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first(n - i);
    const __m512 normed = round16(_mm512_mul_ps(load16(src + i, m), inv));
    store16(out + i, _mm512_mul_ps(load16(w + i, m), normed), m);
  }
}

// One head of d (a multiple of 32, <= MAX_HEAD_DIM) values: normed as norm_row, then rotated with
// c, s (cos and sin rounded to bf16): o = round(round(x * c) + round(rotate_half(x) * s)).
QN_AVX512 void norm_rope_head(const BF* src, const BF* w, const float* c, const float* s, int64_t d, float eps,
                              BF* dst) {
  __m512 x[MAX_HEAD_DIM / 16];
  const int64_t nv = d / 16, half = nv / 2;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < nv; ++j) {
    x[j] = load16(src + 16 * j);
    acc = add_squares(x[j], acc);
  }
  const __m512 inv = _mm512_set1_ps(inv_rms(acc, nullptr, 0, d, eps));
  for (int64_t j = 0; j < nv; ++j)
    x[j] = round16(_mm512_mul_ps(load16(w + 16 * j), round16(_mm512_mul_ps(x[j], inv))));
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t j = 0; j < nv; ++j) {
    const __m512 rot = j < half ? _mm512_xor_ps(x[j + half], sign) : x[j - half];
    const __m512 a = round16(_mm512_mul_ps(x[j], _mm512_loadu_ps(c + 16 * j)));
    const __m512 b = round16(_mm512_mul_ps(rot, _mm512_loadu_ps(s + 16 * j)));
    store16(dst + 16 * j, _mm512_add_ps(a, b));
  }
}

// c, s [d] = cos, sin [d] rounded to bf16 (the reference casts the tables to q's dtype).
QN_AVX512 void rounded_row(const float* cos, const float* sin, int64_t d, float* c, float* s) {
  for (int64_t i = 0; i < d; i += 16) {
    _mm512_storeu_ps(c + i, round16(_mm512_loadu_ps(cos + i)));
    _mm512_storeu_ps(s + i, round16(_mm512_loadu_ps(sin + i)));
  }
}

QN_AVX512 void silu_mul_piece(const BF* gate, const BF* up, int64_t i0, int64_t i1, BF* o) {
  for (int64_t i = i0; i < i1; i += 16) {
    const __mmask16 m = first(i1 - i);
    store16(o + i, act16(load16(gate + i, m), load16(up + i, m)), m);
  }
}

}  // namespace

bool avx512_elementwise_available() { return true; }

bool rms_norm_avx512(const BF* x, const BF* residual, const BF* w, int64_t rows, int64_t n, float eps, BF* out,
                     BF* sum_out) {
  at::parallel_for(0, rows, grain_for(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      norm_row(x + r * n, residual != nullptr ? residual + r * n : nullptr, w, n, eps, out + r * n,
               sum_out != nullptr ? sum_out + r * n : nullptr);
  });
  return true;
}

bool qk_norm_rope_avx512(const BF* q, int64_t q_tok, int64_t q_head, const BF* k, int64_t k_tok, int64_t k_head,
                         const BF* q_weight, const BF* k_weight, const float* cos, const float* sin, int64_t tokens,
                         int64_t heads, int64_t kv_heads, int64_t d, float eps, BF* qo, BF* ko) {
  if (d % 32 != 0 || d > MAX_HEAD_DIM) return false;
  const int64_t per_token = heads + kv_heads;
  at::parallel_for(0, tokens * per_token, grain_for(d), [&](int64_t p0, int64_t p1) {
    alignas(64) float c[MAX_HEAD_DIM], s[MAX_HEAD_DIM];
    int64_t cached_token = -1;                  // the token whose rounded cos/sin are in c and s
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t = p / per_token, h = p % per_token;
      if (t != cached_token) {
        rounded_row(cos + t * d, sin + t * d, d, c, s);
        cached_token = t;
      }
      if (h < heads)
        norm_rope_head(q + t * q_tok + h * q_head, q_weight, c, s, d, eps, qo + (t * heads + h) * d);
      else
        norm_rope_head(k + t * k_tok + (h - heads) * k_head, k_weight, c, s, d, eps, ko + (t * kv_heads + h - heads) * d);
    }
  });
  return true;
}

bool silu_mul_avx512(const BF* gate_up, int64_t row_stride, int64_t rows, int64_t n, BF* act) {
  const int64_t chunks = (n + SILU_CHUNK - 1) / SILU_CHUNK;
  at::parallel_for(0, rows * chunks, grain_for(SILU_CHUNK), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r = p / chunks, i0 = (p % chunks) * SILU_CHUNK;
      const BF* gate = gate_up + r * row_stride;
      silu_mul_piece(gate, gate + n, i0, std::min(n, i0 + SILU_CHUNK), act + r * n);
    }
  });
  return true;
}

#else

bool avx512_elementwise_available() { return false; }
bool rms_norm_avx512(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t, float,
                     c10::BFloat16*, c10::BFloat16*) {
  return false;
}
bool qk_norm_rope_avx512(const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, int64_t, int64_t,
                         const c10::BFloat16*, const c10::BFloat16*, const float*, const float*, int64_t, int64_t,
                         int64_t, int64_t, float, c10::BFloat16*, c10::BFloat16*) {
  return false;
}
bool silu_mul_avx512(const c10::BFloat16*, int64_t, int64_t, int64_t, c10::BFloat16*) { return false; }

#endif

}  // namespace qwen_npu_cpu
