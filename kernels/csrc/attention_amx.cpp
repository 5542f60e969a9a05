// The prefill rows of attention.cpp on AMX tiles: every token of one row against one KV head,
// flash-style over blocks of 64 positions, the products on the tiles and the softmax in fp32:
//
//   packing   once per (row, KV head), so that every group of queries reads them as tiles: K as
//             B tiles of 16 positions, the pairs of values along D as rows (K^T in the tiles'
//             pair layout), and V as B tiles of 16 pairs of positions x 16 values of D.
//   groups    16 query rows at a time (token-major, then the KV head's query heads), each
//             copied into an A tile's rows.
//   scores    S = Q K^T for 64 positions: four [16 x 16] fp32 tiles, summed over D / 32 tile
//             products; times the scale; positions a query does not see are -inf.
//   softmax   online, per query row: the running max and sum in fp32, the weights P rounded to
//             bf16 for P V (as the bf16 prefill tile does); when a row's max rises, its
//             accumulated output is rescaled first.
//   P V       the output accumulators [16 x D] fp32 in memory, loaded into a tile, added to with
//             the block's two [16 x 32] P tiles times V, stored back.
//
// Blocks past the group's last visible position are never computed; a query's bits do not depend
// on which other queries share its group (a block wholly masked for it adds exactly nothing).
// Within the bf16 tolerance of the reference; what is read is what the other prefill tiles read:
// positions up to the last token's context, a K that is NaN reaching exactly the queries that see
// it (a NaN in V reaches the group's queries through the tile product even where their weight is
// zero, as in the other tiles' products). attention.cpp calls it only where the caller asked for
// the tiles (``amx``).
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

constexpr int64_t MAX_D = 256;     // head_dim this kernel takes (a multiple of 32)
constexpr int64_t BLOCK = 64;      // positions per step of the flash loop: 4 score tiles, 2 P tiles
constexpr int64_t GROUP = 16;      // query rows per group: the tiles' rows

struct Packed {
  std::vector<uint32_t> kt;        // [n / 16][D / 32][16 pairs][16 positions] (bf16 pairs along D)
  std::vector<uint32_t> vv;        // [n / 32][D / 16][16 pairs of positions][16 values of D]
};

// r[i][j] <- r[j][i] for a 16 x 16 matrix of 32-bit values, one row per vector.
QN_AVX512 inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {            // lane L of u[g + m]: rows g .. g + 3 of column 4 L + m
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i x01 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), x23 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
    const __m512i y01 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
    const __m512i y23 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_shuffle_i32x4(x01, y01, 0x88);
    r[4 + m] = _mm512_shuffle_i32x4(x01, y01, 0xDD);
    r[8 + m] = _mm512_shuffle_i32x4(x23, y23, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(x23, y23, 0xDD);
  }
}

// K^T and V of positions [0, n) of KV head kvh in the tiles' pair layouts (positions past n zero).
QN_AVX512 void pack(const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* pos, int64_t n, int64_t kvh,
                    const Geometry& g, Packed& p) {
  const int64_t D = g.D, chunks = D / 32, dblocks = D / 16, padded = (n + BLOCK - 1) / BLOCK * BLOCK;
  p.kt.resize(padded * D / 2);
  p.vv.resize(padded * D / 2);
  const auto row = [&](const c10::BFloat16* cache, int64_t t) {
    return t < n ? reinterpret_cast<const uint16_t*>(kv_row(cache, pos, t, kvh, g)) : nullptr;
  };
  for (int64_t b = 0; b < padded; b += 16)     // K^T: per 16 positions and 32 values of D, a transpose
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        const uint16_t* k = row(kc, b + i);
        r[i] = k != nullptr ? _mm512_loadu_si512(k + c * 32) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint32_t* dst = p.kt.data() + ((b / 16) * chunks + c) * 256;
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 16, r[i]);
    }
  // V: per pair of positions and 32 values of D, the two rows interleaved into pairs
  for (int64_t t = 0; t < padded; t += 2) {
    const uint16_t *a = row(vc, t), *b = row(vc, t + 1);
    uint32_t* dst = p.vv.data() + (t / 32) * dblocks * 256 + ((t % 32) / 2) * 16;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i va = a != nullptr ? _mm512_loadu_si512(a + c * 32) : _mm512_setzero_si512();
      const __m512i vb = b != nullptr ? _mm512_loadu_si512(b + c * 32) : _mm512_setzero_si512();
      __m512i lo, hi;
      vec512::interleave_pairs(va, vb, lo, hi);
      _mm512_storeu_si512(dst + (2 * c) * 256, lo);
      _mm512_storeu_si512(dst + (2 * c + 1) * 256, hi);
    }
  }
}

// Tile C (+)= the P tiles (6, 7) times the V tiles at v0 and v1, through B tile B (a macro: the
// tile intrinsics take their tile numbers as literals).
#define QN_WEIGH_TILE(C, B, acc, ld, v0, v1) \
  do {                                     \
    _tile_loadd(C, acc, ld);               \
    _tile_loadd(B, v0, 64);                \
    _tile_dpbf16ps(C, 6, B);               \
    _tile_loadd(B, v1, 64);                \
    _tile_dpbf16ps(C, 7, B);               \
  } while (0)

// One group: query rows [r0, r0 + rows) of the item (row r = token r / G, head r % G of the KV
// head), token t seeing positions [0, first_visible + t).
QN_AMX void group(const c10::BFloat16* q, int64_t r0, int64_t rows, int64_t first_visible, float scale,
                  const Geometry& g, const Packed& pk, c10::BFloat16* out) {
  const int64_t G = g.G, D = g.D, chunks = D / 32, dblocks = D / 16, HD = g.H * g.D;
  alignas(64) uint16_t qa[GROUP * MAX_D];            // A tiles: the group's query rows
  alignas(64) float acc[GROUP * MAX_D];              // [row][D] fp32 output accumulators
  alignas(64) float s[4][GROUP * 16];                // the block's score tiles
  alignas(64) uint16_t pa[2][GROUP * 32];            // the block's P tiles (bf16)
  alignas(64) float sum[GROUP * 16];                 // per row, 16 lanes of partial sums
  float mx[GROUP];
  int64_t lim[GROUP];
  std::memset(qa, 0, sizeof(qa));
  std::memset(acc, 0, GROUP * D * sizeof(float));
  for (int64_t l = 0; l < GROUP; ++l) {
    mx[l] = -INFINITY;
    _mm512_store_ps(sum + l * 16, _mm512_setzero_ps());
    lim[l] = first_visible;                          // rows past the group: position 0 only (never stored)
    if (l < rows) {
      const int64_t r = r0 + l;
      lim[l] = first_visible + r / G;
      std::memcpy(qa + l * D, q + (r / G) * HD + (r % G) * D, D * 2);
    }
  }
  const int64_t last = lim[rows - 1];                // positions the group's last row sees
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t b0 = 0; b0 < last; b0 += BLOCK) {
    // S = Q K^T, four tiles of 16 positions
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const uint32_t* kt = pk.kt.data() + (b0 / 16) * chunks * 256;
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(4, qa + c * 32, D * 2);
      _tile_loadd(5, kt + c * 256, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, kt + (chunks + c) * 256, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, kt + (2 * chunks + c) * 256, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, kt + (3 * chunks + c) * 256, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, s[0], 64); _tile_stored(1, s[1], 64); _tile_stored(2, s[2], 64); _tile_stored(3, s[3], 64);
    // online softmax per row
    for (int64_t l = 0; l < GROUP; ++l) {
      if (lim[l] <= b0) {                            // the whole block is past this row's context
        std::memset(pa[0] + l * 32, 0, 64);
        std::memset(pa[1] + l * 32, 0, 64);
        continue;
      }
      __m512 v[4];
      __m512 bm = _mm512_set1_ps(-INFINITY);
      const bool whole = b0 + BLOCK <= lim[l];      // every position of the block seen
      for (int j = 0; j < 4; ++j) {
        const __mmask16 seen =
            whole ? static_cast<__mmask16>(0xFFFF)
                  : _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(b0 + 16 * j))),
                                            _mm512_set1_epi32(static_cast<int>(lim[l])));
        v[j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), seen, _mm512_loadu_ps(s[j] + l * 16), vscale);
        bm = _mm512_max_ps(v[j], bm);
      }
      const float m = std::max(mx[l], _mm512_reduce_max_ps(bm));
      if (m > mx[l]) {                               // the row's max rose: rescale what it has so far
        const __m512 alpha = _mm512_set1_ps(std::exp(mx[l] - m));
        _mm512_store_ps(sum + l * 16, _mm512_mul_ps(alpha, _mm512_load_ps(sum + l * 16)));
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_ps(acc + l * D + d, _mm512_mul_ps(alpha, _mm512_loadu_ps(acc + l * D + d)));
        mx[l] = m;
      }
      const __m512 vm = _mm512_set1_ps(mx[l]);
      __m512 e[4];
      for (int j = 0; j < 4; ++j) e[j] = exp16(_mm512_sub_ps(v[j], vm));
      _mm512_store_ps(sum + l * 16, _mm512_add_ps(_mm512_load_ps(sum + l * 16),
                                                  _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3]))));
      _mm512_storeu_si512(pa[0] + l * 32, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
      _mm512_storeu_si512(pa[1] + l * 32, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
    }
    // acc += P V, 16 values of D at a time
    _tile_loadd(6, pa[0], 64);
    _tile_loadd(7, pa[1], 64);
    const uint32_t* vv = pk.vv.data() + (b0 / 32) * dblocks * 256;
    const auto v0 = [&](int64_t j) { return vv + j * 256; };               // positions b0 .. b0 + 31
    const auto v1 = [&](int64_t j) { return vv + (dblocks + j) * 256; };   // b0 + 32 .. b0 + 63
    for (int64_t j = 0; j < dblocks; j += 4) {      // four accumulator tiles in flight
      const int64_t k = std::min<int64_t>(4, dblocks - j);
      QN_WEIGH_TILE(0, 4, acc + j * 16, D * 4, v0(j), v1(j));
      if (k > 1) QN_WEIGH_TILE(1, 5, acc + (j + 1) * 16, D * 4, v0(j + 1), v1(j + 1));
      if (k > 2) QN_WEIGH_TILE(2, 4, acc + (j + 2) * 16, D * 4, v0(j + 2), v1(j + 2));
      if (k > 3) QN_WEIGH_TILE(3, 5, acc + (j + 3) * 16, D * 4, v0(j + 3), v1(j + 3));
      _tile_stored(0, acc + j * 16, D * 4);
      if (k > 1) _tile_stored(1, acc + (j + 1) * 16, D * 4);
      if (k > 2) _tile_stored(2, acc + (j + 2) * 16, D * 4);
      if (k > 3) _tile_stored(3, acc + (j + 3) * 16, D * 4);
    }
  }
  for (int64_t l = 0; l < rows; ++l) {
    const int64_t r = r0 + l;
    const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(sum + l * 16));
    c10::BFloat16* o = out + (r / G) * HD + (r % G) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<c10::BFloat16>(acc[l * D + d] * inv);
  }
}

QN_AMX void row(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* pos,
                int64_t T, int64_t first_visible, int64_t kvh, float scale, const Geometry& g, c10::BFloat16* out) {
  thread_local Packed pk;
  pack(kc, vc, pos, first_visible + T - 1, kvh, g, pk);
  amx::load_full_tiles(8);
  const int64_t rows = T * g.G;
  for (int64_t r0 = 0; r0 < rows; r0 += GROUP)
    group(q, r0, std::min(GROUP, rows - r0), first_visible, scale, g, pk, out);
  _tile_release();
}

}  // namespace

bool amx_rows_take(const c10::BFloat16*, const Geometry& g) {
  return g.D % 32 == 0 && g.D <= MAX_D && amx::granted();
}

void attend_row_amx(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* pos,
                    int64_t T, int64_t first_visible, int64_t kvh, float scale, const Geometry& g,
                    c10::BFloat16* out) {
  row(q, kc, vc, pos, T, first_visible, kvh, scale, g, out);
}

#else

bool amx_rows_take(const c10::BFloat16*, const Geometry&) { return false; }
void attend_row_amx(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, const int64_t*, int64_t,
                    int64_t, int64_t, float, const Geometry&, c10::BFloat16*) {}

#endif

}  // namespace qwen_npu_cpu
