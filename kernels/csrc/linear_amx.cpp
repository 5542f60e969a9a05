// The decode-shaped bf16 product (up to 16 rows of x) on AMX tiles, straight from the weights
// oneDNN reordered at load (kernels/onednn.py), so a Session keeps one copy of its matrices:
//
//   oneDNN's blocked layout for them: 32 output columns at a time, and within such a block the K
//   values in pairs, [N / 32][K / 2][32][2] (bf16). A [32 pairs x 16 columns] half of a block is
//   exactly an AMX B tile (16 rows of 64 bytes, 128 bytes apart), x rows are the A tile as they
//   lie, and two [rows x 16] fp32 accumulators take the block's 32 columns.
//
// Each output block streams its 32 columns' weights once, in memory order; the tiles do the
// products in K order, as oneDNN's tile kernel does unless it splits K across threads, and the
// sums are rounded to bf16 with the same instruction, so the result is the bits oneDNN gives
// (kernels/cpu.py checks that on each weight's first product at a thread count, and keeps oneDNN
// for a weight where they differ). The caller passes the address of a weight reordered so.
// Compiled with function attributes; called only where the CPU has AMX bf16 and Linux granted
// the tile state.
//
// The LM head's form (linear_amx_logits_kernel) stores the same bf16 values widened to fp32 into
// the logits and scans each block's rows as they are stored (greedy.h): greedy sampling and the
// health check then need no second read of the logits. The gate|up form (linear_amx_silu_kernel)
// puts each gate block and its up block through SiLU-mul as they are made.
#include "amx.h"
#include "greedy.h"
#include "vec512.h"
#include <ATen/Parallel.h>
#include <cstring>

namespace qwen_npu_cpu {

#ifdef QN_AMX_TILES
namespace {

// The tiles as every product here uses them: C0, C1 the M x 16 fp32 sums of a block's two halves,
// A (2) M rows x 32 bf16 of x, B (3, 4) 16 pairs x 16 columns of weights.
QN_AMX void configure(int64_t M) {
  amx::TileConfig cfg{};
  cfg.palette = 1;
  const auto m = static_cast<uint8_t>(M);
  cfg.rows[0] = cfg.rows[1] = m; cfg.colsb[0] = cfg.colsb[1] = 64;
  cfg.rows[2] = m; cfg.colsb[2] = 64;
  cfg.rows[3] = cfg.rows[4] = 16; cfg.colsb[3] = cfg.colsb[4] = 64;
  _tile_loadconfig(&cfg);
}

// The fp32 sums of one block of 32 columns (its [K / 2][32][2] weights at ``block``) for the M
// rows of x, in K order: columns 0-15 into c[0], 16-31 into c[1], rows 16 floats apart.
QN_AMX void block_sums(const uint16_t* x, int64_t K, const uint16_t* block, float (*c)[16 * 16]) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(2, x + k, K * 2);
    _tile_loadd(3, block + k * 32, 128);                                // pairs k/2 .. k/2 + 15, columns 0-15
    _tile_loadd(4, block + k * 32 + 32, 128);                           // columns 16-31
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
}

// 16 sums rounded to bf16 with oneDNN's instruction, widened back to fp32.
QN_AMX inline __m512 rounded(const float* sums) {
  const __m256i bf = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf), 16));
}

// Output blocks [b0, b1) of 32 columns: y[:, 32 b .. 32 b + 32) for M <= 16 rows of x, as bf16
// (y), or as the bf16 values widened to fp32 (logits, each row's blocks scanned into scans[row]).
QN_AMX void blocks(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, int64_t b0, int64_t b1,
                   c10::BFloat16* y, float* logits = nullptr, greedy::Scan* scans = nullptr) {
  configure(M);
  alignas(64) float c[2][16 * 16];
  for (int64_t b = b0; b < b1; ++b) {
    block_sums(x, K, w + b * 32 * K, c);
    for (int64_t r = 0; r < M; ++r) {
      if (logits == nullptr) {
        for (int h = 0; h < 2; ++h)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + b * 32 + h * 16),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c[h] + r * 16)));
        continue;
      }
      float* out = logits + r * N + b * 32;
      for (int h = 0; h < 2; ++h) _mm512_storeu_ps(out + h * 16, rounded(c[h] + r * 16));
      greedy::scan(scans[r], out, 32, b * 32);
    }
  }
  _tile_release();
}

// The gate|up product with SiLU-mul on its output: blocks [b0, b1) of 32 columns of act [M, I],
// from gate block b and up block b + I / 32 of the [2 I] weights, each rounded to bf16 as the
// product stores it and then put through silu_mul's steps (vec512::act16): the bits of
// silu_mul(linear(x, w)), without writing or reading the [M, 2 I] product.
QN_AMX void silu_blocks(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t I, int64_t b0, int64_t b1,
                        c10::BFloat16* act) {
  configure(M);
  alignas(64) float gate[2][16 * 16], up[2][16 * 16];
  for (int64_t b = b0; b < b1; ++b) {
    block_sums(x, K, w + b * 32 * K, gate);
    block_sums(x, K, w + (b + I / 32) * 32 * K, up);
    for (int64_t r = 0; r < M; ++r)
      for (int h = 0; h < 2; ++h)
        vec512::store16(act + r * I + b * 32 + h * 16,
                        vec512::act16(rounded(gate[h] + r * 16), rounded(up[h] + r * 16)));
  }
  _tile_release();
}

}  // namespace

bool linear_amx_available() { return amx::granted(); }

bool linear_amx_kernel(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, c10::BFloat16* y) {
  if (M < 1 || M > 16 || K % 32 != 0 || N % 32 != 0 || !linear_amx_available()) return false;
  at::parallel_for(0, N / 32, 1, [&](int64_t b0, int64_t b1) { blocks(x, M, K, w, N, b0, b1, y); });
  return true;
}

bool linear_amx_silu_kernel(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, c10::BFloat16* act) {
  if (M < 1 || M > 16 || K % 32 != 0 || N % 64 != 0 || !linear_amx_available()) return false;
  const int64_t I = N / 2;
  at::parallel_for(0, I / 32, 1, [&](int64_t b0, int64_t b1) { silu_blocks(x, M, K, w, I, b0, b1, act); });
  return true;
}

bool linear_amx_logits_kernel(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* logits,
                              int64_t* ids, int64_t* codes) {
  if (M < 1 || M > 16 || K % 32 != 0 || N % 32 != 0 || !linear_amx_available()) return false;
  greedy::in_runs(N / 32, M, [&](int64_t b0, int64_t b1, greedy::Scan* scans) {
    blocks(x, M, K, w, N, b0, b1, nullptr, logits, scans);
  }, ids, codes);
  return true;
}

#else

bool linear_amx_available() { return false; }
bool linear_amx_kernel(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, c10::BFloat16*) { return false; }
bool linear_amx_silu_kernel(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, c10::BFloat16*) {
  return false;
}
bool linear_amx_logits_kernel(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, float*, int64_t*, int64_t*) {
  return false;
}

#endif

}  // namespace qwen_npu_cpu
