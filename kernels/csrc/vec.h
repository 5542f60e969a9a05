// Shared AVX2 + FMA building blocks of the cpu kernels: widening loads, reductions, exp, and the
// register-tiled multiply that both linear and attention are built on.
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cstdint>
#include <tuple>

// Compilers that take the avx512bf16 target attribute build the native bf16 kernels
// (linear_bf16.cpp, attention_bf16.cpp); with an older one those report themselves absent.
#if (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10) || (defined(__clang__) && __clang_major__ >= 11)
#define QN_BF16_DOT 1
#endif

namespace qwen_npu_cpu {

// ---- loads that widen to fp32 -----------------------------------------------------------------
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));      // 8 x bf16
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// The largest of the 8 lanes (none NaN).
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp for x <= 0 (scores minus their max): 2^n * p(r), |relative error| < 2e-7; -inf -> 0;
// NaN -> NaN, as the reference softmax gives it (a NaN key or query must show, not vanish).
// The constants are shared with the 16-lane version in attention_bf16.cpp (same steps, same bits).
namespace exp_neg_c {
constexpr float LO = -87.0f;                                      // below: exactly 0
constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;  // ln 2 = LN2_HI + LN2_LO
constexpr float P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                        4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_neg_c

inline __m256 exp_neg(__m256 x) {
  using namespace exp_neg_c;
  const __m256 lo = _mm256_set1_ps(LO);
  x = _mm256_max_ps(lo, x);            // operand order: max_ps returns its 2nd operand for a NaN
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(P[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_and_ps(out, _mm256_cmp_ps(x, lo, _CMP_NLE_UQ));  // underflow -> exactly 0; NaN kept
}

// 16 bf16 weights of one k of a panel (kernels/panels.py: columns in the order 0-3 8-11 4-7
// 12-15) -> fp32 columns 0-7 and 8-15. A bf16 is the top half of its fp32, so interleaving with
// zeros within each 128-bit lane widens it exactly.
inline void widen_panel_k(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}

// ---- the register tile ------------------------------------------------------------------------
// The sums sum_k x[i][k] * b[k][0..16) for MR (<= 6) rows of x, x[i][k] at
// x[i * ldx + k * SX] (SX = 1: row-major rows; SX = MR: a packed group): each x value is
// broadcast against 16 columns of b. The accumulators are named variables, not an array, so
// that they stay in registers; the rows a smaller tile does not use are compiled away.
#define QN_ACC(i) __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps();
#define QN_FMA(i)                                                                          \
  if constexpr (MR > i) {                                                                    \
    const __m256 a = _mm256_broadcast_ss(x + i * ldx + k * SX);                              \
    c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);                                               \
    c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);                                               \
  }
#define QN_OUT(i) \
  if constexpr (MR > i) out(i, c##i##0, c##i##1);
// ... and each row's two halves of sums handed to out(i, columns 0-7, columns 8-15).
template <int MR, int SX = 1, typename Out>
inline void tile16_sums(const float* x, int64_t ldx, const float* b, int64_t ldb, int64_t kc, Out&& out) {
  static_assert(MR >= 1 && MR <= 6, "tile shape");
  QN_ACC(0) QN_ACC(1) QN_ACC(2) QN_ACC(3) QN_ACC(4) QN_ACC(5)
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8);
    QN_FMA(0) QN_FMA(1) QN_FMA(2) QN_FMA(3) QN_FMA(4) QN_FMA(5)
  }
  QN_OUT(0) QN_OUT(1) QN_OUT(2) QN_OUT(3) QN_OUT(4) QN_OUT(5)
}
// The sums stored into y (rows ldy apart), added to what y holds when accumulate is set.
template <int MR, int SX = 1>
inline void tile16(const float* x, int64_t ldx, const float* b, int64_t ldb, int64_t kc, float* y, int64_t ldy,
                   bool accumulate) {
  tile16_sums<MR, SX>(x, ldx, b, ldb, kc, [&](int i, __m256 lo, __m256 hi) {
    float* yi = y + i * ldy;
    if (accumulate) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(yi));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(yi + 8));
    }
    _mm256_storeu_ps(yi, lo);
    _mm256_storeu_ps(yi + 8, hi);
  });
}
#undef QN_ACC
#undef QN_FMA
#undef QN_OUT

// All M rows of x against one 16-column block of b, 6 rows at a time.
inline void rows16(const float* x, int64_t ldx, int64_t M, const float* b, int64_t ldb, int64_t kc, float* y,
                   int64_t ldy, bool accumulate) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) tile16<6>(x + m * ldx, ldx, b, ldb, kc, y + m * ldy, ldy, accumulate);
  switch (M - m) {
    case 5: tile16<5>(x + m * ldx, ldx, b, ldb, kc, y + m * ldy, ldy, accumulate); break;
    case 4: tile16<4>(x + m * ldx, ldx, b, ldb, kc, y + m * ldy, ldy, accumulate); break;
    case 3: tile16<3>(x + m * ldx, ldx, b, ldb, kc, y + m * ldy, ldy, accumulate); break;
    case 2: tile16<2>(x + m * ldx, ldx, b, ldb, kc, y + m * ldy, ldy, accumulate); break;
    case 1: tile16<1>(x + m * ldx, ldx, b, ldb, kc, y + m * ldy, ldy, accumulate); break;
    default: break;
  }
}

// buf[k][r] = rows[r][k0 + k] as fp32, for 16 rows and kc (a multiple of 8) columns: the
// transpose that turns 16 rows of a row-major matrix into a 16-column block for tile16.
template <typename W>
inline void pack16(const W* const* rows, int64_t k0, int64_t kc, float* buf, int64_t prefetch) {
  for (int64_t k = 0; k < kc; k += 8) {
    for (int r0 = 0; r0 < 16; r0 += 8) {
      if (prefetch && (k % 32) == 0)
        for (int r = 0; r < 8; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(rows[r0 + r] + k0 + k + prefetch), _MM_HINT_T0);
      __m256 v[8];
      for (int r = 0; r < 8; ++r) v[r] = load8(rows[r0 + r] + k0 + k);
      __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
      __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
      __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
      __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
      __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* o = buf + k * 16 + r0;
      _mm256_storeu_ps(o + 0 * 16, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + 1 * 16, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * 16, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * 16, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * 16, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * 16, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * 16, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * 16, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  }
}

// Kernels on raw pointers (linear.cpp, attention.cpp), instantiated for float and c10::BFloat16;
// module.cpp and products.cpp check and unpack the tensors; only they include the torch headers.
template <typename W>
void linear_kernel(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t panel_rows);
// linear_packed.cpp: x times bf16 weights held as P 16-column panels (kernels/panels.py), y [M, 16 P]
// in fp32 or rounded to bf16 as it is stored; from widen_rows rows on by linear.cpp's many-rows
// layout (linear_panels_packed), the same bits
constexpr int64_t LINEAR_KC = 256;    // k per block of both kernels' sums (16 x 256 fp32 = 16 KiB)
template <typename Y>
void linear_packed_kernel(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t P, Y* y,
                          int64_t widen_rows);
// the gate|up panels [2 I / 16] for few rows (M < widen_rows) with silu_mul on the product, into
// act [M, I] bf16: the bits of silu_mul(linear_packed(x, w)) for bf16 x; false (nothing written)
// from widen_rows rows on or for an odd number of panels
bool linear_packed_silu_kernel(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t P,
                               c10::BFloat16* act, int64_t widen_rows);
// the same for few rows (M < widen_rows) into float32 logits [M, 16 P] (the bf16-rounded values,
// widened), with each row's argmax and health code made as the outputs are stored (greedy.h);
// false (nothing written) from widen_rows rows on
bool linear_packed_logits_kernel(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t P, float* logits,
                                 int64_t* ids, int64_t* codes, int64_t widen_rows);
template <typename Y>
void linear_panels_packed(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t P, Y* y);
// linear_bf16.cpp: bf16 x and w with AVX512-BF16 dot products (call only where the CPU has them)
bool bf16_dot_available();
void linear_bf16_kernel(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y);
// linear_amx.cpp: up to 16 bf16 rows of x times weights in oneDNN's blocked layout, on AMX tiles;
// false (nothing written) where the shape, the build or the process cannot take it
bool linear_amx_available();
bool linear_amx_kernel(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, c10::BFloat16* y);
// the gate|up product [M, N] with silu_mul on it, into act [M, N / 2] bf16: the bits of
// silu_mul(linear_amx(x, w)) (N a multiple of 64)
bool linear_amx_silu_kernel(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, c10::BFloat16* act);
// the same into float32 logits [M, N] (the bf16 values, widened), with each row's argmax and
// health code made as the outputs are stored (greedy.h)
bool linear_amx_logits_kernel(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* logits,
                              int64_t* ids, int64_t* codes);
// greedy.cpp: per row of float32 logits its argmax and health code, in one read
void greedy_health_kernel(const float* x, int64_t rows, int64_t vocab, int64_t* ids, int64_t* codes);
// peak.cpp: the compute peak of register-resident multiply-adds on every thread
bool peak_has_avx512();
bool peak_has_amx();
std::tuple<double, double> fma_peak(int64_t kind, int64_t iters);

struct AttentionShape {
  int64_t rows, heads, kv_heads, head_dim, block_size, max_blocks;
  bool bf16_dot = false;      // prefill tiles of bf16 caches on AVX512-BF16 (attention_bf16.cpp)
  bool amx = false;           // decode tokens of bf16 caches with the scores on AMX tiles (attention_decode_amx.cpp)
  bool invariant = false;     // every token through the tile loop, decode tokens too (batch invariance)
};
template <typename S>
void attention_kernel(const S* query, const S* key_cache, const S* value_cache, const int32_t* block_tables,
                      const int32_t* seq_lens, const int32_t* query_start_loc, const AttentionShape& shape,
                      float scale, S* out);

template <typename T>
void rms_norm_kernel(const T* x, const T* residual, const T* w, int64_t rows, int64_t n, float eps, T* out,
                     T* sum_out);
template <typename T>
void rope_kernel(const T* q, const T* k, const float* cos, const float* sin, int64_t tokens, int64_t heads,
                 int64_t kv_heads, int64_t d, T* qo, T* ko);

}  // namespace qwen_npu_cpu
