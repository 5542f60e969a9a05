// AVX-512 building blocks shared by the kernels that run on CPUs with AVX-512 (attention_bf16.cpp,
// attention_decode_bf16.cpp, attention_decode_amx.cpp, elementwise_avx512.cpp): 16-lane bf16 loads and stores with the
// roundings of c10::BFloat16, and vec.h's exp. Every function carries its target attribute, so
// these files build with the AVX2 flags and are called only where the CPU has the instructions
// (kernels/cpu.py asks for them); QN_BF16_DOT (vec.h) says whether the compiler takes them.
#pragma once
#include "vec.h"

#ifdef QN_BF16_DOT
#define QN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define QN_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace qwen_npu_cpu {
namespace vec512 {

using BF = c10::BFloat16;

// The first n (<= 16) lanes.
QN_AVX512 inline __mmask16 first(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// 16 bf16 (lanes past the mask read as 0) widened to fp32.
QN_AVX512 inline __m512 load16(const BF* p, __mmask16 m = 0xFFFF) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The word whose high 16 bits are v's bf16 (round to nearest even) for a number, as
// elementwise::bf16_word8 makes it on 8 lanes.
QN_AVX512 inline __m512i bf16_word16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
}

// fp32 -> bf16 bits in the low half of each lane: round to nearest even, NaN -> 0x7FC0, as
// c10::BFloat16(float) and elementwise::bf16_bits8 convert.
QN_AVX512 inline __m512i bf16_bits16(__m512 v) {
  return _mm512_mask_mov_epi32(_mm512_srli_epi32(bf16_word16(v), 16), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7FC0));
}

// v rounded to bf16, kept in fp32: the word of bf16_word16 with its low 16 bits cleared in place,
// NaN -> 0x7FC00000.
QN_AVX512 inline __m512 round16(__m512 v) {
  const __mmask16 number = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_and_epi32(_mm512_set1_epi32(0x7FC00000), number, bf16_word16(v),
                                                   _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// p[lane] = bf16(v[lane]) for the lanes of the mask.
QN_AVX512 inline void store16(BF* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits16(v)));
}

// Two rows a, b of 32 bf16 as bf16 pairs (a[j], b[j]): lo the pairs of j in [0, 16), hi of [16, 32),
// the layout of the dot-product and tile kernels' second operand.
QN_AVX512 inline void interleave_pairs(__m512i a, __m512i b, __m512i& lo, __m512i& hi) {
  const __m512i lo_i = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_i = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                        55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  lo = _mm512_permutex2var_epi16(a, lo_i, b);
  hi = _mm512_permutex2var_epi16(a, hi_i, b);
}

// exp of x <= 0 on 16 lanes: vec.h's exp_neg step for step on its constants (the same value in
// every lane); -inf -> 0, NaN -> NaN.
QN_AVX512 inline __m512 exp16(__m512 x) {
  using namespace exp_neg_c;
  const __m512 lo = _mm512_set1_ps(LO);
  x = _mm512_max_ps(lo, x);            // operand order: max_ps returns its 2nd operand for a NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(P[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 out = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLE_UQ), out);   // underflow -> 0; NaN kept
}

// silu(x) = x / (1 + exp(-x)), for x < 0 as x * e / (1 + e), e = exp(-|x|): activation.cpp's silu8.
QN_AVX512 inline __m512 silu16(__m512 x) {
  const __m512 e = exp16(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN))));
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 num = _mm512_mask_mul_ps(x, negative, x, e);
  return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// silu(gate) rounded to bf16, times up: one 16-lane piece of silu_mul (gate and up bf16 values).
QN_AVX512 inline __m512 act16(__m512 gate, __m512 up) { return _mm512_mul_ps(round16(silu16(gate)), up); }

}  // namespace vec512
}  // namespace qwen_npu_cpu
#endif
