// The decode token of attention_decode.cpp with the CPU's native bf16 dot products (AVX512-BF16):
// one token, the heads of KV heads [kvh0, kvh1), all n visible positions, read once each, in the
// order they lie in the cache (per position all its KV heads, adjacent), with no fp32 copy of K or V:
//
//   scores    for a pair of query heads and 8 positions (one head: 16 positions), 16 accumulators
//             of bf16 pairs along D (q straight from the step's bf16 query, k straight from the
//             cache), folded into one vector of 16 scores; times the scale, fp32.
//   softmax   fp32 over the whole context, 16 lanes (vec.h's exp, step for step).
//   P V       the weights rounded to bf16 pairs of positions, V of two positions interleaved into
//             pairs (one word permute per 32 values), accumulators of a head pair in registers
//             over a chunk of positions; normalised by the fp32 sum at the end.
//
// Products of two bf16 values are exact in fp32, sums are fp32; what differs from the fp32 kernel
// is the order of the sums along D and that P is rounded to bf16 before P V, as the bf16 prefill
// tile does (attention_bf16.cpp): within the bf16 tolerance of the reference. What is read, the
// masking and NaN propagation (a NaN score leaves the max and reaches the output) are those of
// the fp32 kernel. Compiled for AVX-512 with a function attribute; attention.cpp calls it only
// where the caller asked for bf16 dot products (``bf16_dot``).
#include "attention.h"
#include "vec512.h"
#include <algorithm>
#include <cmath>
#include <vector>

namespace qwen_npu_cpu {

#ifdef QN_BF16_DOT
namespace {

using vec512::exp16;

constexpr int64_t MAX_D = 256;        // head_dim this kernel takes (a multiple of 32)
constexpr int64_t PV_CHUNK = 32;      // positions per pass of the P V accumulators
#ifndef QN_PF_AHEAD
#define QN_PF_AHEAD 16
#endif
constexpr int64_t PF_AHEAD = QN_PF_AHEAD;      // positions ahead of the reads that are prefetched

QN_AVX512_BF16 inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// Lane i of the result = the sum of the 16 lanes of a[i].
QN_AVX512_BF16 inline __m512 fold16(const __m512* a) {
  __m512 t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i)                     // 128-bit quarters: [a0 lo + a0 hi | a1 lo + a1 hi]
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)                     // quarter q holds 4 partial sums of a[4i + q]
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)                     // quarter q: 2 sums of a[8i + q], 2 of a[8i + 4 + q]
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  // lane 4q + e = the sum of a[4e + q]; put it in lane 4e + q
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, w);
}

// scores[h][p0 + i] = scale * q_h . k(p0 + i) for HEADS (1 or 2) heads (rows ld apart) and
// 16 / HEADS positions from p0; positions past n read the zero row.
template <int HEADS>
QN_AVX512_BF16 void score_block(const c10::BFloat16* q, int64_t q_ld, const c10::BFloat16* kc, const int64_t* pos,
                                int64_t p0, int64_t n, int64_t kvh, const Geometry& g, const uint16_t* zero,
                                float scale, float* scores, int64_t ld) {
  constexpr int PN = 16 / HEADS;
  const uint16_t* k[PN];
  for (int i = 0; i < PN; ++i)
    k[i] = p0 + i < n ? reinterpret_cast<const uint16_t*>(kv_row(kc, pos, p0 + i, kvh, g)) : zero;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < g.D; d += 32) {
    __m512i qv[HEADS];
    for (int h = 0; h < HEADS; ++h) qv[h] = _mm512_loadu_si512(reinterpret_cast<const uint16_t*>(q + h * q_ld) + d);
#pragma GCC unroll 16
    for (int i = 0; i < PN; ++i) {
      const __m512i kv = _mm512_loadu_si512(k[i] + d);
#pragma GCC unroll 2
      for (int h = 0; h < HEADS; ++h) acc[h * PN + i] = dot(acc[h * PN + i], qv[h], kv);
    }
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, _mm512_mul_ps(fold16(acc), _mm512_set1_ps(scale)));
  for (int h = 0; h < HEADS; ++h) std::copy(s + h * PN, s + (h + 1) * PN, scores + h * ld + p0);
}

// acc_h[d] (+)= sum_p w_h[p] v_p[d] over the pairs of positions [p0, p0 + 2 * pairs) for HEADS heads
// (weights wp: per head, bf16 pairs of positions, ld_w pairs apart; outputs D apart), d in
// [d0, d0 + 128) or less.
template <int HEADS>
QN_AVX512_BF16 void weigh_block(const uint32_t* wp, int64_t ld_w, const c10::BFloat16* vc, const int64_t* pos,
                                int64_t p0, int64_t pairs, int64_t n, int64_t kvh, const Geometry& g,
                                const uint16_t* zero, int64_t d0, float* out, bool accumulate) {
  const int nb = static_cast<int>(std::min<int64_t>(128, g.D - d0) / 16);   // 16 lanes of d each
  __m512 acc[HEADS][8];
  for (int h = 0; h < HEADS; ++h)
    for (int j = 0; j < 8; ++j)
      acc[h][j] = accumulate && j < nb ? _mm512_loadu_ps(out + h * g.D + d0 + j * 16) : _mm512_setzero_ps();
  for (int64_t p2 = 0; p2 < pairs; ++p2) {
    const int64_t p = p0 + 2 * p2;
    const uint16_t* a = p < n ? reinterpret_cast<const uint16_t*>(kv_row(vc, pos, p, kvh, g)) + d0 : zero;
    const uint16_t* b = p + 1 < n ? reinterpret_cast<const uint16_t*>(kv_row(vc, pos, p + 1, kvh, g)) + d0 : zero;
    __m512i w[HEADS];
    for (int h = 0; h < HEADS; ++h) w[h] = _mm512_set1_epi32(static_cast<int>(wp[h * ld_w + p / 2]));
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
      if (j >= nb) break;
      const __m512i va = _mm512_loadu_si512(a + j * 16), vb = _mm512_loadu_si512(b + j * 16);
      __m512i lo, hi;
      vec512::interleave_pairs(va, vb, lo, hi);
      for (int h = 0; h < HEADS; ++h) {
        acc[h][j] = dot(acc[h][j], w[h], lo);
        acc[h][j + 1] = dot(acc[h][j + 1], w[h], hi);
      }
    }
  }
  for (int h = 0; h < HEADS; ++h)
    for (int j = 0; j < nb; ++j) _mm512_storeu_ps(out + h * g.D + d0 + j * 16, acc[h][j]);
}

QN_AVX512_BF16 void token(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc,
                          const int64_t* pos, int64_t n, int64_t kvh0, int64_t kvh1, float scale, const Geometry& g,
                          c10::BFloat16* out) {
  const int64_t G = g.G, D = g.D, NH = (kvh1 - kvh0) * G;
  const int64_t np = (n + 31) / 32 * 32;                 // scores per head, padded to whole vectors
  thread_local std::vector<float> scores, acc, total;
  thread_local std::vector<uint16_t> wp, zero;
  scores.resize(NH * np);           // past n: never read unmasked
  acc.resize(NH * D);
  total.resize(NH);
  wp.resize(NH * np);               // every pair written below
  if (zero.size() < MAX_D) zero.assign(MAX_D, 0);
  // scores, 16 / heads positions at a time, every KV head of the item before the next positions
  for (int64_t p0 = 0; p0 < n; p0 += 16) {
    prefetch_rows(kc, pos, std::min(n, p0 + PF_AHEAD), std::min(n, p0 + PF_AHEAD + 16), kvh0, kvh1, g);
    for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
      const int64_t hb = (kvh - kvh0) * G;
      const c10::BFloat16* qh = q + hb * D;
      int64_t h = 0;
      for (; h + 2 <= G; h += 2) {
        score_block<2>(qh + h * D, D, kc, pos, p0, n, kvh, g, zero.data(), scale, scores.data() + (hb + h) * np, np);
        if (p0 + 8 < n)
          score_block<2>(qh + h * D, D, kc, pos, p0 + 8, n, kvh, g, zero.data(), scale, scores.data() + (hb + h) * np, np);
      }
      if (h < G) score_block<1>(qh + h * D, D, kc, pos, p0, n, kvh, g, zero.data(), scale, scores.data() + (hb + h) * np, np);
    }
  }
  // softmax numerators, rounded to bf16 pairs of positions; positions past n weigh 0
  for (int64_t h = 0; h < NH; ++h) {
    float* s = scores.data() + h * np;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t p = 0; p < np; p += 16) {
      const __mmask16 live = p + 16 <= n ? 0xFFFF : p < n ? static_cast<__mmask16>((1u << (n - p)) - 1) : 0;
      mx = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, s + p), mx);
    }
    const __m512 vmx = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p += 32) {
      const __mmask16 l0 = p + 16 <= n ? 0xFFFF : p < n ? static_cast<__mmask16>((1u << (n - p)) - 1) : 0;
      const __mmask16 l1 = p + 32 <= n ? 0xFFFF : p + 16 < n ? static_cast<__mmask16>((1u << (n - p - 16)) - 1) : 0;
      const __m512 e0 = _mm512_maskz_mov_ps(l0, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + p), vmx)));
      const __m512 e1 = _mm512_maskz_mov_ps(l1, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + p + 16), vmx)));
      sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
      _mm512_storeu_si512(wp.data() + h * np + p, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    total[h] = _mm512_reduce_add_ps(sum);
  }
  // P V: a chunk of positions at a time, every KV head of the item before the next chunk
  const uint32_t* w = reinterpret_cast<const uint32_t*>(wp.data());
  const int64_t ld_w = np / 2;
  for (int64_t c0 = 0; c0 < n; c0 += PV_CHUNK) {
    const int64_t pairs = (std::min(PV_CHUNK, n - c0) + 1) / 2;
    prefetch_rows(vc, pos, std::min(n, c0 + PF_AHEAD), std::min(n, c0 + PF_AHEAD + PV_CHUNK), kvh0, kvh1, g);
    for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
      const int64_t hb = (kvh - kvh0) * G;
      int64_t h = 0;
      for (; h + 2 <= G; h += 2)
        for (int64_t d0 = 0; d0 < D; d0 += 128)
          weigh_block<2>(w + (hb + h) * ld_w, ld_w, vc, pos, c0, pairs, n, kvh, g, zero.data(), d0,
                         acc.data() + (hb + h) * D, c0 > 0);
      for (; h < G; ++h)
        for (int64_t d0 = 0; d0 < D; d0 += 128)
          weigh_block<1>(w + (hb + h) * ld_w, ld_w, vc, pos, c0, pairs, n, kvh, g, zero.data(), d0,
                         acc.data() + (hb + h) * D, c0 > 0);
    }
  }
  for (int64_t h = 0; h < NH; ++h) {
    const float inv = 1.0f / total[h];
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<c10::BFloat16>(acc[h * D + d] * inv);
  }
}

}  // namespace

bool attend_token_bf16(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* pos,
                       int64_t n, int64_t kvh0, int64_t kvh1, float scale, const Geometry& g, c10::BFloat16* out) {
  if (g.D % 32 || g.D > MAX_D || n < 1) return false;
  token(q, kc, vc, pos, n, kvh0, kvh1, scale, g, out);
  return true;
}

#else

bool attend_token_bf16(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, const int64_t*, int64_t,
                       int64_t, int64_t, float, const Geometry&, c10::BFloat16*) {
  return false;
}

#endif

}  // namespace qwen_npu_cpu
