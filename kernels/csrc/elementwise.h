// The elementwise kernels (norm.cpp, activation.cpp): rounding 8 fp32 lanes to the storage dtype
// exactly as torch does, SiLU-mul's 8-lane steps (also the epilogue of linear_packed.cpp's gate|up
// form), and the declarations of the fused per-layer kernels.
#pragma once
#include "vec.h"
#include <algorithm>

namespace qwen_npu_cpu {
namespace elementwise {

// The word whose high 16 bits are v's bf16 (round to nearest even) for a number: v + 0x7FFF + the
// lowest bit kept. Both forms of the conversion below take it, and NaN apart.
inline __m256i bf16_word8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
}

// fp32 -> bf16 bits (in the low 16 bits of each lane), round to nearest even, NaN -> 0x7FC0: the
// conversion of c10::BFloat16(float), 8 lanes at a time.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(_mm256_srli_epi32(bf16_word8(v), 16), _mm256_set1_epi32(0x7FC0), nan);
}

// v rounded to T's precision, kept in fp32 (what to_f(static_cast<T>(v)) gives, per lane): for
// bf16 the word of bf16_word8 with its low 16 bits cleared in place, NaN -> 0x7FC00000.
template <typename T> inline __m256 round8(__m256 v);
template <> inline __m256 round8<float>(__m256 v) { return v; }
template <> inline __m256 round8<c10::BFloat16>(__m256 v) {
  const __m256 rounded =
      _mm256_castsi256_ps(_mm256_and_si256(bf16_word8(v), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return _mm256_blendv_ps(rounded, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// p[0..8) = static_cast<T>(v) per lane.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i b = bf16_bits8(v);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// rows rows of 16 fp32 sums, [rows][16] at sums, into y's rows (ldy apart) as T.
template <typename T>
inline void store_rows16(const float* sums, int64_t rows, T* y, int64_t ldy) {
  for (int64_t m = 0; m < rows; ++m) {
    store8(y + m * ldy, _mm256_loadu_ps(sums + m * 16));
    store8(y + m * ldy + 8, _mm256_loadu_ps(sums + m * 16 + 8));
  }
}

// silu(x) = x / (1 + exp(-x)), as torch computes it; for x < 0 as x * e / (1 + e) with
// e = exp(x), so that exp never overflows. Both branches take e = exp(-|x|) <= 1.
inline __m256 silu8(__m256 x) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 e = exp_neg(_mm256_xor_ps(_mm256_and_ps(x, abs_mask), _mm256_set1_ps(-0.0f)));
  const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), negative);
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// silu(gate) rounded to T, times up (gate and up already T's values): one 8-lane piece of silu_mul.
template <typename T>
inline __m256 act8(__m256 gate, __m256 up) { return _mm256_mul_ps(round8<T>(silu8(gate)), up); }

// Work per thread in the elementwise kernels: at least 16K elements, so that a batch-1 decode
// step's calls run inline and batch 16 uses both cores of a small machine (they are bound by
// arithmetic, not memory).
inline int64_t grain_for(int64_t per_item) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(per_item, 1)); }
// silu_mul works in (row, SILU_CHUNK-column chunk) pieces.
constexpr int64_t SILU_CHUNK = 512;

}  // namespace elementwise

// q [T, H, D] and k [T, KV, D] (token and head strides given, unit stride within a head):
// qo = rope(rms_norm(q, q_weight)), ko = rope(rms_norm(k, k_weight)) into contiguous outputs,
// with the roundings of the two kernels run one after the other (bit-identical to them).
template <typename T>
void qk_norm_rope_kernel(const T* q, int64_t q_tok, int64_t q_head, const T* k, int64_t k_tok, int64_t k_head,
                         const T* q_weight, const T* k_weight, const float* cos, const float* sin, int64_t tokens,
                         int64_t heads, int64_t kv_heads, int64_t d, float eps, T* qo, T* ko);

// gate_up [rows, 2 * n] (row stride given) -> act [rows, n] = silu(gate) * up, each op rounded to T.
template <typename T>
void silu_mul_kernel(const T* gate_up, int64_t row_stride, int64_t rows, int64_t n, T* act);

// The bf16 kernels above (and rms_norm_kernel) on 16 AVX-512 lanes (elementwise_avx512.cpp): call
// only where the CPU has AVX-512; false, and nothing written, where the build or the shape cannot
// take the call (the 8-lane kernel runs instead).
bool avx512_elementwise_available();
bool rms_norm_avx512(const c10::BFloat16* x, const c10::BFloat16* residual, const c10::BFloat16* w, int64_t rows,
                     int64_t n, float eps, c10::BFloat16* out, c10::BFloat16* sum_out);
bool qk_norm_rope_avx512(const c10::BFloat16* q, int64_t q_tok, int64_t q_head, const c10::BFloat16* k,
                         int64_t k_tok, int64_t k_head, const c10::BFloat16* q_weight, const c10::BFloat16* k_weight,
                         const float* cos, const float* sin, int64_t tokens, int64_t heads, int64_t kv_heads,
                         int64_t d, float eps, c10::BFloat16* qo, c10::BFloat16* ko);
bool silu_mul_avx512(const c10::BFloat16* gate_up, int64_t row_stride, int64_t rows, int64_t n, c10::BFloat16* act);

}  // namespace qwen_npu_cpu
