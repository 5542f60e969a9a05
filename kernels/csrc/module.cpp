// The cpu kernel extension's tensor-facing side: argument checks, dtype dispatch, write_kv and
// the Python bindings. The kernels themselves (linear.cpp, attention.cpp) see raw pointers; the
// products' tensor side is in products.cpp, the one-call decoder layers in layer.cpp.
#include <torch/extension.h>
#include "ops.h"
#include "products.h"
#include "vec.h"
#include "elementwise.h"
#include <ATen/Parallel.h>
#include <cstring>

namespace qwen_npu_cpu {

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                              double scale, bool bf16_dot, bool invariant, bool amx) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "cpu paged_attention: query [T, H, D] and caches "
              "[blocks, block_size, KV, D] expected, got ", query.sizes(), " and ", key_cache.sizes());
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "cpu paged_attention: query and caches must share a dtype");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "cpu paged_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "cpu paged_attention: caches must be contiguous");
  auto q = query.contiguous();
  auto bt = block_tables.to(at::kInt).contiguous();
  auto sl = seq_lens.to(at::kInt).contiguous();
  auto qsl = query_start_loc.to(at::kInt).contiguous();
  auto out = torch::empty_like(q);
  const AttentionShape shape{sl.size(0), q.size(1), key_cache.size(2), q.size(2), key_cache.size(1), bt.size(1),
                             bf16_dot, amx, invariant};
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16)
    attention_kernel(q.data_ptr<c10::BFloat16>(), key_cache.data_ptr<c10::BFloat16>(),
                     value_cache.data_ptr<c10::BFloat16>(), bt.data_ptr<int32_t>(), sl.data_ptr<int32_t>(),
                     qsl.data_ptr<int32_t>(), shape, sc, out.data_ptr<c10::BFloat16>());
  else if (q.scalar_type() == at::kFloat)
    attention_kernel(q.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                     bt.data_ptr<int32_t>(), sl.data_ptr<int32_t>(), qsl.data_ptr<int32_t>(), shape, sc,
                     out.data_ptr<float>());
  else
    TORCH_CHECK(false, "cpu paged_attention: dtype must be bfloat16 or float32");
  return out;
}

// Dispatch on the dtype of x: bf16 or fp32 (the Python side checks and falls back otherwise).
#define QN_DISPATCH(x, T, ...)                                                                \
  if ((x).scalar_type() == at::kBFloat16) { using T = c10::BFloat16; __VA_ARGS__; }           \
  else { TORCH_CHECK((x).scalar_type() == at::kFloat, "cpu kernels: bfloat16 or float32 only"); \
         using T = float; __VA_ARGS__; }

// wide: the bf16 kernels on 16 AVX-512 lanes (elementwise_avx512.cpp), where the caller knows the CPU has them.
#define QN_WIDE(x, call) ((wide) && (x).scalar_type() == at::kBFloat16 && (call))
#define QN_BF(t) reinterpret_cast<c10::BFloat16*>((t).data_ptr<at::BFloat16>())

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, bool wide) {
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  TORCH_CHECK(wc.scalar_type() == xc.scalar_type() && wc.numel() == xc.size(-1), "cpu rms_norm: weight [n] of x's dtype");
  auto out = torch::empty_like(xc);
  const int64_t n = xc.size(-1), rows = n ? xc.numel() / n : 0;
  if (!QN_WIDE(xc, rms_norm_avx512(QN_BF(xc), nullptr, QN_BF(wc), rows, n, static_cast<float>(eps), QN_BF(out),
                                    nullptr)))
    QN_DISPATCH(xc, T, rms_norm_kernel<T>(xc.data_ptr<T>(), nullptr, wc.data_ptr<T>(), rows, n, static_cast<float>(eps),
                                          out.data_ptr<T>(), nullptr))
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w,
                                                      double eps, bool wide) {
  auto xc = x.contiguous();
  auto rc = residual.contiguous();
  auto wc = w.contiguous();
  TORCH_CHECK(rc.sizes() == xc.sizes() && rc.scalar_type() == xc.scalar_type(), "cpu add_rms_norm: residual like x");
  TORCH_CHECK(wc.scalar_type() == xc.scalar_type() && wc.numel() == xc.size(-1), "cpu add_rms_norm: weight [n] of x's dtype");
  auto out = torch::empty_like(xc);
  auto sum = torch::empty_like(xc);
  const int64_t n = xc.size(-1), rows = n ? xc.numel() / n : 0;
  if (!QN_WIDE(xc, rms_norm_avx512(QN_BF(xc), QN_BF(rc), QN_BF(wc), rows, n, static_cast<float>(eps), QN_BF(out),
                                    QN_BF(sum))))
    QN_DISPATCH(xc, T, rms_norm_kernel<T>(xc.data_ptr<T>(), rc.data_ptr<T>(), wc.data_ptr<T>(), rows, n,
                                          static_cast<float>(eps), out.data_ptr<T>(), sum.data_ptr<T>()))
  return {out, sum};
}

std::tuple<torch::Tensor, torch::Tensor> rope(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  auto qc = q.contiguous();
  auto kc = k.contiguous();
  auto c = cos.to(at::kFloat).contiguous();
  auto s = sin.to(at::kFloat).contiguous();
  TORCH_CHECK(qc.dim() == 3 && kc.dim() == 3 && qc.size(0) == kc.size(0) && qc.size(2) == kc.size(2) &&
              c.size(0) == qc.size(0) && c.size(1) == qc.size(2) && qc.size(2) % 2 == 0 &&
              qc.scalar_type() == kc.scalar_type(), "cpu rope: q [T, H, D], k [T, KV, D], cos/sin [T, D]");
  auto qo = torch::empty_like(qc);
  auto ko = torch::empty_like(kc);
  QN_DISPATCH(qc, T, rope_kernel<T>(qc.data_ptr<T>(), kc.data_ptr<T>(), c.data_ptr<float>(), s.data_ptr<float>(),
                                    qc.size(0), qc.size(1), kc.size(1), qc.size(2), qo.data_ptr<T>(), ko.data_ptr<T>()))
  return {qo, ko};
}

// rope(rms_norm(q, q_weight), rms_norm(k, k_weight)) in one pass. q and k may be strided views of
// the fused qkv projection (any token and head strides, unit stride within a head).
std::tuple<torch::Tensor, torch::Tensor> qk_norm_rope(torch::Tensor q, torch::Tensor k, torch::Tensor q_weight,
                                                      torch::Tensor k_weight, double eps, torch::Tensor cos,
                                                      torch::Tensor sin, bool wide) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "cpu qk_norm_rope: q [T, H, D] and k [T, KV, D] with an even D expected, got ", q.sizes(), " and ",
              k.sizes());
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && q_weight.scalar_type() == q.scalar_type() &&
              k_weight.scalar_type() == q.scalar_type() && q_weight.numel() == D && k_weight.numel() == D,
              "cpu qk_norm_rope: weights [D] and k of q's dtype expected");
  auto c = cos.to(at::kFloat).contiguous();
  auto s = sin.to(at::kFloat).contiguous();
  TORCH_CHECK(c.dim() == 2 && c.size(0) == T && c.size(1) == D && s.sizes() == c.sizes(),
              "cpu qk_norm_rope: cos/sin [T, D] expected, got ", cos.sizes(), " and ", sin.sizes());
  auto qc = q.stride(2) == 1 ? q : q.contiguous();
  auto kc = k.stride(2) == 1 ? k : k.contiguous();
  auto qw = q_weight.contiguous();
  auto kw = k_weight.contiguous();
  auto qo = torch::empty({T, q.size(1), D}, q.options());
  auto ko = torch::empty({T, k.size(1), D}, k.options());
  if (!QN_WIDE(qc, qk_norm_rope_avx512(QN_BF(qc), qc.stride(0), qc.stride(1), QN_BF(kc), kc.stride(0), kc.stride(1),
                                        QN_BF(qw), QN_BF(kw), c.data_ptr<float>(), s.data_ptr<float>(), T,
                                        qc.size(1), kc.size(1), D, static_cast<float>(eps), QN_BF(qo), QN_BF(ko))))
    QN_DISPATCH(qc, X, qk_norm_rope_kernel<X>(qc.data_ptr<X>(), qc.stride(0), qc.stride(1), kc.data_ptr<X>(),
                                              kc.stride(0), kc.stride(1), qw.data_ptr<X>(), kw.data_ptr<X>(),
                                              c.data_ptr<float>(), s.data_ptr<float>(), T, qc.size(1), kc.size(1), D,
                                              static_cast<float>(eps), qo.data_ptr<X>(), ko.data_ptr<X>()))
  return {qo, ko};
}

// gate_up [..., 2 * I] -> silu(gate) * up [..., I]; rows may be strided (unit stride within one).
torch::Tensor silu_mul(torch::Tensor gate_up, bool wide) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "cpu silu_mul: gate_up [..., 2 * I] with an even last dimension expected, got ", gate_up.sizes());
  const int64_t n = gate_up.size(-1) / 2;
  auto x = gate_up.dim() == 2 && gate_up.stride(1) == 1 ? gate_up : gate_up.reshape({-1, 2 * n}).contiguous();
  auto act = torch::empty({x.size(0), n}, x.options());
  if (x.size(0) > 0 && n > 0 && !QN_WIDE(x, silu_mul_avx512(QN_BF(x), x.stride(0), x.size(0), n, QN_BF(act)))) {
    QN_DISPATCH(x, X, silu_mul_kernel<X>(x.data_ptr<X>(), x.stride(0), x.size(0), n, act.data_ptr<X>()))
  }
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  return act.view(sizes);
}

// Copy token t's K/V [KV, D] into slot slot_mapping[t] of the caches; negative slots are skipped.
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "cpu write_kv: caches must be contiguous");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t T = slots.size(0);
  if (T == 0) return;
  // A token's K (or V) must be one contiguous row; the tokens may lie any stride apart (V is a
  // view of the fused qkv output), so such a view is read in place rather than copied first.
  auto rows = [&](const torch::Tensor& x, const torch::Tensor& cache) {
    auto y = x.to(cache.scalar_type());
    const bool in_place = y.dim() == 3 && y.stride(2) == 1 && y.stride(1) == y.size(2);
    return in_place ? y : y.contiguous();
  };
  auto k = rows(key, key_cache);
  auto v = rows(value, value_cache);
  TORCH_CHECK(k.dim() >= 1 && k.size(0) == T && v.dim() >= 1 && v.size(0) == T && v.numel() == k.numel() &&
              k.numel() % T == 0, "cpu write_kv: key and value [T, KV, D] with T = ", T, " slots expected, got ",
              key.sizes(), " and ", value.sizes());
  const int64_t row = k.numel() / T;
  TORCH_CHECK(key_cache.dim() == 4 && row == key_cache.size(2) * key_cache.size(3) &&
              value_cache.sizes() == key_cache.sizes(), "cpu write_kv: a token's K/V (", row,
              " values) does not fit the caches ", key_cache.sizes(), " and ", value_cache.sizes());
  const int64_t bytes = row * k.element_size();
  const int64_t num_slots = key_cache.numel() / row;
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(s[t] < num_slots, "cpu write_kv: slot ", s[t], " is beyond the cache (", num_slots, " slots)");
  auto* kd = static_cast<char*>(key_cache.data_ptr());
  auto* vd = static_cast<char*>(value_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t k_step = (k.dim() == 3 ? k.stride(0) : row) * k.element_size();
  const int64_t v_step = (v.dim() == 3 ? v.stride(0) : row) * v.element_size();
  // Tokens split across threads from 64 on (a prefill chunk); a decode step's few run inline.
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (s[t] < 0) continue;
      std::memcpy(kd + s[t] * bytes, ks + t * k_step, bytes);
      std::memcpy(vd + s[t] * bytes, vs + t * v_step, bytes);
    }
  });
}

}  // namespace qwen_npu_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &qwen_npu_cpu::linear, "y = x @ w.T with fp32 accumulation (bf16 or fp32 weights)");
  m.def("linear_packed", &qwen_npu_cpu::linear_packed,
        "y = x @ w.T with fp32 accumulation, w as bf16 16-column panels (kernels/panels.py)");
  m.def("linear_bf16", &qwen_npu_cpu::linear_bf16, "y = x @ w.T, bf16 x and w, AVX512-BF16 dot products");
  m.def("has_bf16_dot", &qwen_npu_cpu::bf16_dot_available, "was the AVX512-BF16 linear compiled in?");
  m.def("has_amx_linear", &qwen_npu_cpu::linear_amx_available, "was the AMX linear compiled in, with the tiles granted?");
  m.def("linear_amx", &qwen_npu_cpu::linear_amx, "y = x @ w.T for up to 16 bf16 rows, w in oneDNN's blocked layout");
  m.def("gate_up_silu_packed", &qwen_npu_cpu::gate_up_silu_packed,
        "silu_mul(linear_packed(x, gate|up panels)) in one pass over the panels, the same bits");
  m.def("gate_up_silu_amx", &qwen_npu_cpu::gate_up_silu_amx,
        "silu_mul(linear_amx(x, gate|up)) in one pass over the weights, the same bits");
  m.def("lm_head_amx", &qwen_npu_cpu::lm_head_amx,
        "linear_amx into float32 logits, with each row's (argmax, health code) made as they are stored");
  m.def("lm_head_packed", &qwen_npu_cpu::lm_head_packed,
        "linear_packed (few rows) into float32 logits, with each row's (argmax, health code) made as they are stored");
  m.def("greedy_health", &qwen_npu_cpu::greedy_health, "(argmax, health code) per row of float32 logits");
  m.def("pack_greedy", &qwen_npu_cpu::pack_greedy, "(token id, id | code << 32) per row into the forward's greedy output");
  m.def("fma_peak", &qwen_npu_cpu::fma_peak, "(GFLOP/s, checksum) of register-resident multiply-adds on every thread");
  m.def("peak_has_avx512", &qwen_npu_cpu::peak_has_avx512, "were the AVX-512 peak loops compiled in?");
  m.def("peak_has_amx", &qwen_npu_cpu::peak_has_amx, "was the AMX peak loop compiled in, and may it use the tiles?");
  m.def("paged_attention", &qwen_npu_cpu::paged_attention,
        "causal paged attention, fp32 arithmetic (bf16_dot: prefill tiles and decode tokens on AVX512-BF16 dot products; "
        "invariant: decode tokens through the tiles too; amx: decode tokens of bf16 caches with the scores on AMX tiles)",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("scale"), py::arg("bf16_dot") = false, py::arg("invariant") = false,
        py::arg("amx") = false);
  m.def("write_kv", &qwen_npu_cpu::write_kv, "scatter K/V into the caches by slot, skipping negative slots");
  m.def("has_avx512_elementwise", &qwen_npu_cpu::avx512_elementwise_available,
        "were the 16-lane bf16 norms and activation compiled in?");
  m.def("rms_norm", &qwen_npu_cpu::rms_norm, "RMSNorm over the last dimension (wide: 16 AVX-512 lanes, bf16)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("wide") = false);
  m.def("add_rms_norm", &qwen_npu_cpu::add_rms_norm, "(rms_norm(x + residual), x + residual)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("wide") = false);
  m.def("rope", &qwen_npu_cpu::rope, "rotary embedding, rotate-halves style");
  m.def("qk_norm_rope", &qwen_npu_cpu::qk_norm_rope, "rope(rms_norm(q), rms_norm(k)) in one pass",
        py::arg("q"), py::arg("k"), py::arg("q_weight"), py::arg("k_weight"), py::arg("eps"), py::arg("cos"),
        py::arg("sin"), py::arg("wide") = false);
  m.def("silu_mul", &qwen_npu_cpu::silu_mul, "silu(gate) * up from the fused gate/up output",
        py::arg("gate_up"), py::arg("wide") = false);
  m.def("decoder_layers", &qwen_npu_cpu::decoder_layers,
        "every decoder layer on panel weights in one call: the forward's separate calls, in order, the same bits",
        py::arg("x"), py::arg("weights"), py::arg("key_caches"), py::arg("value_caches"), py::arg("meta"),
        py::arg("cos"), py::arg("sin"), py::arg("heads"), py::arg("kv_heads"), py::arg("eps"), py::arg("scale"),
        py::arg("widen_rows"), py::arg("wide"), py::arg("bf16_dot"), py::arg("amx"));
}
