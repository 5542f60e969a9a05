// The cpu kernel extension: write_kv here, linear and paged_attention in their own files.
#include "vec.h"
#include <cstring>

namespace qwen_npu_cpu {

// Copy token t's K/V [KV, D] into slot slot_mapping[t] of the caches; negative slots are skipped.
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "cpu write_kv: caches must be contiguous");
  auto k = key.to(key_cache.scalar_type()).contiguous();
  auto v = value.to(value_cache.scalar_type()).contiguous();
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t T = slots.size(0);
  if (T == 0) return;
  const int64_t row = k.numel() / T;
  const int64_t bytes = row * k.element_size();
  const int64_t num_slots = key_cache.numel() / row;
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(s[t] < num_slots, "cpu write_kv: slot ", s[t], " is beyond the cache (", num_slots, " slots)");
  auto* kd = static_cast<char*>(key_cache.data_ptr());
  auto* vd = static_cast<char*>(value_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    if (s[t] < 0) continue;
    std::memcpy(kd + s[t] * bytes, ks + t * bytes, bytes);
    std::memcpy(vd + s[t] * bytes, vs + t * bytes, bytes);
  }
}

}  // namespace qwen_npu_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &qwen_npu_cpu::linear, "y = x @ w.T with fp32 accumulation (bf16 or fp32 weights)");
  m.def("paged_attention", &qwen_npu_cpu::paged_attention, "causal paged attention, fp32 arithmetic");
  m.def("write_kv", &qwen_npu_cpu::write_kv, "scatter K/V into the caches by slot, skipping negative slots");
}
