// Causal paged attention over a [blocks, block_size, KV, D] cache, fp32 arithmetic.
//
// Token t of row r sees context positions [0, visible(t)), visible = seq_len - query_len + i + 1
// for the row's i-th token, read through the row's block table; nothing outside that is read.
// Work items are (row, a tile of consecutive tokens of that row, KV heads):
//
//   one token (decode)    scores q . k for 4-8 positions at a time, softmax, weighted sum of v
//                         with the accumulators in registers; one item takes all the token's
//                         KV heads (or a share of them when rows are few), so the context
//                         streams through memory once, in order (attention_decode.cpp; with
//                         bf16_dot, on bf16 pairs: attention_decode_bf16.cpp; with amx, the
//                         scores on AMX tiles: attention_decode_amx.cpp).
//   several tokens        flash-style: the G heads of the KV head times up to TILE_TOKENS tokens
//   (prefill chunks)      form MQ <= 16 query rows; per chunk of CHUNK positions, K is
//                         transposed into [D][16] blocks and S = Q K^T, online softmax, and
//                         acc += P V all run on the tile16 register tile.
//
// The threads claim the items one at a time, the most work first.
#include "attention.h"
#include "elementwise.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <vector>

namespace qwen_npu_cpu {
namespace {

constexpr int64_t CHUNK = 64;          // context positions per step of the flash loop (4 x 16)
constexpr int64_t MAX_QUERY_ROWS = 64;  // tokens x heads per tile

// Tokens [0, T) of one row (token i sees positions [0, first_visible + i)), KV head kvh.
// q and out point at the first token's first head of this KV head; token stride H * D.
// D % 16 == 0 (the dispatch sends other head sizes to the decode kernels).
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
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < G; ++h) {
      const S* src = q + t * g.H * D + h * D;
      float* dst = qf + (t * G + h) * D;
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(load8(src + d), vscale));
    }
  std::fill(acc, acc + MQ * D, 0.0f);
  std::fill(mx, mx + MQ, -INFINITY);
  std::fill(sum, sum + MQ, 0.0f);
  const S* rows[16];
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    const int64_t cn = std::min(CHUNK, n - c0), cw = (cn + 15) / 16 * 16;   // cw: positions multiplied
    for (int64_t b = 0; b < cn; b += 16) {                 // S[:, b:b+16] = Q K^T
      for (int64_t r = 0; r < 16; ++r) rows[r] = c0 + b + r < n ? kv_row(kc, pos, c0 + b + r, kvh, g) : zrow.data();
      pack16(rows, 0, D, kt + b * D, 0);
      rows16(qf, D, MQ, kt + b * D, 16, D, sp + b, CHUNK, false);
    }
    for (int64_t p = 0; p < cw; ++p) {
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
      for (int64_t p = live; p < cw; ++p) s[p] = -INFINITY;
      // the running maximum: a NaN score is passed over (max_ps returns its second operand)
      __m256 vmax = _mm256_set1_ps(mx[m]);
      for (int64_t p = 0; p < cw; p += 8) vmax = _mm256_max_ps(_mm256_loadu_ps(s + p), vmax);
      const float cmax = hmax(vmax);
      const float alpha = std::exp(mx[m] - cmax);         // 0 on the first chunk (mx = -inf)
      mx[m] = cmax;
      const __m256 vmx = _mm256_set1_ps(cmax);
      __m256 vs = _mm256_setzero_ps();
      for (int64_t p = 0; p < cw; p += 8) {
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
    for (int64_t d0 = 0; d0 < D; d0 += 16) rows16(sp, CHUNK, MQ, vf + d0, D, cw, acc + d0, D, true);
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < G; ++h) {
      const int64_t m = t * G + h;
      const __m256 vinv = _mm256_set1_ps(1.0f / sum[m]);
      S* dst = out + t * g.H * D + h * D;
      for (int64_t d = 0; d < D; d += 8)
        elementwise::store8(dst + d, _mm256_mul_ps(_mm256_loadu_ps(acc + m * D + d), vinv));
    }
}

// A work item: tokens [t0, t1) of a row, KV heads [kvh0, kvh1); token: one token through the
// decode kernels (a row of one query token, or any token where the head size rules out tiles).
struct Item { int64_t row, t0, t1, kvh0, kvh1; bool token; };

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
  // With amx, a row of several tokens is one tile of all its tokens per KV head (attention_amx.cpp).
  const bool amx_rows = shape.amx && !shape.invariant && amx_rows_take(q, g);
  std::vector<Item> items;
  // Invariant: a decode token is a tile of one, so that a position meets one computation in
  // every kind of step. A query row's sums in a tile are its own (the other rows of the tile only
  // add chunks wholly masked for it, exact no-ops, where V is finite: 0 times an infinite V is
  // NaN), so a token's bits do not depend on its tile; the last tile of a row goes through the
  // tile loop however few tokens it has, so that a prompt cut into chunks of two or more tokens
  // gets the bits of the whole prompt.
  for (int64_t r = 0; r < shape.rows; ++r) {
    if (qsl[r + 1] - qsl[r] == 1 && !(shape.invariant && blocked)) {
      for (int64_t s = 0; s < splits; ++s)
        items.push_back({r, qsl[r], qsl[r] + 1, g.KV * s / splits, g.KV * (s + 1) / splits, true});
      continue;
    }
    const int64_t width = amx_rows ? std::max<int64_t>(1, qsl[r + 1] - qsl[r]) : tile;
    for (int64_t t0 = qsl[r]; t0 < qsl[r + 1]; t0 += width)
      for (int64_t kvh = 0; kvh < g.KV; ++kvh)
        items.push_back({r, t0, std::min<int64_t>(t0 + width, qsl[r + 1]), kvh, kvh + 1, !blocked});
  }
  // The threads claim items one at a time, the most work first (positions read times the query
  // rows and KV heads that read them): the rows of a step differ in context, and a core slowed
  // by other work takes fewer, so that no thread waits at the end on another's share.
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  std::vector<int64_t> order(count);
  {
    std::vector<double> cost(count);
    for (int64_t i = 0; i < count; ++i) {
      const Item& it = items[i];
      const double n = sl[it.row] - (qsl[it.row + 1] - it.t1);     // positions the item's last token sees
      cost[i] = n * static_cast<double>((it.t1 - it.t0) * (it.kvh1 - it.kvh0));
    }
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  }
  std::atomic<int64_t> claimed{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> work;
    std::vector<int64_t> pos;         // element offset of each position's K/V (head 0) in the caches
    for (int64_t c = claimed++; c < count; c = claimed++) {
      const Item& it = items[order[c]];
      const int32_t* table = bt + it.row * g.MB;
      const int64_t first_visible = sl[it.row] - (qsl[it.row + 1] - it.t0) + 1;
      const int64_t n = first_visible + (it.t1 - it.t0) - 1;       // positions the item reads
      pos.resize(n);
      for (int64_t b = 0; b * g.BS < n; ++b) {
        const int64_t base = table[b] * g.block_stride();
        for (int64_t j = 0, p0 = b * g.BS; j < g.BS && p0 + j < n; ++j) pos[p0 + j] = base + j * g.pos_stride();
      }
      const int64_t off = it.t0 * g.H * g.D + it.kvh0 * g.G * g.D;
      if (it.token) {
        if (!(shape.amx && attend_token_amx(q + off, kc, vc, pos.data(), first_visible, it.kvh0, it.kvh1, scale, g,
                                            o + off)) &&
            !(shape.bf16_dot && attend_token_bf16(q + off, kc, vc, pos.data(), first_visible, it.kvh0, it.kvh1,
                                                  scale, g, o + off)))
          attend_token(q + off, kc, vc, pos.data(), first_visible, it.kvh0, it.kvh1, scale, g, o + off, work);
      } else if (amx_rows) {
        attend_row_amx(q + off, kc, vc, pos.data(), it.t1 - it.t0, first_visible, it.kvh0, scale, g, o + off);
      } else if (!(shape.bf16_dot && attend_tile_bf16(q + off, kc, vc, pos.data(), it.t1 - it.t0, first_visible,
                                                      it.kvh0, scale, g, o + off))) {
        attend_tile(q + off, kc, vc, pos.data(), it.t1 - it.t0, first_visible, it.kvh0, scale, g, o + off, work);
      }
    }
  });
}

template void attention_kernel<float>(const float*, const float*, const float*, const int32_t*, const int32_t*,
                                      const int32_t*, const AttentionShape&, float, float*);
template void attention_kernel<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                                              const int32_t*, const int32_t*, const int32_t*, const AttentionShape&,
                                              float, c10::BFloat16*);

}  // namespace qwen_npu_cpu
