// The SwiGLU activation in one pass: act = silu(gate) * up from the fused gate/up projection's
// output, with the reference's roundings (silu rounded to the storage dtype, then the product).
#include "elementwise.h"
#include <ATen/Parallel.h>
#include <algorithm>

namespace qwen_npu_cpu {

using elementwise::act8;
using elementwise::round8;
using elementwise::store8;

template <typename T>
void silu_mul_kernel(const T* gate_up, int64_t row_stride, int64_t rows, int64_t n, T* act) {
  // Parallel over (row, 512-column chunk) pieces, at least 16K elements per thread: batch 1 runs
  // inline, batch 16 of a 0.6B model (16 x 3072) on both cores of a small machine.
  using elementwise::SILU_CHUNK;
  const int64_t chunks = (n + SILU_CHUNK - 1) / SILU_CHUNK;
  at::parallel_for(0, rows * chunks, elementwise::grain_for(SILU_CHUNK), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r = p / chunks, i0 = (p % chunks) * SILU_CHUNK, i1 = std::min(n, i0 + SILU_CHUNK);
      const T* gate = gate_up + r * row_stride;
      const T* up = gate + n;
      T* o = act + r * n;
      int64_t i = i0;
      for (; i + 8 <= i1; i += 8) store8(o + i, act8<T>(load8(gate + i), load8(up + i)));
      if (i < i1) {                       // the tail through the same vector code, zero-padded
        alignas(32) float g[8] = {}, u[8] = {}, y[8];
        for (int64_t j = i; j < i1; ++j) {
          g[j - i] = to_f(gate[j]);
          u[j - i] = to_f(up[j]);
        }
        _mm256_store_ps(y, round8<T>(act8<T>(_mm256_load_ps(g), _mm256_load_ps(u))));
        for (int64_t j = i; j < i1; ++j) o[j] = static_cast<T>(y[j - i]);
      }
    }
  });
}

template void silu_mul_kernel<float>(const float*, int64_t, int64_t, int64_t, float*);
template void silu_mul_kernel<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, int64_t, c10::BFloat16*);

}  // namespace qwen_npu_cpu
