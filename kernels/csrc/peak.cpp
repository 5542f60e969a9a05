// The CPU's compute peak: a loop of independent multiply-adds whose operands never leave the
// registers, run on every thread torch uses. No product of matrices can beat it, so it is the
// limit the benchmark's compute floors divide by (docs/benchmarks.md).
//
//   kind 0  float32 FMA, 8 lanes  (AVX2 + FMA)          2 flops per lane per instruction
//   kind 1  float32 FMA, 16 lanes (AVX-512F)            2 flops per lane per instruction
//   kind 2  bf16 dot product into 16 float32 lanes      4 flops per lane per instruction
//           (AVX512-BF16 vdpbf16ps: two products and their sum added per lane)
//   kind 3  AMX bf16 tile product: [16, 32] x [32, 16]   16384 flops per instruction
//           into a [16, 16] float32 tile (tdpbf16ps)     (the process asks Linux for the tiles)
//
// Twelve accumulators per thread: more chains than FMA units times their latency (2 x 4 cycles
// on Zen 3 and on recent Xeons), so the loop runs at the units' throughput. The AVX-512 kinds are
// compiled with a function attribute (the extension builds with AVX2 flags) and refused where the
// CPU lacks the instructions (for AMX: where Linux does not grant the tiles).
#include "amx.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <chrono>
#include <stdexcept>
#include <tuple>
#include <vector>

#if (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10) || (defined(__clang__) && __clang_major__ >= 11)
#define QN_PEAK_AVX512 1
#endif

namespace qwen_npu_cpu {
namespace {

constexpr int CHAINS = 12;

float run_avx2(int64_t iters) {
  __m256 acc[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = _mm256_set1_ps(0.001f * c);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-6f);   // acc -> 1: no denormals
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < CHAINS; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  __m256 s = acc[0];
  for (int c = 1; c < CHAINS; ++c) s = _mm256_add_ps(s, acc[c]);
  return _mm256_cvtss_f32(s);
}

#ifdef QN_PEAK_AVX512
__attribute__((target("avx512f"))) float run_avx512(int64_t iters) {
  __m512 acc[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_ps(0.001f * c);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-6f);
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  __m512 s = acc[0];
  for (int c = 1; c < CHAINS; ++c) s = _mm512_add_ps(s, acc[c]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) float run_bf16(int64_t iters) {
  __m512 acc[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_ps(0.001f * c);
  // 2^-20 in bf16 (0x3580) times 1.0 (0x3f80): each instruction adds 2 * 2^-20 per lane
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3580), b = (__m512bh)_mm512_set1_epi16(0x3f80);
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  __m512 s = acc[0];
  for (int c = 1; c < CHAINS; ++c) s = _mm512_add_ps(s, acc[c]);
  return _mm512_reduce_add_ps(s);
}
#endif

#ifdef QN_AMX_TILES
QN_AMX float run_amx(int64_t iters) {
  amx::load_full_tiles(6);
  alignas(64) uint16_t ab[16 * 32];
  for (int i = 0; i < 16 * 32; ++i) ab[i] = 0x3580;                      // 2^-20: no overflow
  alignas(64) float out[16 * 16];
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, ab, 64);
  _tile_loadd(5, ab, 64);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 5);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 5);
  }
  float sum = 0.0f;
  for (int t = 0; t < 4; ++t) {
    switch (t) {                    // tile numbers are immediates
      case 0: _tile_stored(0, out, 64); break;
      case 1: _tile_stored(1, out, 64); break;
      case 2: _tile_stored(2, out, 64); break;
      default: _tile_stored(3, out, 64); break;
    }
    sum += out[0];
  }
  _tile_release();
  return sum;
}
#endif

}  // namespace

bool peak_has_amx() {
#ifdef QN_AMX_TILES
  return amx::granted();
#else
  return false;
#endif
}

bool peak_has_avx512() {
#ifdef QN_PEAK_AVX512
  return true;
#else
  return false;
#endif
}

// (GFLOP/s over every thread, a sum of the accumulators that keeps the loop alive) for ``kind``
// (above), each thread running ``iters`` iterations (CHAINS instructions; four tile products).
std::tuple<double, double> fma_peak(int64_t kind, int64_t iters) {
  if (kind < 0 || kind > 3)
    throw std::invalid_argument("fma_peak: kind must be 0 (avx2), 1 (avx512), 2 (avx512 bf16) or 3 (amx bf16)");
  if (iters <= 0) throw std::invalid_argument("fma_peak: iters must be positive");
#ifndef QN_PEAK_AVX512
  if (kind == 1 || kind == 2) throw std::invalid_argument("fma_peak: this build has no AVX-512 loops (compiler too old)");
#else
  if (kind == 1 && !__builtin_cpu_supports("avx512f"))
    throw std::invalid_argument("fma_peak: this CPU has no AVX-512F");
  if (kind == 2 && !__builtin_cpu_supports("avx512bf16"))
    throw std::invalid_argument("fma_peak: this CPU has no AVX512-BF16");
#endif
  if (kind == 3 && !peak_has_amx()) throw std::invalid_argument("fma_peak: no AMX tiles in this build or process");
  const int64_t threads = at::get_num_threads();
  std::vector<double> sums(threads, 0.0);
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (kind == 0) sums[t] = run_avx2(iters);
#ifdef QN_PEAK_AVX512
      if (kind == 1) sums[t] = run_avx512(iters);
      if (kind == 2) sums[t] = run_bf16(iters);
#endif
#ifdef QN_AMX_TILES
      if (kind == 3) sums[t] = run_amx(iters);
#endif
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double per_iter = kind == 0 ? 16.0 * CHAINS : kind == 1 ? 32.0 * CHAINS : kind == 2 ? 64.0 * CHAINS
                                                                                 : 4 * 16384.0;
  double sum = 0.0;
  for (double s : sums) sum += s;
  const double flops = per_iter * static_cast<double>(iters) * static_cast<double>(threads);
  return {flops / seconds / 1e9, sum};
}

}  // namespace qwen_npu_cpu
