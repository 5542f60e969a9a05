// The tensor-facing functions of module.cpp (attention, the norms, qk_norm_rope, silu_mul, write_kv), bound
// to Python there and reused by the one-call decoder layers (layer.cpp). Each checks its arguments
// and says what disagrees.
#pragma once
#include <torch/extension.h>
#include <optional>
#include <tuple>
#include <vector>

namespace qwen_npu_cpu {

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                              double scale, bool bf16_dot, bool invariant, bool amx);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, bool wide);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w,
                                                      double eps, bool wide);
std::tuple<torch::Tensor, torch::Tensor> qk_norm_rope(torch::Tensor q, torch::Tensor k, torch::Tensor q_weight,
                                                      torch::Tensor k_weight, double eps, torch::Tensor cos,
                                                      torch::Tensor sin, bool wide);
torch::Tensor silu_mul(torch::Tensor gate_up, bool wide);
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
              torch::Tensor slot_mapping);

// Every decoder layer in one call (layer.cpp).
std::tuple<torch::Tensor, torch::Tensor> decoder_layers(
    torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> key_caches,
    std::vector<torch::Tensor> value_caches, std::vector<torch::Tensor> meta, torch::Tensor cos, torch::Tensor sin,
    int64_t heads, int64_t kv_heads, double eps, double scale, int64_t widen_rows, bool wide, bool bf16_dot, bool amx);

}  // namespace qwen_npu_cpu
