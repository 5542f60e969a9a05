// The decode token of attention_decode.cpp on a CPU with AMX tiles: the scores on the tiles, the
// rest in fp32 on 16 AVX-512 lanes. One token, the heads of KV heads [kvh0, kvh1), all n visible
// positions, read once each, 16 positions at a time in the order they lie in the cache:
//
//   scores    S^T = K Q^T per KV head: the A tile is 16 positions x 32 values of D straight from
//             the cache (the positions of one block lie a fixed stride apart; positions that do
//             not, and the last part-filled 16, are first copied into a zero-padded tile), the B
//             tile the KV head's query heads as bf16 pairs along D (one column per head: the B
//             and C tiles are G columns wide), summed over D / 32 tile products into one fp32
//             tile; times the scale.
//   softmax   fp32 over the whole context, 16 lanes (vec.h's exp, step for step).
//   P V       fp32: each V value widened exactly (the even element of a pair shifted up, the odd
//             one masked), times the fp32 weight, summed in position order into accumulators
//             that hold a head's even and odd elements apart; normalised by the fp32 sum at the
//             end.
//
// Products of two bf16 values are exact in fp32 and every sum is fp32; what differs from the fp32
// kernel is the order of the sums along D (the tiles'), so the result is within the bf16
// tolerance of the reference; P is never rounded. Why not AVX512-BF16 dot products: on the
// Xeons that have AMX they issue at a quarter of the rate of fp32 FMAs, and the tile takes a
// block's 16 scores in a few instructions. What is read, the masking and NaN propagation (a NaN
// score leaves the max and reaches the output) are those of the fp32 kernel; no position past n is
// read. K is not prefetched: the tiles' 16-row loads stream it on their own, and prefetching it
// made the scores slower; V, read by vector loads, is prefetched PF_AHEAD positions ahead.
// attention.cpp calls it only where the caller asked for the tiles (``amx``).
#include "amx.h"
#include "attention.h"
#include "vec512.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace qwen_npu_cpu {

#if defined(QN_AMX_TILES) && defined(QN_BF16_DOT)
namespace {

using vec512::exp16;

constexpr int64_t MAX_D = 256;        // head_dim this kernel takes (a multiple of 32)
constexpr int64_t MAX_G = 16;         // query heads per KV head: the B tile's columns
constexpr int64_t PV_CHUNK = 32;      // positions per pass of the P V accumulators
constexpr int64_t PF_AHEAD = 16;      // positions ahead of the reads that are prefetched

// out_h[d] (+)= sum_p w_h[p] v_p[d] over positions [p0, p1) for HEADS (1 or 2) heads (weights
// ld_w apart; accumulators D apart, each 32 values of D as 16 even then 16 odd elements), d in
// [d0, d0 + 128) or less.
template <int HEADS>
QN_AVX512 void weigh_block(const float* w, int64_t ld_w, const c10::BFloat16* vc, const int64_t* pos, int64_t p0,
                           int64_t p1, int64_t kvh, const Geometry& g, int64_t d0, float* out, bool accumulate) {
  const int nb = static_cast<int>(std::min<int64_t>(128, g.D - d0) / 32);   // 32 values of d each
  const __m512i odd = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 even_acc[HEADS][4], odd_acc[HEADS][4];
  for (int h = 0; h < HEADS; ++h)
    for (int j = 0; j < 4; ++j) {
      const bool load = accumulate && j < nb;
      even_acc[h][j] = load ? _mm512_loadu_ps(out + h * g.D + d0 + j * 32) : _mm512_setzero_ps();
      odd_acc[h][j] = load ? _mm512_loadu_ps(out + h * g.D + d0 + j * 32 + 16) : _mm512_setzero_ps();
    }
  for (int64_t p = p0; p < p1; ++p) {
    const auto* v = reinterpret_cast<const __m512i*>(kv_row(vc, pos, p, kvh, g) + d0);
    __m512 wv[HEADS];
    for (int h = 0; h < HEADS; ++h) wv[h] = _mm512_set1_ps(w[h * ld_w + p]);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      if (j >= nb) break;
      const __m512i x = _mm512_loadu_si512(v + j);
      const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(x, odd));
      for (int h = 0; h < HEADS; ++h) {
        even_acc[h][j] = _mm512_fmadd_ps(wv[h], e, even_acc[h][j]);
        odd_acc[h][j] = _mm512_fmadd_ps(wv[h], o, odd_acc[h][j]);
      }
    }
  }
  for (int h = 0; h < HEADS; ++h)
    for (int j = 0; j < nb; ++j) {
      _mm512_storeu_ps(out + h * g.D + d0 + j * 32, even_acc[h][j]);
      _mm512_storeu_ps(out + h * g.D + d0 + j * 32 + 16, odd_acc[h][j]);
    }
}

// The 16 positions from p0 as an A tile of KV head kvh: (address, row stride in bytes), straight
// from the cache where they lie a fixed stride apart, else copied into ``tile`` (rows past n zero).
inline std::pair<const uint16_t*, int64_t> key_rows(const c10::BFloat16* kc, const int64_t* pos, int64_t p0, int64_t n,
                                                    int64_t kvh, const Geometry& g, bool strided, uint16_t* tile) {
  if (strided) return {reinterpret_cast<const uint16_t*>(kv_row(kc, pos, p0, kvh, g)), g.pos_stride() * 2};
  for (int64_t i = 0; i < 16; ++i) {
    if (p0 + i < n)
      std::memcpy(tile + i * g.D, kv_row(kc, pos, p0 + i, kvh, g), g.D * 2);
    else
      std::memset(tile + i * g.D, 0, g.D * 2);
  }
  return {tile, g.D * 2};
}

QN_AMX void token(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* pos,
                  int64_t n, int64_t kvh0, int64_t kvh1, float scale, const Geometry& g, c10::BFloat16* out) {
  const int64_t G = g.G, D = g.D, NK = kvh1 - kvh0, NH = NK * G, chunks = D / 32;
  const int64_t np = (n + 15) / 16 * 16;                 // scores per head, padded to whole vectors
  thread_local std::vector<float> scores, acc, total;
  thread_local std::vector<uint32_t> qb;
  thread_local std::vector<uint16_t> tile;
  scores.resize(NH * np);           // past n: never read unmasked
  acc.resize(NH * D);
  total.resize(NH);
  tile.resize(16 * MAX_D);
  // the query heads of each KV head as B tiles of G columns: [KV head][chunk of 32 values of D][pair][head]
  qb.resize(NK * chunks * 16 * G);
  for (int64_t k = 0; k < NK; ++k)
    for (int64_t h = 0; h < G; ++h) {
      const auto* pairs = reinterpret_cast<const uint32_t*>(q + (k * G + h) * D);
      for (int64_t i = 0; i < D / 2; ++i) qb[((k * chunks + i / 16) * 16 + i % 16) * G + h] = pairs[i];
    }
  amx::TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = 16;
  cfg.colsb[0] = cfg.colsb[2] = static_cast<uint16_t>(4 * G);     // C, B: G columns of fp32 / of bf16 pairs
  cfg.colsb[1] = 64;                                               // A: 32 values of D
  _tile_loadconfig(&cfg);
  alignas(64) float st[16 * 16];                         // S^T of 16 positions: [position][head]
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t p0 = 0; p0 < n; p0 += 16) {
    bool strided = p0 + 16 <= n;
    for (int64_t i = 1; i < 16 && strided; ++i) strided = pos[p0 + i] == pos[p0] + i * g.pos_stride();
    for (int64_t k = 0; k < NK; ++k) {
      const auto [a, lda] = key_rows(kc, pos, p0, n, kvh0 + k, g, strided, tile.data());
      _tile_zero(0);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(1, a + c * 32, lda);
        _tile_loadd(2, qb.data() + (k * chunks + c) * 16 * G, 4 * G);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, st, 64);
      for (int64_t h = 0; h < G; ++h)
        _mm512_storeu_ps(scores.data() + (k * G + h) * np + p0,
                         _mm512_mul_ps(_mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int>(h))),
                                                           st, 4), vscale));
    }
  }
  _tile_release();
  // softmax numerators in place, fp32; positions past n weigh 0
  for (int64_t h = 0; h < NH; ++h) {
    float* s = scores.data() + h * np;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t p = 0; p < np; p += 16)
      mx = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), vec512::first(n - p), s + p), mx);
    const __m512 vmx = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p += 16) {
      const __m512 e = _mm512_maskz_mov_ps(vec512::first(n - p), exp16(_mm512_sub_ps(_mm512_loadu_ps(s + p), vmx)));
      sum = _mm512_add_ps(sum, e);
      _mm512_storeu_ps(s + p, e);
    }
    total[h] = _mm512_reduce_add_ps(sum);
  }
  // P V: a chunk of positions at a time, every KV head of the item before the next chunk
  for (int64_t c0 = 0; c0 < n; c0 += PV_CHUNK) {
    const int64_t c1 = std::min(n, c0 + PV_CHUNK);
    prefetch_rows(vc, pos, std::min(n, c0 + PF_AHEAD), std::min(n, c0 + PF_AHEAD + PV_CHUNK), kvh0, kvh1, g);
    for (int64_t k = 0; k < NK; ++k) {
      int64_t h = 0;
      for (; h + 2 <= G; h += 2)
        for (int64_t d0 = 0; d0 < D; d0 += 128)
          weigh_block<2>(scores.data() + (k * G + h) * np, np, vc, pos, c0, c1, kvh0 + k, g, d0,
                         acc.data() + (k * G + h) * D, c0 > 0);
      for (; h < G; ++h)
        for (int64_t d0 = 0; d0 < D; d0 += 128)
          weigh_block<1>(scores.data() + (k * G + h) * np, np, vc, pos, c0, c1, kvh0 + k, g, d0,
                         acc.data() + (k * G + h) * D, c0 > 0);
    }
  }
  for (int64_t h = 0; h < NH; ++h) {
    const float inv = 1.0f / total[h];
    const float* a = acc.data() + h * D;
    for (int64_t d = 0; d < D; d += 32)
      for (int64_t i = 0; i < 16; ++i) {
        out[h * D + d + 2 * i] = static_cast<c10::BFloat16>(a[d + i] * inv);
        out[h * D + d + 2 * i + 1] = static_cast<c10::BFloat16>(a[d + 16 + i] * inv);
      }
  }
}

}  // namespace

bool attend_token_amx(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* pos,
                      int64_t n, int64_t kvh0, int64_t kvh1, float scale, const Geometry& g, c10::BFloat16* out) {
  if (g.D % 32 || g.D > MAX_D || g.G > MAX_G || n < 1 || !amx::granted()) return false;
  token(q, kc, vc, pos, n, kvh0, kvh1, scale, g, out);
  return true;
}

#else

bool attend_token_amx(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, const int64_t*, int64_t,
                      int64_t, int64_t, float, const Geometry&, c10::BFloat16*) {
  return false;
}

#endif

}  // namespace qwen_npu_cpu
