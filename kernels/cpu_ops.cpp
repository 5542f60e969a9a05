// CPU kernels for x86-64 with AVX2 + FMA: bf16 or fp32 storage, fp32 arithmetic.
//
// Built on first use by kernels/cpu.py (torch.utils.cpp_extension) and tested against
// kernels/reference.py. Threads come from torch's own pool (at::parallel_for).
//
//   linear(x [M, K], w [N, K]) -> y [M, N]          y = x @ w.T, fp32 accumulation
//   paged_attention(query [T, H, D], key_cache, value_cache [blocks, block_size, KV, D],
//                   block_tables [R, max_blocks] int32, seq_lens [R] int32,
//                   query_start_loc [R + 1] int32, scale) -> out [T, H, D]
//   write_kv(key, value [T, KV, D], key_cache, value_cache, slot_mapping [T] int64)
//
// Why a hand-written linear: on CPUs without native bf16 instructions (AVX2 only), torch's
// bf16 matrix products fall back to a slow generic loop; here each weight row is read once
// as bf16 (half the bytes of fp32), widened to fp32 in registers and used for every x row.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cmath>

namespace {

// ---- loads that widen to fp32 ----------------------------------------------------------------
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));      // 8 x bf16
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---- linear ------------------------------------------------------------------------------------
// One tile: MR (<= 4) rows of x (fp32) against NR (<= 3) rows of w, accumulating along k in
// 8-wide vectors. The accumulators are named variables (not an array) so that they stay in
// registers; the ones a smaller tile does not use are compiled away.
#define QN_DOT_ACC(i, j) __m256 c##i##j = _mm256_setzero_ps();
#define QN_DOT_FMA(i, j) if constexpr (MR > i && NR > j) c##i##j = _mm256_fmadd_ps(x##i, w##j, c##i##j);
#define QN_DOT_OUT(i, j)                                                                   \
  if constexpr (MR > i && NR > j) {                                                          \
    float s = hsum(c##i##j);                                                                 \
    for (int64_t kk = k; kk < K; ++kk) s += x[i * ldx + kk] * to_f(w[j * ldw + kk]);        \
    y[i * ldy + j] = s;                                                                      \
  }
template <int MR, int NR, typename W>
inline void linear_tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K,
                        float* y, int64_t ldy) {
  static_assert(MR >= 1 && MR <= 4 && NR >= 1 && NR <= 3, "tile shape");
  QN_DOT_ACC(0, 0) QN_DOT_ACC(0, 1) QN_DOT_ACC(0, 2) QN_DOT_ACC(1, 0) QN_DOT_ACC(1, 1) QN_DOT_ACC(1, 2)
  QN_DOT_ACC(2, 0) QN_DOT_ACC(2, 1) QN_DOT_ACC(2, 2) QN_DOT_ACC(3, 0) QN_DOT_ACC(3, 1) QN_DOT_ACC(3, 2)
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 w0 = load8(w + k);
    const __m256 w1 = NR > 1 ? load8(w + ldw + k) : w0;
    const __m256 w2 = NR > 2 ? load8(w + 2 * ldw + k) : w0;
    const __m256 x0 = _mm256_loadu_ps(x + k);
    const __m256 x1 = MR > 1 ? _mm256_loadu_ps(x + ldx + k) : x0;
    const __m256 x2 = MR > 2 ? _mm256_loadu_ps(x + 2 * ldx + k) : x0;
    const __m256 x3 = MR > 3 ? _mm256_loadu_ps(x + 3 * ldx + k) : x0;
    QN_DOT_FMA(0, 0) QN_DOT_FMA(0, 1) QN_DOT_FMA(0, 2) QN_DOT_FMA(1, 0) QN_DOT_FMA(1, 1) QN_DOT_FMA(1, 2)
    QN_DOT_FMA(2, 0) QN_DOT_FMA(2, 1) QN_DOT_FMA(2, 2) QN_DOT_FMA(3, 0) QN_DOT_FMA(3, 1) QN_DOT_FMA(3, 2)
  }
  QN_DOT_OUT(0, 0) QN_DOT_OUT(0, 1) QN_DOT_OUT(0, 2) QN_DOT_OUT(1, 0) QN_DOT_OUT(1, 1) QN_DOT_OUT(1, 2)
  QN_DOT_OUT(2, 0) QN_DOT_OUT(2, 1) QN_DOT_OUT(2, 2) QN_DOT_OUT(3, 0) QN_DOT_OUT(3, 1) QN_DOT_OUT(3, 2)
}

template <int NR, typename W>
inline void linear_rows(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t ldy) {
  // MR = 4 x rows share each widened weight vector; the remainder goes 3, 2 or 1 at a time.
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) linear_tile<4, NR>(x + m * K, K, w, K, K, y + m * ldy, ldy);
  switch (M - m) {
    case 3: linear_tile<3, NR>(x + m * K, K, w, K, K, y + m * ldy, ldy); break;
    case 2: linear_tile<2, NR>(x + m * K, K, w, K, K, y + m * ldy, ldy); break;
    case 1: linear_tile<1, NR>(x + m * K, K, w, K, K, y + m * ldy, ldy); break;
    default: break;
  }
}

// Many x rows: the weights are re-laid out on the fly, 16 rows x KC columns at a time, into a
// small fp32 panel [KC][16] (in L1), so each x value is broadcast against 16 outputs at once
// and every widened weight serves all M rows.
constexpr int PANEL = 16;

template <typename W>
inline void pack_panel(const W* w, int64_t ldw, int64_t k0, int64_t kc, float* buf, int64_t prefetch) {
  // buf[k][r] = w[r][k0 + k] for r < 16: 8 x 8 transposes in registers
  for (int64_t k = 0; k < kc; k += 8) {
    for (int r0 = 0; r0 < PANEL; r0 += 8) {
      if (prefetch && (k % 32) == 0)
        for (int r = 0; r < 8; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + r) * ldw + k0 + k + prefetch), _MM_HINT_T0);
      __m256 row[8];
      for (int r = 0; r < 8; ++r) row[r] = load8(w + (r0 + r) * ldw + k0 + k);
      __m256 t0 = _mm256_unpacklo_ps(row[0], row[1]), t1 = _mm256_unpackhi_ps(row[0], row[1]);
      __m256 t2 = _mm256_unpacklo_ps(row[2], row[3]), t3 = _mm256_unpackhi_ps(row[2], row[3]);
      __m256 t4 = _mm256_unpacklo_ps(row[4], row[5]), t5 = _mm256_unpackhi_ps(row[4], row[5]);
      __m256 t6 = _mm256_unpacklo_ps(row[6], row[7]), t7 = _mm256_unpackhi_ps(row[6], row[7]);
      __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* b = buf + k * PANEL + r0;
      _mm256_storeu_ps(b + 0 * PANEL, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(b + 1 * PANEL, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(b + 2 * PANEL, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(b + 3 * PANEL, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(b + 4 * PANEL, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(b + 5 * PANEL, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(b + 6 * PANEL, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(b + 7 * PANEL, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  }
}

// y[i][0..16) (+)= sum_k x[i][k] * buf[k][0..16) for MR (<= 6) rows of x; named accumulators
// as in linear_tile.
#define QN_PAN_ACC(i) __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps();
#define QN_PAN_FMA(i)                                                                      \
  if constexpr (MR > i) {                                                                    \
    const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);                                   \
    c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);                                               \
    c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);                                               \
  }
#define QN_PAN_OUT(i)                                                                      \
  if constexpr (MR > i) {                                                                    \
    float* yi = y + i * ldy;                                                                 \
    if (accumulate) {                                                                        \
      c##i##0 = _mm256_add_ps(c##i##0, _mm256_loadu_ps(yi));                                 \
      c##i##1 = _mm256_add_ps(c##i##1, _mm256_loadu_ps(yi + 8));                             \
    }                                                                                        \
    _mm256_storeu_ps(yi, c##i##0);                                                           \
    _mm256_storeu_ps(yi + 8, c##i##1);                                                       \
  }
template <int MR>
inline void panel_tile(const float* x, int64_t ldx, const float* buf, int64_t kc, float* y, int64_t ldy,
                       bool accumulate) {
  static_assert(MR >= 1 && MR <= 6, "tile shape");
  QN_PAN_ACC(0) QN_PAN_ACC(1) QN_PAN_ACC(2) QN_PAN_ACC(3) QN_PAN_ACC(4) QN_PAN_ACC(5)
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(buf + k * PANEL), b1 = _mm256_loadu_ps(buf + k * PANEL + 8);
    QN_PAN_FMA(0) QN_PAN_FMA(1) QN_PAN_FMA(2) QN_PAN_FMA(3) QN_PAN_FMA(4) QN_PAN_FMA(5)
  }
  QN_PAN_OUT(0) QN_PAN_OUT(1) QN_PAN_OUT(2) QN_PAN_OUT(3) QN_PAN_OUT(4) QN_PAN_OUT(5)
}

template <typename W>
void linear_panels(const float* x, int64_t M, int64_t K, const W* w, int64_t ldw, int64_t panels, float* y,
                   int64_t ldy, int64_t KC, int64_t prefetch) {
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> buf(KC * PANEL);
    for (int64_t p = p0; p < p1; ++p) {
      const W* wp = w + p * PANEL * ldw;
      float* yp = y + p * PANEL;
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        pack_panel(wp, ldw, k0, kc, buf.data(), prefetch);
        const float* xk = x + k0;
        const bool acc = k0 > 0;
        int64_t m = 0;
        for (; m + 6 <= M; m += 6) panel_tile<6>(xk + m * K, K, buf.data(), kc, yp + m * ldy, ldy, acc);
        switch (M - m) {
          case 5: panel_tile<5>(xk + m * K, K, buf.data(), kc, yp + m * ldy, ldy, acc); break;
          case 4: panel_tile<4>(xk + m * K, K, buf.data(), kc, yp + m * ldy, ldy, acc); break;
          case 3: panel_tile<3>(xk + m * K, K, buf.data(), kc, yp + m * ldy, ldy, acc); break;
          case 2: panel_tile<2>(xk + m * K, K, buf.data(), kc, yp + m * ldy, ldy, acc); break;
          case 1: panel_tile<1>(xk + m * K, K, buf.data(), kc, yp + m * ldy, ldy, acc); break;
          default: break;
        }
      }
    }
  });
}

// Few x rows: weight rows are streamed once, NR at a time, dotted with every x row.
template <typename W>
void linear_dots(const float* x, int64_t M, int64_t K, const W* w, int64_t n_begin, int64_t N, float* y) {
  constexpr int NR = 3;                               // weight rows per tile
  const int64_t groups = (N - n_begin + NR - 1) / NR;
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = n_begin + g * NR;
      const W* wg = w + n * K;
      float* yg = y + n;
      if (n + NR <= N) {
        linear_rows<NR>(x, M, K, wg, yg, N);
      } else if (N - n == 2) {
        linear_rows<2>(x, M, K, wg, yg, N);
      } else {
        linear_rows<1>(x, M, K, wg, yg, N);
      }
    }
  });
}

template <typename W>
void linear_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t panel_rows,
                 int64_t KC, int64_t prefetch) {
  int64_t done = 0;
  if (M >= panel_rows && K % 8 == 0) {
    const int64_t panels = N / PANEL;
    linear_panels(x, M, K, w, K, panels, y, N, KC, prefetch);
    done = panels * PANEL;
  }
  if (done < N) linear_dots(x, M, K, w, done, N, y);
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, int64_t panel_rows, int64_t KC, int64_t prefetch) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "cpu linear: tensors must be on the cpu");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "cpu linear: x [..., K] and w [N, K] disagree: ",
              x.sizes(), " vs ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat,
              "cpu linear: weights must be bfloat16 or float32");
  const int64_t K = w.size(1), N = w.size(0);
  auto x2 = x.reshape({-1, K}).to(at::kFloat).contiguous();     // [M, K] fp32
  auto wc = w.contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, x2.options());                   // [M, N] fp32
  if (M > 0) {
    if (wc.scalar_type() == at::kBFloat16)
      linear_impl(x2.data_ptr<float>(), M, K, wc.data_ptr<at::BFloat16>(), N, y.data_ptr<float>(), panel_rows, KC, prefetch);
    else
      linear_impl(x2.data_ptr<float>(), M, K, wc.data_ptr<float>(), N, y.data_ptr<float>(), panel_rows, KC, prefetch);
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(x.scalar_type()).view(sizes);
}

// ---- attention -----------------------------------------------------------------------------------
// exp for x <= 0 (scores minus their max): 2^n * p(r), |relative error| < 2e-7; -inf -> 0.
inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  x = _mm256_max_ps(x, lo);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_and_ps(out, _mm256_cmp_ps(x, lo, _CMP_GT_OQ));   // underflow -> exactly 0
}

template <typename S>
void attention_impl(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                    const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                    const torch::Tensor& query_start_loc, double scale, torch::Tensor& out) {
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), KV = key_cache.size(2);
  const int64_t G = H / KV, R = seq_lens.size(0), MB = block_tables.size(1);
  const S* q = query.data_ptr<S>();
  const S* kc = key_cache.data_ptr<S>();
  const S* vc = value_cache.data_ptr<S>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  S* o = out.data_ptr<S>();
  const float sc = static_cast<float>(scale);
  const int64_t pos_stride = KV * D, block_stride = BS * KV * D;
  // token -> row, and the number of context positions the token sees (causal)
  std::vector<int32_t> row_of(T), visible(T);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t) {
      row_of[t] = static_cast<int32_t>(r);
      visible[t] = sl[r] - (qsl[r + 1] - t) + 1;
    }
  at::parallel_for(0, T * KV, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / KV, kvh = i % KV;
      const int64_t r = row_of[t], n = visible[t];
      const int32_t* table = bt + r * MB;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f(q[(t * H + kvh * G + g) * D + d]) * sc;
      scores.resize(G * n);
      // pass 1: scores[g][p] = q_g . k_p
      for (int64_t p = 0; p < n; ++p) {
        const S* k = kc + table[p / BS] * block_stride + (p % BS) * pos_stride + kvh * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          __m256 a = _mm256_setzero_ps();
          int64_t d = 0;
          for (; d + 8 <= D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), load8(k + d), a);
          float s = hsum(a);
          for (; d < D; ++d) s += qg[d] * to_f(k[d]);
          scores[g * n + p] = s;
        }
      }
      // pass 2: softmax weights, then acc[g] = sum_p w[g][p] * v_p
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * n;
        float mx = -INFINITY;
        for (int64_t p = 0; p < n; ++p) mx = std::max(mx, s[p]);
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        int64_t p = 0;
        for (; p + 8 <= n; p += 8) {
          __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + p), vmx));
          _mm256_storeu_ps(s + p, e);
          vsum = _mm256_add_ps(vsum, e);
        }
        float sum = hsum(vsum);
        for (; p < n; ++p) { s[p] = std::exp(s[p] - mx); sum += s[p]; }
        const float inv = 1.0f / sum;
        for (p = 0; p < n; ++p) s[p] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p = 0; p < n; ++p) {
        const S* v = vc + table[p / BS] * block_stride + (p % BS) * pos_stride + kvh * D;
        for (int64_t g = 0; g < G; ++g) {
          const __m256 w = _mm256_set1_ps(scores[g * n + p]);
          float* a = acc.data() + g * D;
          int64_t d = 0;
          for (; d + 8 <= D; d += 8) _mm256_storeu_ps(a + d, _mm256_fmadd_ps(w, load8(v + d), _mm256_loadu_ps(a + d)));
          for (; d < D; ++d) a[d] += scores[g * n + p] * to_f(v[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) o[(t * H + kvh * G + g) * D + d] = static_cast<S>(acc[g * D + d]);
    }
  });
}

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                              double scale) {
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "cpu paged_attention: query and caches must share a dtype");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "cpu paged_attention: heads must be a multiple of kv heads");
  auto q = query.contiguous();
  auto bt = block_tables.to(at::kInt).contiguous();
  auto sl = seq_lens.to(at::kInt).contiguous();
  auto qsl = query_start_loc.to(at::kInt).contiguous();
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "cpu paged_attention: caches must be contiguous");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == at::kBFloat16)
    attention_impl<at::BFloat16>(q, key_cache, value_cache, bt, sl, qsl, scale, out);
  else if (q.scalar_type() == at::kFloat)
    attention_impl<float>(q, key_cache, value_cache, bt, sl, qsl, scale, out);
  else
    TORCH_CHECK(false, "cpu paged_attention: dtype must be bfloat16 or float32");
  return out;
}

// ---- write_kv ------------------------------------------------------------------------------------
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "cpu write_kv: caches must be contiguous");
  auto k = key.to(key_cache.scalar_type()).contiguous();
  auto v = value.to(value_cache.scalar_type()).contiguous();
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t T = slots.size(0);
  const int64_t row = k.numel() / std::max<int64_t>(T, 1);
  const int64_t bytes = row * k.element_size();
  const int64_t num_slots = key_cache.numel() / std::max<int64_t>(row, 1);
  const int64_t* s = slots.data_ptr<int64_t>();
  auto* kd = static_cast<char*>(key_cache.data_ptr());
  auto* vd = static_cast<char*>(value_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    if (s[t] < 0) continue;
    TORCH_CHECK(s[t] < num_slots, "cpu write_kv: slot ", s[t], " is beyond the cache (", num_slots, " slots)");
    std::memcpy(kd + s[t] * bytes, ks + t * bytes, bytes);
    std::memcpy(vd + s[t] * bytes, vs + t * bytes, bytes);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ w.T with fp32 accumulation (bf16 or fp32 weights)");
  m.def("paged_attention", &paged_attention, "causal paged attention, fp32 arithmetic");
  m.def("write_kv", &write_kv, "scatter K/V into the caches by slot, skipping negative slots");
}
