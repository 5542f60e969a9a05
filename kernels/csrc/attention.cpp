// Causal paged attention over a [blocks, block_size, KV, D] cache, fp32 arithmetic.
//
// Token t of row r sees context positions [0, visible(t)), visible = seq_len - query_len + i + 1
// for the row's i-th token, read through the row's block table; nothing outside that is read.
// Work items are (row, a tile of consecutive tokens of that row, KV heads):
//
//   one token (decode)    scores q . k for 4-8 positions at a time, softmax, weighted sum of v
//                         with the accumulators in registers; one item takes all the token's
//                         KV heads (or a share of them when rows are few), so the context
//                         streams through memory once, in order.
//   several tokens        flash-style: the G heads of the KV head times up to TILE_TOKENS tokens
//   (prefill chunks)      form MQ <= 16 query rows; per chunk of CHUNK positions, K is
//                         transposed into [D][16] blocks and S = Q K^T, online softmax, and
//                         acc += P V all run on the tile16 register tile.
#include "vec.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace qwen_npu_cpu {
namespace {

constexpr int64_t CHUNK = 32;          // context positions per step of the flash loop (2 x 16)
constexpr int64_t MAX_QUERY_ROWS = 16;  // tokens x heads per tile

// Positions are read through ``pos``: the element offset of position p (KV head 0) in the
// caches, worked out once per work item from the block table (one lookup per block instead of a
// division per position read).
struct Geometry {
  int64_t H, KV, G, D, BS, MB;
  int64_t pos_stride() const { return KV * D; }
  int64_t block_stride() const { return BS * KV * D; }
};

template <typename S>
inline const S* kv_row(const S* cache, const int64_t* pos, int64_t p, int64_t kvh, const Geometry& g) {
  return cache + pos[p] + kvh * g.D;
}

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

// One token, the heads of KV heads [kvh0, kvh1), over positions [0, n): scores, softmax,
// weighted sum of V. Positions go 8 at a time, and for those 8 every KV head of the group is
// done before the next 8: the K/V of one position for all KV heads are adjacent in the cache,
// so the context streams through memory once, nearly in order, for the scores and once for the
// weighted sum (the 8 positions of V stay in L1 across the d0 slices).
constexpr int64_t POS_CHUNK = 8;
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

// Tokens [0, T) of one row (token i sees positions [0, first_visible + i)), KV head kvh.
// q and out point at the first token's first head of this KV head; token stride H * D.
template <typename S>
void attend_tile(const S* q, const S* kc, const S* vc, const int64_t* pos, int64_t T, int64_t first_visible,
                 int64_t kvh, float scale, const Geometry& g, S* out, std::vector<float>& work) {
  const int64_t G = g.G, D = g.D, MQ = T * G;            // query rows: token-major, then head
  const int64_t n = first_visible + T - 1;               // positions the last token sees
  work.resize(MQ * D * 2 + D * CHUNK + CHUNK * D + MQ * CHUNK + 2 * MQ);
  float* qf = work.data();
  float* acc = qf + MQ * D;
  float* kt = acc + MQ * D;           // [CHUNK / 16][D][16]
  float* vf = kt + D * CHUNK;         // [CHUNK][D]
  float* sp = vf + CHUNK * D;         // [MQ][CHUNK] scores, then probabilities
  float* mx = sp + MQ * CHUNK;
  float* sum = mx + MQ;
  const std::vector<S> zrow(D, static_cast<S>(0.0f));   // stands in for positions past the context
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < G; ++h)
      for (int64_t d = 0; d < D; ++d) qf[(t * G + h) * D + d] = to_f(q[t * g.H * D + h * D + d]) * scale;
  std::fill(acc, acc + MQ * D, 0.0f);
  std::fill(mx, mx + MQ, -INFINITY);
  std::fill(sum, sum + MQ, 0.0f);
  const S* rows[16];
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    const int64_t cn = std::min(CHUNK, n - c0);
    for (int64_t b = 0; b < cn; b += 16) {                 // S[:, b:b+16] = Q K^T
      for (int64_t r = 0; r < 16; ++r) rows[r] = c0 + b + r < n ? kv_row(kc, pos, c0 + b + r, kvh, g) : zrow.data();
      pack16(rows, 0, D, kt + b * D, 0);
      rows16(qf, D, MQ, kt + b * D, 16, D, sp + b, CHUNK, false);
    }
    for (int64_t p = 0; p < CHUNK; ++p) {
      float* dst = vf + p * D;
      if (p < cn) {
        const S* v = kv_row(vc, pos, c0 + p, kvh, g);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, load8(v + d));
      } else {
        std::fill(dst, dst + D, 0.0f);
      }
    }
    // causal mask, online softmax: rescale what was accumulated, turn scores into weights
    for (int64_t m = 0; m < MQ; ++m) {
      const int64_t visible = first_visible + m / G;       // positions [0, visible) are seen
      float* s = sp + m * CHUNK;
      const int64_t live = std::clamp<int64_t>(visible - c0, 0, cn);
      for (int64_t p = live; p < CHUNK; ++p) s[p] = -INFINITY;
      float cmax = mx[m];
      for (int64_t p = 0; p < live; ++p) cmax = std::max(cmax, s[p]);
      const float alpha = std::exp(mx[m] - cmax);         // 0 on the first chunk (mx = -inf)
      mx[m] = cmax;
      const __m256 vmx = _mm256_set1_ps(cmax);
      __m256 vs = _mm256_setzero_ps();
      for (int64_t p = 0; p < CHUNK; p += 8) {
        const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + p), vmx));
        _mm256_storeu_ps(s + p, e);
        vs = _mm256_add_ps(vs, e);
      }
      sum[m] = sum[m] * alpha + hsum(vs);
      if (alpha != 1.0f) {
        const __m256 va = _mm256_set1_ps(alpha);
        float* a = acc + m * D;
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(a + d, _mm256_mul_ps(va, _mm256_loadu_ps(a + d)));
      }
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) rows16(sp, CHUNK, MQ, vf + d0, D, CHUNK, acc + d0, D, true);
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < G; ++h) {
      const int64_t m = t * G + h;
      const float inv = 1.0f / sum[m];
      for (int64_t d = 0; d < D; ++d) out[t * g.H * D + h * D + d] = static_cast<S>(acc[m * D + d] * inv);
    }
}

// A work item: tokens [t0, t1) of a row, KV heads [kvh0, kvh1).
struct Item { int64_t row, t0, t1, kvh0, kvh1; };

}  // namespace

template <typename S>
void attention_kernel(const S* q, const S* kc, const S* vc, const int32_t* bt, const int32_t* sl, const int32_t* qsl,
                      const AttentionShape& shape, float scale, S* o) {
  Geometry g;
  g.H = shape.heads; g.D = shape.head_dim; g.BS = shape.block_size; g.KV = shape.kv_heads;
  g.G = g.H / g.KV; g.MB = shape.max_blocks;
  const bool blocked = g.D % 16 == 0;
  const int64_t tile = blocked ? std::max<int64_t>(1, MAX_QUERY_ROWS / g.G) : 1;
  // A decode token takes all its KV heads in one item, split only as far as needed to give
  // every thread two items; a prefill tile takes one KV head.
  const int64_t want = 2 * at::get_num_threads();
  const int64_t splits = std::clamp<int64_t>((want + std::max<int64_t>(shape.rows, 1) - 1) / std::max<int64_t>(shape.rows, 1),
                                             1, g.KV);
  std::vector<Item> items;
  for (int64_t r = 0; r < shape.rows; ++r) {
    if (qsl[r + 1] - qsl[r] == 1) {
      for (int64_t s = 0; s < splits; ++s)
        items.push_back({r, qsl[r], qsl[r] + 1, g.KV * s / splits, g.KV * (s + 1) / splits});
      continue;
    }
    for (int64_t t0 = qsl[r]; t0 < qsl[r + 1]; t0 += tile)
      for (int64_t kvh = 0; kvh < g.KV; ++kvh)
        items.push_back({r, t0, std::min<int64_t>(t0 + tile, qsl[r + 1]), kvh, kvh + 1});
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> work;
    std::vector<int64_t> pos;         // element offset of each position's K/V (head 0) in the caches
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      const int32_t* table = bt + it.row * g.MB;
      const int64_t first_visible = sl[it.row] - (qsl[it.row + 1] - it.t0) + 1;
      const int64_t n = first_visible + (it.t1 - it.t0) - 1;       // positions the item reads
      pos.resize(n);
      for (int64_t b = 0; b * g.BS < n; ++b) {
        const int64_t base = table[b] * g.block_stride();
        for (int64_t j = 0, p0 = b * g.BS; j < g.BS && p0 + j < n; ++j) pos[p0 + j] = base + j * g.pos_stride();
      }
      const int64_t off = it.t0 * g.H * g.D + it.kvh0 * g.G * g.D;
      if (it.t1 - it.t0 == 1)
        attend_token(q + off, kc, vc, pos.data(), first_visible, it.kvh0, it.kvh1, scale, g, o + off, work);
      else
        attend_tile(q + off, kc, vc, pos.data(), it.t1 - it.t0, first_visible, it.kvh0, scale, g, o + off, work);
    }
  });
}

template void attention_kernel<float>(const float*, const float*, const float*, const int32_t*, const int32_t*,
                                      const int32_t*, const AttentionShape&, float, float*);
template void attention_kernel<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                                              const int32_t*, const int32_t*, const int32_t*, const AttentionShape&,
                                              float, c10::BFloat16*);

}  // namespace qwen_npu_cpu
