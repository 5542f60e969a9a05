// Shared by the two halves of the cpu paged attention: the cache geometry, how a position's
// K/V is found, and the decode entry point (attention_decode.cpp) that attention.cpp calls.
#pragma once
#include "vec.h"
#include <vector>

namespace qwen_npu_cpu {

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

// Prefetch positions [p0, p1) of KV heads [kvh0, kvh1) (adjacent in the cache) into L2: the decode
// kernels stream a context whose blocks lie anywhere, and the hardware prefetchers stop at pages.
template <typename S>
inline void prefetch_rows(const S* cache, const int64_t* pos, int64_t p0, int64_t p1, int64_t kvh0, int64_t kvh1,
                          const Geometry& g) {
  const int64_t bytes = (kvh1 - kvh0) * g.D * static_cast<int64_t>(sizeof(S));
  for (int64_t p = p0; p < p1; ++p) {
    const char* row = reinterpret_cast<const char*>(kv_row(cache, pos, p, kvh0, g));
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
  }
}

// One decode token against its context (see attention_decode.cpp).
template <typename S>
void attend_token(const S* q, const S* kc, const S* vc, const int64_t* pos, int64_t n, int64_t kvh0, int64_t kvh1,
                  float scale, const Geometry& g, S* out, std::vector<float>& work);

// One decode token with native bf16 dot products (attention_decode_bf16.cpp); false, and nothing
// written, where the build or the shape cannot take it (attend_token runs instead).
bool attend_token_bf16(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* pos,
                       int64_t n, int64_t kvh0, int64_t kvh1, float scale, const Geometry& g, c10::BFloat16* out);

// One decode token with the scores on AMX tiles (attention_decode_amx.cpp); false, and nothing
// written, where the build, the process or the shape cannot take it.
bool attend_token_amx(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* pos,
                      int64_t n, int64_t kvh0, int64_t kvh1, float scale, const Geometry& g, c10::BFloat16* out);

// Every token of one row against KV head kvh on AMX tiles (attention_amx.cpp): q and out point at
// the first token's first head of the KV head, token i seeing positions [0, first_visible + i).
// Call it only where ``amx_rows_take`` says it can (the build, the process, the shape).
bool amx_rows_take(const c10::BFloat16*, const Geometry& g);
void attend_row_amx(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* pos,
                    int64_t T, int64_t first_visible, int64_t kvh, float scale, const Geometry& g,
                    c10::BFloat16* out);

// One prefill tile with native bf16 dot products (attention_bf16.cpp); false, and nothing
// written, where the build or the shape cannot take it (the fp32 tile runs instead).
bool attend_tile_bf16(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* pos,
                      int64_t T, int64_t first_visible, int64_t kvh, float scale, const Geometry& g,
                      c10::BFloat16* out);

// An fp32 cache has no bf16 path: the fp32 kernels run.
inline bool attend_token_bf16(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                              float, const Geometry&, float*) {
  return false;
}
inline bool attend_token_amx(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                             float, const Geometry&, float*) {
  return false;
}
inline bool amx_rows_take(const float*, const Geometry&) { return false; }
inline void attend_row_amx(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                           float, const Geometry&, float*) {}
inline bool attend_tile_bf16(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                             float, const Geometry&, float*) {
  return false;
}

}  // namespace qwen_npu_cpu
