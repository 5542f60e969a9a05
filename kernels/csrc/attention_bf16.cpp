// The prefill tile of attention.cpp with the CPU's native bf16 dot products (AVX512-BF16): the
// same flash loop (tokens [0, T) of one row, one KV head, chunks of CHUNK positions, online
// softmax), with both products on bf16 pairs instead of fp32 registers:
//
//   S = Q K^T   vectors run over 16 query rows (token-major, then head), Q packed once per tile
//               as [D/2][query rows] pairs; each position's K row is read straight from the cache
//               and broadcast pair by pair, so K is never transposed. Scores and the softmax stay
//               fp32, lane per query row.
//   O += P V    vectors run over 16 of D; P is rounded to bf16 pairs of positions [CHUNK/2][rows],
//               V interleaved into [CHUNK/2][D] pairs per chunk (one word permute per 32 values).
//
// Products of two bf16 values are exact in fp32 and the sums fp32; what differs from the fp32
// tile is that P is rounded to bf16 (8 bits) before P V, as bf16 flash kernels do: within the
// bf16 tolerance of the reference (tests/kernels/test_cpu.py). Masking, NaN propagation and what
// is read are those of the fp32 tile. Compiled for AVX-512 with a function attribute; cpu.py asks
// for it (``bf16_dot``) only where the CPU reports avx512_bf16 and no ISA cap hides it.
#include "attention.h"
#include "vec512.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace qwen_npu_cpu {

#ifdef QN_BF16_DOT
namespace {

using vec512::exp16;

constexpr int64_t CHUNK = 32;          // positions per step of the flash loop
constexpr int PR = 4;                  // positions per score tile

QN_AVX512_BF16 inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// St[p][b] = scale * q_rows(b) . k(c0 + p) for the chunk's positions, MB blocks of 16 query rows.
template <int MB>
QN_AVX512_BF16 void scores(const uint32_t* qp, int64_t mqp, const uint32_t* const* krows, int64_t D, float scale,
                           float* St) {
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t p0 = 0; p0 < CHUNK; p0 += PR) {
    __m512 acc[PR][MB];
#pragma GCC unroll 4
    for (int i = 0; i < PR; ++i)
#pragma GCC unroll 4
      for (int b = 0; b < MB; ++b) acc[i][b] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < D / 2; ++d2) {
      __m512i q[MB];
#pragma GCC unroll 4
      for (int b = 0; b < MB; ++b) q[b] = _mm512_loadu_si512(qp + d2 * mqp + b * 16);
#pragma GCC unroll 4
      for (int i = 0; i < PR; ++i) {
        const __m512i k = _mm512_set1_epi32(static_cast<int>(krows[p0 + i][d2]));
#pragma GCC unroll 4
        for (int b = 0; b < MB; ++b) acc[i][b] = dot(acc[i][b], q[b], k);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < PR; ++i)
#pragma GCC unroll 4
      for (int b = 0; b < MB; ++b) _mm512_storeu_ps(St + ((p0 + i) * MB + b) * 16, _mm512_mul_ps(acc[i][b], vs));
  }
}

// O[m][d] = alpha[m] * O[m][d] + sum_p P[m][p] V[p][d] for query rows m, m + 1 (MR of them).
template <int MR>
QN_AVX512_BF16 void weighted_sum(const uint32_t* pp, int64_t mqp, const uint32_t* vp, int64_t D, int64_t m,
                                 const float* alpha, float* O) {
  for (int64_t d0 = 0; d0 < D; d0 += 128) {
    const int nb = static_cast<int>(std::min<int64_t>(128, D - d0) / 16);
    __m512 acc[MR][8];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 8; ++j)
        acc[i][j] = j < nb ? _mm512_mul_ps(_mm512_set1_ps(alpha[m + i]), _mm512_loadu_ps(O + (m + i) * D + d0 + j * 16))
                           : _mm512_setzero_ps();
    for (int64_t p2 = 0; p2 < CHUNK / 2; ++p2) {
      __m512i w[MR];
      for (int i = 0; i < MR; ++i) w[i] = _mm512_set1_epi32(static_cast<int>(pp[p2 * mqp + m + i]));
      const uint32_t* v = vp + p2 * D + d0;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        if (j >= nb) break;
        const __m512i vv = _mm512_loadu_si512(v + j * 16);
        for (int i = 0; i < MR; ++i) acc[i][j] = dot(acc[i][j], w[i], vv);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < nb; ++j) _mm512_storeu_ps(O + (m + i) * D + d0 + j * 16, acc[i][j]);
  }
}

template <int MB>
QN_AVX512_BF16 void tile(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc,
                         const int64_t* pos, int64_t T, int64_t first_visible, int64_t kvh, float scale,
                         const Geometry& g, c10::BFloat16* out) {
  const int64_t G = g.G, D = g.D, MQ = T * G, mqp = MB * 16, n = first_visible + T - 1;
  thread_local std::vector<uint32_t> qp, pp, vp, zero;
  thread_local std::vector<float> O, alpha, St, P;    // St, P: [CHUNK][MB] vectors of 16 lanes
  qp.assign(D / 2 * mqp, 0u);
  pp.resize(CHUNK / 2 * mqp);
  vp.resize(CHUNK / 2 * D);
  zero.assign(D / 2, 0u);
  O.assign(MQ * D, 0.0f);
  alpha.resize(mqp);
  St.resize(CHUNK * MB * 16);
  P.resize(CHUNK * MB * 16);
  for (int64_t m = 0; m < MQ; ++m) {                    // Q as [D/2][rows] bf16 pairs
    const uint32_t* row = reinterpret_cast<const uint32_t*>(q + (m / G) * g.H * D + (m % G) * D);
    for (int64_t d2 = 0; d2 < D / 2; ++d2) qp[d2 * mqp + m] = row[d2];
  }
  alignas(64) int32_t vis[MB * 16];                     // positions [0, vis) seen by each query row
  for (int64_t m = 0; m < mqp; ++m) vis[m] = m < MQ ? static_cast<int32_t>(first_visible + m / G) : 1;
  __m512 mx[MB], sum[MB];
  for (int b = 0; b < MB; ++b) mx[b] = _mm512_set1_ps(-INFINITY), sum[b] = _mm512_setzero_ps();
  // word j of a pair vector: j even from the first source's j / 2, j odd from the second's
  alignas(64) int16_t pair_idx[32];
  for (int j = 0; j < 32; ++j) pair_idx[j] = static_cast<int16_t>((j % 2 ? 16 : 0) + j / 2);
  const __m512i pair_i = _mm512_load_si512(pair_idx);
  const uint32_t* krows[CHUNK];
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    const int64_t cn = std::min(CHUNK, n - c0);
    for (int64_t p = 0; p < CHUNK; ++p)
      krows[p] = p < cn ? reinterpret_cast<const uint32_t*>(kv_row(kc, pos, c0 + p, kvh, g)) : zero.data();
    scores<MB>(qp.data(), mqp, krows, D, scale, St.data());
    for (int b = 0; b < MB; ++b) {                      // causal mask, online softmax, lane per row
      const __m512i vb = _mm512_load_si512(vis + b * 16);
      __m512 cmax = mx[b];
      for (int64_t p = 0; p < CHUNK; ++p) {
        const __mmask16 seen = p < cn ? _mm512_cmplt_epi32_mask(_mm512_set1_epi32(static_cast<int>(c0 + p)), vb) : 0;
        float* sp = St.data() + (p * MB + b) * 16;
        const __m512 sv = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(sp));
        _mm512_storeu_ps(sp, sv);
        cmax = _mm512_max_ps(sv, cmax);                 // a NaN score leaves the max, as in the fp32 tile
      }
      const __m512 a = exp16(_mm512_sub_ps(mx[b], cmax));
      mx[b] = cmax;
      __m512 s = _mm512_setzero_ps();
      for (int64_t p = 0; p < CHUNK; ++p) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(St.data() + (p * MB + b) * 16), cmax));
        _mm512_storeu_ps(P.data() + (p * MB + b) * 16, e);
        s = _mm512_add_ps(s, e);
      }
      sum[b] = _mm512_fmadd_ps(sum[b], a, s);
      _mm512_storeu_ps(alpha.data() + b * 16, a);
      for (int64_t p2 = 0; p2 < CHUNK / 2; ++p2) {        // P as [CHUNK/2][rows] bf16 pairs
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(P.data() + ((2 * p2 + 1) * MB + b) * 16),
                                                          _mm512_loadu_ps(P.data() + (2 * p2 * MB + b) * 16));
        _mm512_storeu_si512(pp.data() + p2 * mqp + b * 16, _mm512_permutexvar_epi16(pair_i, both));
      }
    }
    for (int64_t p2 = 0; p2 < CHUNK / 2; ++p2) {        // V as [CHUNK/2][D] bf16 pairs
      const int64_t p = 2 * p2;
      const uint16_t* a = p < cn ? reinterpret_cast<const uint16_t*>(kv_row(vc, pos, c0 + p, kvh, g))
                                 : reinterpret_cast<const uint16_t*>(zero.data());
      const uint16_t* b = p + 1 < cn ? reinterpret_cast<const uint16_t*>(kv_row(vc, pos, c0 + p + 1, kvh, g))
                                     : reinterpret_cast<const uint16_t*>(zero.data());
      for (int64_t d = 0; d < D; d += 32) {
        __m512i lo, hi;
        vec512::interleave_pairs(_mm512_loadu_si512(a + d), _mm512_loadu_si512(b + d), lo, hi);
        _mm512_storeu_si512(vp.data() + p2 * D + d, lo);
        _mm512_storeu_si512(vp.data() + p2 * D + d + 16, hi);
      }
    }
    int64_t m = 0;
    for (; m + 2 <= MQ; m += 2) weighted_sum<2>(pp.data(), mqp, vp.data(), D, m, alpha.data(), O.data());
    if (m < MQ) weighted_sum<1>(pp.data(), mqp, vp.data(), D, m, alpha.data(), O.data());
  }
  alignas(64) float total[MB * 16];
  for (int b = 0; b < MB; ++b) _mm512_store_ps(total + b * 16, sum[b]);
  for (int64_t m = 0; m < MQ; ++m) {
    const float inv = 1.0f / total[m];
    c10::BFloat16* o = out + (m / G) * g.H * D + (m % G) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<c10::BFloat16>(O[m * D + d] * inv);
  }
}

}  // namespace

bool attend_tile_bf16(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* pos,
                      int64_t T, int64_t first_visible, int64_t kvh, float scale, const Geometry& g,
                      c10::BFloat16* out) {
  const int64_t MQ = T * g.G;
  if (g.D % 32 || g.D > 256 || MQ > 64 || MQ < 1) return false;
  switch ((MQ + 15) / 16) {
    case 1: tile<1>(q, kc, vc, pos, T, first_visible, kvh, scale, g, out); break;
    case 2: tile<2>(q, kc, vc, pos, T, first_visible, kvh, scale, g, out); break;
    case 3: tile<3>(q, kc, vc, pos, T, first_visible, kvh, scale, g, out); break;
    default: tile<4>(q, kc, vc, pos, T, first_visible, kvh, scale, g, out); break;
  }
  return true;
}

#else

bool attend_tile_bf16(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, const int64_t*, int64_t,
                      int64_t, int64_t, float, const Geometry&, c10::BFloat16*) {
  return false;
}

#endif

}  // namespace qwen_npu_cpu
