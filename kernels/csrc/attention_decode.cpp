// Decode attention: one token against its whole visible context, fp32 arithmetic (the work
// item, the positions' offsets and the dispatch are in attention.cpp).
#include "attention.h"
#include <algorithm>
#include <cmath>

namespace qwen_npu_cpu {
namespace {

// Sums of 8 accumulators: [hsum(a0), ..., hsum(a7)] in one vector.
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// scores[p] = qh . k_p for positions [p0, p0 + 8), D % 8 == 0.
template <typename S>
inline void scores8(const float* qh, const S* kc, const int64_t* pos, int64_t p0, int64_t kvh, const Geometry& g,
                    float* scores) {
  const S* k[8];
  for (int i = 0; i < 8; ++i) k[i] = kv_row(kc, pos, p0 + i, kvh, g);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < g.D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(qh + d);
    a0 = _mm256_fmadd_ps(qv, load8(k[0] + d), a0);
    a1 = _mm256_fmadd_ps(qv, load8(k[1] + d), a1);
    a2 = _mm256_fmadd_ps(qv, load8(k[2] + d), a2);
    a3 = _mm256_fmadd_ps(qv, load8(k[3] + d), a3);
    a4 = _mm256_fmadd_ps(qv, load8(k[4] + d), a4);
    a5 = _mm256_fmadd_ps(qv, load8(k[5] + d), a5);
    a6 = _mm256_fmadd_ps(qv, load8(k[6] + d), a6);
    a7 = _mm256_fmadd_ps(qv, load8(k[7] + d), a7);
  }
  _mm256_storeu_ps(scores + p0, hsum8(a0, a1, a2, a3, a4, a5, a6, a7));
}

// out[h][d0, d0 + 32) (+)= sum_p w[h][p] v_p[d0, d0 + 32) over positions [p0, p0 + n), for head
// h0 (and h0 + 1 when two, its weights ld_w apart); the accumulators stay in registers.
template <typename S, int HEADS>
inline void weighted32(const float* w, int64_t ld_w, int64_t p0, int64_t n, const S* vc, const int64_t* pos,
                       int64_t kvh, const Geometry& g, int64_t d0, float* out, int64_t ld_out, bool accumulate) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
  float* o0 = out + d0;
  float* o1 = out + ld_out + d0;
  if (accumulate) {
    c00 = _mm256_loadu_ps(o0); c01 = _mm256_loadu_ps(o0 + 8); c02 = _mm256_loadu_ps(o0 + 16); c03 = _mm256_loadu_ps(o0 + 24);
    if constexpr (HEADS == 2) {
      c10 = _mm256_loadu_ps(o1); c11 = _mm256_loadu_ps(o1 + 8); c12 = _mm256_loadu_ps(o1 + 16); c13 = _mm256_loadu_ps(o1 + 24);
    }
  }
  for (int64_t p = p0; p < p0 + n; ++p) {
    const S* v = kv_row(vc, pos, p, kvh, g) + d0;
    const __m256 v0 = load8(v), v1 = load8(v + 8), v2 = load8(v + 16), v3 = load8(v + 24);
    const __m256 w0 = _mm256_broadcast_ss(w + p);
    c00 = _mm256_fmadd_ps(w0, v0, c00); c01 = _mm256_fmadd_ps(w0, v1, c01);
    c02 = _mm256_fmadd_ps(w0, v2, c02); c03 = _mm256_fmadd_ps(w0, v3, c03);
    if constexpr (HEADS == 2) {
      const __m256 w1 = _mm256_broadcast_ss(w + ld_w + p);
      c10 = _mm256_fmadd_ps(w1, v0, c10); c11 = _mm256_fmadd_ps(w1, v1, c11);
      c12 = _mm256_fmadd_ps(w1, v2, c12); c13 = _mm256_fmadd_ps(w1, v3, c13);
    }
  }
  _mm256_storeu_ps(o0, c00); _mm256_storeu_ps(o0 + 8, c01); _mm256_storeu_ps(o0 + 16, c02); _mm256_storeu_ps(o0 + 24, c03);
  if constexpr (HEADS == 2) {
    _mm256_storeu_ps(o1, c10); _mm256_storeu_ps(o1 + 8, c11); _mm256_storeu_ps(o1 + 16, c12); _mm256_storeu_ps(o1 + 24, c13);
  }
}

// scores[h][p] = q_h . k_p for two heads (h = 0, 1; score rows ld apart) and positions
// [p0, p0 + 4): each K vector is widened once for both heads. D % 8 == 0.
template <typename S>
inline void scores4x2(const float* q0, const float* q1, const S* kc, const int64_t* pos, int64_t p0, int64_t kvh,
                      const Geometry& g, float* scores, int64_t ld) {
  const S* k[4];
  for (int i = 0; i < 4; ++i) k[i] = kv_row(kc, pos, p0 + i, kvh, g);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int64_t d = 0; d < g.D; d += 8) {
    const __m256 x = _mm256_loadu_ps(q0 + d), y = _mm256_loadu_ps(q1 + d);
    const __m256 k0 = load8(k[0] + d), k1 = load8(k[1] + d), k2 = load8(k[2] + d), k3 = load8(k[3] + d);
    a0 = _mm256_fmadd_ps(x, k0, a0); a1 = _mm256_fmadd_ps(x, k1, a1);
    a2 = _mm256_fmadd_ps(x, k2, a2); a3 = _mm256_fmadd_ps(x, k3, a3);
    b0 = _mm256_fmadd_ps(y, k0, b0); b1 = _mm256_fmadd_ps(y, k1, b1);
    b2 = _mm256_fmadd_ps(y, k2, b2); b3 = _mm256_fmadd_ps(y, k3, b3);
  }
  const __m256 s = hsum8(a0, a1, a2, a3, b0, b1, b2, b3);      // [h0 p0..p3 | h1 p0..p3]
  _mm_storeu_ps(scores + p0, _mm256_castps256_ps128(s));
  _mm_storeu_ps(scores + ld + p0, _mm256_extractf128_ps(s, 1));
}

constexpr int64_t POS_CHUNK = 8;     // positions of V kept in L1 across the d0 slices

}  // namespace

// One token, the heads of KV heads [kvh0, kvh1), over positions [0, n): scores, softmax,
// weighted sum of V. Positions go 8 at a time, and for those 8 every KV head of the group is
// done before the next 8: the K/V of one position for all KV heads are adjacent in the cache,
// so the context streams through memory once, nearly in order, for the scores and once for the
// weighted sum (the 8 positions of V stay in L1 across the d0 slices).
template <typename S>
void attend_token(const S* q, const S* kc, const S* vc, const int64_t* pos, int64_t n, int64_t kvh0, int64_t kvh1,
                  float scale, const Geometry& g, S* out, std::vector<float>& work) {
  const int64_t G = g.G, D = g.D, NH = (kvh1 - kvh0) * G;     // heads of the group
  work.resize(NH * D * 2 + NH * n);
  float* qf = work.data();
  float* acc = qf + NH * D;
  float* scores = acc + NH * D;                                // [NH][n]
  for (int64_t h = 0; h < NH; ++h)
    for (int64_t d = 0; d < D; ++d) qf[h * D + d] = to_f(q[h * D + d]) * scale;
  int64_t p = 0;
  if (D % 8 == 0) {
    for (; p + 8 <= n; p += 8)                                 // 8 positions, every head of the group
      for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
        const int64_t hb = (kvh - kvh0) * G;                   // the group's first head of kvh
        int64_t h = 0;
        for (; h + 2 <= G; h += 2) {
          float* sh = scores + (hb + h) * n;
          scores4x2(qf + (hb + h) * D, qf + (hb + h + 1) * D, kc, pos, p, kvh, g, sh, n);
          scores4x2(qf + (hb + h) * D, qf + (hb + h + 1) * D, kc, pos, p + 4, kvh, g, sh, n);
        }
        if (h < G) scores8(qf + (hb + h) * D, kc, pos, p, kvh, g, scores + (hb + h) * n);
      }
  }
  for (; p < n; ++p)
    for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
      const S* k = kv_row(kc, pos, p, kvh, g);
      for (int64_t hh = 0; hh < G; ++hh) {
        const int64_t h = (kvh - kvh0) * G + hh;
        float s = 0.0f;
        for (int64_t d = 0; d < D; ++d) s += qf[h * D + d] * to_f(k[d]);
        scores[h * n + p] = s;
      }
    }
  for (int64_t h = 0; h < NH; ++h) {
    float* s = scores + h * n;
    float mx = -INFINITY;
    for (int64_t p = 0; p < n; ++p) mx = std::max(mx, s[p]);
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 8 <= n; p += 8) {
      const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + p), vmx));
      _mm256_storeu_ps(s + p, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; p < n; ++p) { s[p] = std::exp(s[p] - mx); sum += s[p]; }
    const float inv = 1.0f / sum;
    for (p = 0; p < n; ++p) s[p] *= inv;
  }
  if (D % 32 == 0) {
    for (int64_t c0 = 0; c0 < n; c0 += POS_CHUNK) {
      const int64_t cn = std::min(POS_CHUNK, n - c0);
      for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
        const int64_t hb = (kvh - kvh0) * G;
        int64_t h = 0;
        for (; h + 2 <= G; h += 2)
          for (int64_t d0 = 0; d0 < D; d0 += 32)
            weighted32<S, 2>(scores + (hb + h) * n, n, c0, cn, vc, pos, kvh, g, d0, acc + (hb + h) * D, D, c0 > 0);
        for (; h < G; ++h)
          for (int64_t d0 = 0; d0 < D; d0 += 32)
            weighted32<S, 1>(scores + (hb + h) * n, n, c0, cn, vc, pos, kvh, g, d0, acc + (hb + h) * D, D, c0 > 0);
      }
    }
  } else {
    std::fill(acc, acc + NH * D, 0.0f);
    for (int64_t p = 0; p < n; ++p)
      for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
        const S* v = kv_row(vc, pos, p, kvh, g);
        for (int64_t hh = 0; hh < G; ++hh) {
          const int64_t h = (kvh - kvh0) * G + hh;
          const float w = scores[h * n + p];
          for (int64_t d = 0; d < D; ++d) acc[h * D + d] += w * to_f(v[d]);
        }
      }
  }
  for (int64_t h = 0; h < NH; ++h)
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<S>(acc[h * D + d]);
}

template void attend_token<float>(const float*, const float*, const float*, const int64_t*, int64_t, int64_t,
                                 int64_t, float, const Geometry&, float*, std::vector<float>&);
template void attend_token<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                                         const int64_t*, int64_t, int64_t, int64_t, float, const Geometry&,
                                         c10::BFloat16*, std::vector<float>&);

}  // namespace qwen_npu_cpu
