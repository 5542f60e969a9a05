// Every decoder layer of the cpu set in one call from Python: the calls model/qwen3.py's forward
// makes for each layer without a hook, on weights held as 16-column panels, made here in the same
// order on the same tensor-facing functions (products.cpp, module.cpp), so the result is the same,
// bit for bit. What it saves is the trip through Python between them: each product streams
// megabytes of weights through the caches, and the interpreter's and torch's own code and data
// that the next call needs are gone by then, so every return to Python after a product is slow
// (measured in docs/benchmarks.md). With it, a step's layers cost one return to Python instead
// of nine per layer.
//
//   x, residual ─ add_rms_norm (rms_norm for the first layer, residual = x) ─ q|k|v ─ split
//   ─ qk_norm_rope(q, k) ─ write_kv(k, v) ─ paged_attention ─ o ─ add_rms_norm ─ gate|up + silu
//   ─ down  →  (x, residual) of the next layer
#include "ops.h"
#include "products.h"

namespace qwen_npu_cpu {
namespace {

// One layer. weights: input_norm, q|k|v, q_norm, k_norm, o, post_norm, gate|up, down (model/qwen3.py's
// LayerWeights order; the four matrices as panels). meta: slot_mapping, block_tables, seq_lens,
// query_start_loc. residual: none for the first layer. bf16_dot and amx are the attention's
// switches as cpu.py's paged_attention passes them.
std::tuple<torch::Tensor, torch::Tensor> decoder_layer(
    torch::Tensor x, std::optional<torch::Tensor> residual, std::vector<torch::Tensor> weights,
    torch::Tensor key_cache, torch::Tensor value_cache, std::vector<torch::Tensor> meta, torch::Tensor cos,
    torch::Tensor sin, int64_t heads, int64_t kv_heads, double eps, double scale, int64_t widen_rows, bool wide,
    bool bf16_dot, bool amx) {
  TORCH_CHECK(weights.size() == 8 && meta.size() == 4, "cpu decoder_layer: 8 weights and 4 metadata tensors "
              "expected, got ", weights.size(), " and ", meta.size());
  TORCH_CHECK(x.dim() == 2, "cpu decoder_layer: x [tokens, hidden] expected, got ", x.sizes());
  const auto& [input_norm, qkv_w, q_norm, k_norm, o_w, post_norm, gate_up_w, down_w] =
      std::tie(weights[0], weights[1], weights[2], weights[3], weights[4], weights[5], weights[6], weights[7]);
  const int64_t t = x.size(0), rows = heads + 2 * kv_heads;
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "cpu decoder_layer: heads (", heads,
              ") must be a positive multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK(qkv_w.dim() == 3 && (16 * qkv_w.size(0)) % rows == 0,
              "cpu decoder_layer: q|k|v panels of (heads + 2 kv_heads) x head_dim = ", rows,
              " x head_dim outputs expected, got panels ", qkv_w.sizes());
  const int64_t head_dim = 16 * qkv_w.size(0) / rows;
  torch::Tensor h, res;
  if (residual.has_value()) {
    std::tie(h, res) = add_rms_norm(x, *residual, input_norm, eps, wide);
  } else {
    h = rms_norm(x, input_norm, eps, wide);
    res = x;
  }
  const auto qkv = linear_packed(h, qkv_w, widen_rows).view({t, rows, head_dim});
  const auto parts = qkv.split_with_sizes({heads, kv_heads, kv_heads}, 1);
  const auto [q, k] = qk_norm_rope(parts[0], parts[1], q_norm, k_norm, eps, cos, sin, wide);
  write_kv(k, parts[2], key_cache, value_cache, meta[0]);
  const auto attn = paged_attention(q, key_cache, value_cache, meta[1], meta[2], meta[3], scale, bf16_dot, false, amx);
  const auto attn_out = linear_packed(attn.reshape({t, heads * head_dim}), o_w, widen_rows);
  const auto [h2, res2] = add_rms_norm(attn_out, res, post_norm, eps, wide);
  auto act = gate_up_silu_packed(h2, gate_up_w, widen_rows);
  if (!act.defined()) act = silu_mul(linear_packed(h2, gate_up_w, widen_rows), wide);
  return {linear_packed(act, down_w, widen_rows), res2};
}

}  // namespace

// weights: each layer's 8 in decoder_layer's order, layer after layer; a key and a value cache per
// layer; the first layer has no residual.
std::tuple<torch::Tensor, torch::Tensor> decoder_layers(
    torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> key_caches,
    std::vector<torch::Tensor> value_caches, std::vector<torch::Tensor> meta, torch::Tensor cos, torch::Tensor sin,
    int64_t heads, int64_t kv_heads, double eps, double scale, int64_t widen_rows, bool wide, bool bf16_dot, bool amx) {
  const size_t layers = key_caches.size();
  TORCH_CHECK(layers > 0 && value_caches.size() == layers && weights.size() == 8 * layers,
              "cpu decoder_layers: 8 weights and a key and a value cache per layer expected, got ", weights.size(),
              " weights, ", key_caches.size(), " key and ", value_caches.size(), " value caches");
  std::optional<torch::Tensor> residual;
  for (size_t i = 0; i < layers; ++i) {
    std::vector<torch::Tensor> w(weights.begin() + 8 * i, weights.begin() + 8 * (i + 1));
    std::tie(x, residual) = decoder_layer(x, residual, std::move(w), key_caches[i], value_caches[i], meta, cos, sin,
                                          heads, kv_heads, eps, scale, widen_rows, wide, bf16_dot, amx);
  }
  return {x, *residual};
}

}  // namespace qwen_npu_cpu
