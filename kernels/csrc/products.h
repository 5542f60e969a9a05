// The products' tensor-facing functions (products.cpp), bound to Python in module.cpp. Each checks
// its arguments and says what disagrees; the lm_head and gate_up_silu forms and linear_amx return
// undefined tensors, with nothing written, where their kernel cannot take the call.
#pragma once
#include <torch/extension.h>
#include <tuple>

namespace qwen_npu_cpu {

torch::Tensor linear(torch::Tensor x, torch::Tensor w, int64_t panel_rows);
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor panels, int64_t widen_rows);
torch::Tensor gate_up_silu_packed(torch::Tensor x, torch::Tensor panels, int64_t widen_rows);
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w);
torch::Tensor linear_amx(torch::Tensor x, int64_t weight_address, int64_t n);
torch::Tensor gate_up_silu_amx(torch::Tensor x, int64_t weight_address, int64_t n);
std::tuple<torch::Tensor, torch::Tensor> lm_head_amx(torch::Tensor x, int64_t weight_address, int64_t n,
                                                     torch::Tensor logits);
std::tuple<torch::Tensor, torch::Tensor> lm_head_packed(torch::Tensor x, torch::Tensor panels, torch::Tensor logits,
                                                        int64_t widen_rows);
std::tuple<torch::Tensor, torch::Tensor> greedy_health(torch::Tensor logits);
void pack_greedy(torch::Tensor ids, torch::Tensor codes, torch::Tensor out);

}  // namespace qwen_npu_cpu
