// Greedy sampling and the stream-health check in one read of float32 logits (greedy.h): per row
// its argmax and health code. A row of the 0.6B model's vocabulary (600 KB) stays in the core's
// L2 while its scan looks for the first column of its maximum. Rows are shared out over torch's
// threads.
#include "greedy.h"
#include <ATen/Parallel.h>

namespace qwen_npu_cpu {

void greedy_health_kernel(const float* x, int64_t rows, int64_t vocab, int64_t* ids, int64_t* codes) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      greedy::Scan s;
      greedy::scan(s, x + r * vocab, vocab, 0);
      greedy::finish(&s, 1, 1, ids + r, codes + r);
    }
  });
}

}  // namespace qwen_npu_cpu
