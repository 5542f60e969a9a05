// The cpu kernel extension's tensor-facing side of the products: argument checks, dtype dispatch
// and the output tensors of the linear layers and the LM head (linear*.cpp, greedy.cpp see raw
// pointers). Bound to Python in module.cpp.
#include <torch/extension.h>
#include "products.h"
#include "vec.h"

namespace qwen_npu_cpu {

torch::Tensor linear(torch::Tensor x, torch::Tensor w, int64_t panel_rows) {
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
      linear_kernel(x2.data_ptr<float>(), M, K, wc.data_ptr<c10::BFloat16>(), N, y.data_ptr<float>(), panel_rows);
    else
      linear_kernel(x2.data_ptr<float>(), M, K, wc.data_ptr<float>(), N, y.data_ptr<float>(), panel_rows);
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(x.scalar_type()).view(sizes);
}

torch::Tensor linear_packed(torch::Tensor x, torch::Tensor panels, int64_t widen_rows) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "cpu linear_packed: tensors must be on the cpu");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == 16 && panels.scalar_type() == at::kBFloat16 &&
                  panels.is_contiguous(),
              "cpu linear_packed: panels must be a contiguous bf16 [P, K, 16] tensor, got ", panels.sizes(), " ",
              panels.scalar_type());
  const int64_t P = panels.size(0), K = panels.size(1);
  TORCH_CHECK(x.dim() > 0 && x.size(-1) == K, "cpu linear_packed: x [..., K] and panels [P, K, 16] disagree: ",
              x.sizes(), " vs ", panels.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "cpu linear_packed: x must be bfloat16 or float32, got ", x.scalar_type());
  auto x2 = x.reshape({-1, K}).to(at::kFloat).contiguous();     // [M, K] fp32
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, 16 * P}, x.options());               // [M, N] in x's dtype, rounded as stored
  const auto* w = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  if (M > 0 && P > 0 && y.scalar_type() == at::kBFloat16)
    linear_packed_kernel(x2.data_ptr<float>(), M, K, w, P, y.data_ptr<c10::BFloat16>(), widen_rows);
  else if (M > 0 && P > 0)
    linear_packed_kernel(x2.data_ptr<float>(), M, K, w, P, y.data_ptr<float>(), widen_rows);
  auto sizes = x.sizes().vec();
  sizes.back() = 16 * P;
  return y.view(sizes);
}

// linear_packed's gate|up form: bf16 x [M, K] times gate|up panels [P, K, 16] (P even: gate then up),
// then silu_mul -> [M, 8 P] bf16, or an undefined tensor where the kernel cannot take the call
// (widen_rows rows or more, an odd P).
torch::Tensor gate_up_silu_packed(torch::Tensor x, torch::Tensor panels, int64_t widen_rows) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() && panels.dim() == 3 && panels.size(2) == 16 &&
                  panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() && x.dim() == 2 &&
                  x.scalar_type() == at::kBFloat16 && x.size(1) == panels.size(1),
              "cpu gate_up_silu_packed: bf16 x [M, K] and contiguous bf16 panels [P, K, 16] expected, got ",
              x.sizes(), " ", x.scalar_type(), " and ", panels.sizes(), " ", panels.scalar_type());
  const int64_t P = panels.size(0);
  if (x.size(0) < 1 || x.size(0) >= widen_rows || P % 2 != 0) return torch::Tensor();   // before any copy
  auto x2 = x.to(at::kFloat).contiguous();
  auto act = torch::empty({x.size(0), 8 * P}, x.options());
  if (!linear_packed_silu_kernel(x2.data_ptr<float>(), x2.size(0), x2.size(1),
                                 reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>()), P,
                                 act.data_ptr<c10::BFloat16>(), widen_rows))
    return torch::Tensor();
  return act;
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "cpu linear_bf16: tensors must be on the cpu");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "cpu linear_bf16: x and w must be bfloat16");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "cpu linear_bf16: x [..., K] and w [N, K] disagree: ",
              x.sizes(), " vs ", w.sizes());
  const int64_t K = w.size(1), N = w.size(0);
  auto x2 = x.reshape({-1, K}).contiguous();
  auto wc = w.contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, x2.options().dtype(at::kFloat));
  if (M > 0)
    linear_bf16_kernel(reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>()), M, K,
                       reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()), N, y.data_ptr<float>());
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(at::kBFloat16).view(sizes);
}

// x [M, K] bf16 times the [N, K] weights oneDNN reordered at ``weight_address`` (its blocked
// layout; the caller checks that this CPU's oneDNN chose it) -> [M, N] bf16, or an undefined tensor
// where the kernel cannot take the call (more than 16 rows, K or N not a multiple of 32, no tiles).
torch::Tensor linear_amx(torch::Tensor x, int64_t weight_address, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "cpu linear_amx: x must be a 2-D bf16 cpu tensor, got ", x.sizes(), " ", x.scalar_type());
  auto xc = x.contiguous();
  auto y = torch::empty({xc.size(0), n}, xc.options());
  const auto* w = reinterpret_cast<const uint16_t*>(static_cast<uintptr_t>(weight_address));
  if (!linear_amx_kernel(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), xc.size(0), xc.size(1), w, n,
                         reinterpret_cast<c10::BFloat16*>(y.data_ptr<at::BFloat16>())))
    return torch::Tensor();
  return y;
}

// linear_amx's gate|up form: x [M, K] times the [n, K] gate|up weights, then silu_mul, -> [M, n / 2]
// bf16 (the bits of silu_mul(linear_amx(...))), or an undefined tensor where the kernel cannot take
// the call (as linear_amx, and n not a multiple of 64).
torch::Tensor gate_up_silu_amx(torch::Tensor x, int64_t weight_address, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "cpu gate_up_silu_amx: x must be a 2-D bf16 cpu tensor, got ", x.sizes(), " ", x.scalar_type());
  auto xc = x.contiguous();
  auto act = torch::empty({xc.size(0), n / 2}, xc.options());
  const auto* w = reinterpret_cast<const uint16_t*>(static_cast<uintptr_t>(weight_address));
  if (!linear_amx_silu_kernel(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), xc.size(0), xc.size(1),
                              w, n, reinterpret_cast<c10::BFloat16*>(act.data_ptr<at::BFloat16>())))
    return torch::Tensor();
  return act;
}

// The LM head's forms of the two products above: x [M, K] times the weights into ``logits``
// [M, N] float32 (contiguous rows; the product's values, widened), returning each row's (argmax,
// health code) made as the logits are stored; undefined tensors (nothing written) where the
// kernel cannot take the call.
namespace {
void check_logits(const torch::Tensor& x, const torch::Tensor& logits, int64_t n, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "cpu ", name, ": x must be a 2-D cpu tensor, got ", x.sizes());
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.size(0) == x.size(0) && logits.size(1) == n && logits.stride(1) == 1 &&
                  logits.stride(0) == n,
              "cpu ", name, ": logits must be a contiguous float32 cpu tensor [", x.size(0), ", ", n, "], got ",
              logits.sizes(), " ", logits.scalar_type(), " strides ", logits.strides());
}
}  // namespace

std::tuple<torch::Tensor, torch::Tensor> lm_head_amx(torch::Tensor x, int64_t weight_address, int64_t n,
                                                     torch::Tensor logits) {
  check_logits(x, logits, n, "lm_head_amx");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "cpu lm_head_amx: x must be bfloat16, got ", x.scalar_type());
  auto xc = x.contiguous();
  auto ids = torch::empty({xc.size(0)}, xc.options().dtype(at::kLong));
  auto codes = torch::empty({xc.size(0)}, xc.options().dtype(at::kLong));
  const auto* w = reinterpret_cast<const uint16_t*>(static_cast<uintptr_t>(weight_address));
  if (!linear_amx_logits_kernel(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), xc.size(0),
                                xc.size(1), w, n, logits.data_ptr<float>(), ids.data_ptr<int64_t>(),
                                codes.data_ptr<int64_t>()))
    return {torch::Tensor(), torch::Tensor()};
  return {ids, codes};
}

std::tuple<torch::Tensor, torch::Tensor> lm_head_packed(torch::Tensor x, torch::Tensor panels, torch::Tensor logits,
                                                        int64_t widen_rows) {
  TORCH_CHECK(panels.device().is_cpu() && panels.dim() == 3 && panels.size(2) == 16 &&
                  panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() && x.size(-1) == panels.size(1),
              "cpu lm_head_packed: panels must be a contiguous bf16 [P, K, 16] tensor matching x [M, K], got ",
              panels.sizes(), " and ", x.sizes());
  check_logits(x, logits, 16 * panels.size(0), "lm_head_packed");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "cpu lm_head_packed: x must be bfloat16 or float32, got ", x.scalar_type());
  auto x2 = x.to(at::kFloat).contiguous();
  auto ids = torch::empty({x2.size(0)}, x2.options().dtype(at::kLong));
  auto codes = torch::empty({x2.size(0)}, x2.options().dtype(at::kLong));
  if (!linear_packed_logits_kernel(x2.data_ptr<float>(), x2.size(0), x2.size(1),
                                   reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>()), panels.size(0),
                                   logits.data_ptr<float>(), ids.data_ptr<int64_t>(), codes.data_ptr<int64_t>(),
                                   widen_rows))
    return {torch::Tensor(), torch::Tensor()};
  return {ids, codes};
}

std::tuple<torch::Tensor, torch::Tensor> greedy_health(torch::Tensor logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "cpu greedy_health: logits must be a 2-D float32 cpu tensor, got ", logits.sizes(), " ",
              logits.scalar_type());
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  auto ids = torch::empty({rows}, x.options().dtype(at::kLong));
  auto codes = torch::empty({rows}, x.options().dtype(at::kLong));
  if (rows > 0) greedy_health_kernel(x.data_ptr<float>(), rows, vocab, ids.data_ptr<int64_t>(), codes.data_ptr<int64_t>());
  return {ids, codes};
}

// The forward's greedy output, ``out`` [2, rows] int64 with contiguous rows: the token ids in
// row 0 and in row 1 the one word per row the sampler copies to the host, id | code << 32
// (ids, codes: int64 [rows]).
void pack_greedy(torch::Tensor ids, torch::Tensor codes, torch::Tensor out) {
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kLong && out.dim() == 2 && out.size(0) == 2 &&
                  (out.stride(1) == 1 || out.size(1) <= 1),
              "cpu pack_greedy: out must be an int64 cpu tensor [2, rows] with contiguous rows, got ", out.sizes(),
              " strides ", out.strides(), " ", out.scalar_type());
  const int64_t rows = out.size(1);
  TORCH_CHECK(ids.device().is_cpu() && codes.device().is_cpu() && ids.scalar_type() == at::kLong &&
                  codes.scalar_type() == at::kLong && ids.dim() == 1 && codes.dim() == 1 && ids.size(0) == rows &&
                  codes.size(0) == rows,
              "cpu pack_greedy: ids and codes must be int64 cpu tensors [", rows, "], got ", ids.sizes(), " ",
              ids.scalar_type(), " and ", codes.sizes(), " ", codes.scalar_type());
  const auto i = ids.accessor<int64_t, 1>();
  const auto c = codes.accessor<int64_t, 1>();
  int64_t* id_out = out.data_ptr<int64_t>();
  int64_t* word_out = id_out + out.stride(0);
  for (int64_t r = 0; r < rows; ++r) {
    id_out[r] = i[r];
    word_out[r] = i[r] | static_cast<int64_t>(static_cast<uint64_t>(c[r]) << 32);   // no signed shift
  }
}

}  // namespace qwen_npu_cpu
