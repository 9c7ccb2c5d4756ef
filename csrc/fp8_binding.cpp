// Torch binding of the FP8-activation kbit GEMM (wgmma_fp8/): checks, allocation with the torch
// allocator, launch on the current stream. Schemas are defined in Python (vllm_kbit/ops.py):
//   kbit::quantize_act_fp8(x, bits) -> (x_q e4m3 [M, K] in the GEMM's k order for bits, or in
//       natural order for bits = 0, s_x [M] fp32)
//   kbit::gemm_fp8(x, packed, absmax, codebook, bits, n, k, w_exp, bias?) -> y [M, n]: the plan's
//       path (dispatch/fp8_plan.h): the fused kernel; decode_fp8 + x in natural order + vLLM's /
//       torch's scaled_mm; or the 16-bit kbit::gemm where that is faster
//   kbit::gemm_fp8_path(..., bias?, overrides) -> y: gemm_fp8 with plan overrides (fp8.path)
//   kbit::decode_fp8(packed, absmax, codebook, bits, n, k, w_exp) -> w_q e4m3 [n, k]: the
//       weights as gemm_fp8 decodes them, once, for the large-M path (an FP8 GEMM follows)
//   kbit::gemm_fp8_quantized(x_q, s_x, packed, absmax, codebook, bits, n, k, w_exp, dtype,
//                            bias?, overrides="") -> y
//       overrides: plan overrides (dispatch/overrides.h; fp8.tile_m / fp8.tile_n force the tile)
// and the C++-only helper op
//   kbit::fp8_plan(m, n, k, bits, dtype, overrides="") -> int[]: the plan's fields, its kernel's
//       key first (dispatch/plan_fields.h; vllm_kbit.ops.fp8_plan names them)
// One plan a call (dispatch/fp8_plan.h), the launch of the kernel its key names. No host sync and
// a grid from shapes only: graph-capturable.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "dispatch/fp8_plan.h"
#include "dispatch/launchers.h"
#include "dispatch/heuristics.h"
#include "dispatch/overrides.h"
#include "dispatch/plan_fields.h"
#include "wgmma_fp8/fp8_launch.h"

namespace kbit {
namespace fp8 {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, std::string("kbit::") + what + ": CUDA error: " + cudaGetErrorString(err));
}

void check_dense(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype, const at::Tensor& ref) {
  const std::string where = std::string("kbit::") + op + ": " + name;
  TORCH_CHECK(t.is_cuda() && t.device() == ref.device(), where + " must be on " + ref.device().str());
  TORCH_CHECK(t.scalar_type() == dtype,
              where + " must be " + c10::toString(dtype) + ", got " + c10::toString(t.scalar_type()));
  TORCH_CHECK(t.is_contiguous(), where + " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 || dtype == at::kHalf || dtype == at::kBFloat16,
              where + " must be 16-byte aligned");
}

DType out_type(at::ScalarType t, const char* op) {
  TORCH_CHECK(t == at::kHalf || t == at::kBFloat16,
              std::string("kbit::") + op + ": the output dtype must be float16 or bfloat16, got " + c10::toString(t));
  return t == at::kHalf ? DType::kHalf : DType::kBFloat16;
}

Fp8Overrides fp8_overrides(c10::string_view text, const char* op) {
  PlanOverrides o;
  const std::string err = parse_overrides(std::string(text), &o);
  TORCH_CHECK(err.empty(), std::string("kbit::") + op + ": " + err);
  return o.fp8;
}

void check_weight(const char* op, const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook,
                  int64_t bits, int64_t n, int64_t k, int64_t w_exp, const at::Tensor& ref) {
  const std::string o = std::string("kbit::") + op + ": ";
  TORCH_CHECK(bits >= 2 && bits <= 5, o + "bits must be 2, 3, 4 or 5, got " + str(bits));
  TORCH_CHECK(n > 0 && n < (int64_t(1) << 31), o + "n must be positive, got " + str(n));
  TORCH_CHECK(k > 0 && k % 32 == 0 && k < (int64_t(1) << 31), o + "k = " + str(k) + " must be a positive multiple of 32");
  TORCH_CHECK(w_exp >= min_weight_exp() && w_exp <= max_weight_exp(),
              o + "w_exp = " + str(w_exp) + " is outside " + str(min_weight_exp()) + ".." + str(max_weight_exp()) +
                  " (vllm_kbit.fp8.weight_exponent computes it)");
  check_dense(packed, op, "packed", at::kInt, ref);
  check_dense(absmax, op, "absmax", at::kByte, ref);
  check_dense(codebook, op, "codebook", at::kFloat, ref);
  const int64_t units = ((n + 63) / 64) * ((k + 63) / 64);
  TORCH_CHECK(packed.numel() == units * bits * 128, o + "packed has " + str(packed.numel()) + " words, the tiled layout of " +
              str(n) + "x" + str(k) + " at bits=" + str(bits) + " has " + str(units * bits * 128) +
              " (pass the output of kbit::repack)");
  TORCH_CHECK(absmax.numel() == units * 128, o + "absmax has " + str(absmax.numel()) + " bytes, expected " +
              str(units * 128) + " (pass the output of kbit::repack)");
  TORCH_CHECK(codebook.numel() == (int64_t(1) << bits), o + "codebook has " + str(codebook.numel()) + " entries, bits=" +
              str(bits) + " needs " + str(int64_t(1) << bits));
}

std::tuple<at::Tensor, at::Tensor> quantize_act_fp8(const at::Tensor& x, int64_t bits) {
  TORCH_CHECK(bits == 0 || (bits >= 2 && bits <= 5),
              "kbit::quantize_act_fp8: bits must be 2, 3, 4 or 5 (the GEMM's k order), or 0 (natural order), got " +
                  str(bits));
  TORCH_CHECK(x.dim() == 2, "kbit::quantize_act_fp8: x must be 2-D [M, K]");
  check_dense(x, "quantize_act_fp8", "x", x.scalar_type(), x);
  const DType dt = out_type(x.scalar_type(), "quantize_act_fp8");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k > 0 && k % 32 == 0, "kbit::quantize_act_fp8: x has " + str(k) + " columns, not a positive multiple of 32");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "kbit::quantize_act_fp8: x must be 16-byte aligned");
  TORCH_CHECK(m < (int64_t(1) << 31), "kbit::quantize_act_fp8: too many rows");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale = at::empty({m}, x.options().dtype(at::kFloat));
  if (m == 0) return {xq, scale};
  TORCH_CHECK(quantize_supported(), "kbit::quantize_act_fp8: needs a build with TORCH_CUDA_ARCH_LIST containing 9.0a "
              "and a compute capability 9.0 GPU");
  check_cuda(launch_quantize_act(dt, x.data_ptr(), static_cast<uint8_t*>(xq.data_ptr()), scale.data_ptr<float>(), int(m),
                                 int(k), int(bits), at::cuda::getCurrentCUDAStream()),
             "quantize_act_fp8");
  return {xq, scale};
}

at::Tensor decode_fp8(const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook, int64_t bits,
                      int64_t n, int64_t k, int64_t w_exp) {
  check_weight("decode_fp8", packed, absmax, codebook, bits, n, k, w_exp, packed);
  const c10::cuda::CUDAGuard guard(packed.device());
  at::Tensor w = at::empty({n, k}, packed.options().dtype(at::kFloat8_e4m3fn));
  check_cuda(launch_decode_fp8(reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()), absmax.data_ptr<uint8_t>(),
                               codebook.data_ptr<float>(), int(w_exp), static_cast<uint8_t*>(w.data_ptr()), int(n),
                               int(k), int(bits), at::cuda::getCurrentCUDAStream()),
             "decode_fp8");
  return w;
}

at::Tensor gemm_fp8_quantized(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& packed,
                              const at::Tensor& absmax, const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k,
                              int64_t w_exp, at::ScalarType dtype, const c10::optional<at::Tensor>& bias,
                              c10::string_view overrides) {
  const char* op = "gemm_fp8";
  const DType dt = out_type(dtype, op);
  const Fp8Overrides o = fp8_overrides(overrides, "gemm_fp8_quantized");
  TORCH_CHECK(xq.dim() == 2 && xq.size(1) == k, "kbit::gemm_fp8: x_q must be [M, k = " + str(k) + "]");
  check_dense(xq, op, "x_q", at::kFloat8_e4m3fn, xq);
  check_dense(x_scale, op, "x_scale", at::kFloat, xq);
  TORCH_CHECK(x_scale.numel() == xq.size(0), "kbit::gemm_fp8: x_scale has " + str(x_scale.numel()) +
              " entries, x_q has " + str(xq.size(0)) + " rows");
  TORCH_CHECK(xq.size(0) < (int64_t(1) << 31), "kbit::gemm_fp8: too many rows");
  check_weight(op, packed, absmax, codebook, bits, n, k, w_exp, xq);
  const at::Tensor* b = bias.has_value() && bias->defined() ? &*bias : nullptr;
  if (b != nullptr) {
    check_dense(*b, op, "bias", dtype, xq);
    TORCH_CHECK(b->numel() == n, "kbit::gemm_fp8: bias has " + str(b->numel()) + " elements, expected n = " + str(n));
  }
  const c10::cuda::CUDAGuard guard(xq.device());
  at::Tensor y = at::empty({xq.size(0), n}, xq.options().dtype(dtype));
  if (xq.size(0) == 0) return y;
  TORCH_CHECK(gemm_supported(), "kbit::gemm_fp8: needs a build with TORCH_CUDA_ARCH_LIST containing 9.0a and a "
              "compute capability 9.0 GPU");
  GemmArgs a;
  a.xq = static_cast<const uint8_t*>(xq.data_ptr());
  a.x_scale = x_scale.data_ptr<float>();
  a.packed = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  a.absmax = absmax.data_ptr<uint8_t>();
  a.codebook = codebook.data_ptr<float>();
  a.bias = b != nullptr ? b->data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.m = int(xq.size(0)); a.n = int(n); a.k = int(k); a.bits = int(bits); a.w_exp = int(w_exp);
  a.dtype = dt;
  const int sms = at::cuda::getDeviceProperties(xq.device().index())->multiProcessorCount;
  const Fp8Plan p = plan(device_heuristics(), a.m, a.n, a.bits, dt, sms, o);
  check_cuda(launch_gemm(p.key, a, at::cuda::getCurrentCUDAStream()), op);
  return y;
}

// vLLM's CUTLASS FP8 GEMM, torch.ops._C.cutlass_scaled_mm(out, a, b, a_scales, b_scales, bias?),
// where vLLM's extension is loaded in this process (looked up on every call: it may load later).
c10::optional<c10::OperatorHandle> vllm_scaled_mm() {
  return c10::Dispatcher::singleton().findSchema({"_C::cutlass_scaled_mm", ""});
}

// Whether an FP8 GEMM with per-token x scales serves an [*, n] output of `dtype`: vLLM's (fp16 and
// bf16, n % 16 == 0), else torch's row-wise _scaled_mm (bf16 output only).
bool scaled_mm_at_hand(at::ScalarType dtype, int64_t n) {
  if (n % 16 != 0) return false;
  return vllm_scaled_mm().has_value() || dtype == at::kBFloat16;
}

// The decode-first path: W to e4m3 once (decode_fp8: the fused kernel's rounding), x per token in
// natural k order, one FP8 GEMM: y = (x_q @ w_q^T) * s_x[m] * 2^-r (+ bias), fp32 accumulation.
at::Tensor gemm_fp8_decoded(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                            const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k, int64_t w_exp,
                            const at::Tensor* bias) {
  const auto [xq, sx] = quantize_act_fp8(x, 0);
  const at::Tensor wq = decode_fp8(packed, absmax, codebook, bits, n, k, w_exp);
  const at::Tensor sa = sx.view({-1, 1});
  const double w_scale = std::ldexp(1.0, -int(w_exp));
  if (const auto op = vllm_scaled_mm()) {
    at::Tensor y = at::empty({x.size(0), n}, x.options());
    const at::Tensor sb = at::full({1}, w_scale, sx.options());
    torch::jit::Stack stack{y, xq, wq.t(), sa, sb, bias != nullptr ? c10::IValue(*bias) : c10::IValue()};
    op->callBoxed(&stack);
    return y;
  }
  // torch's row-wise scaling: bf16 output, the bias added before the one output rounding
  const at::Tensor sb = at::full({1, n}, w_scale, sx.options());
  const c10::optional<at::Tensor> b = bias != nullptr ? c10::optional<at::Tensor>(*bias) : c10::nullopt;
  return at::_scaled_mm(xq, wq.t(), sa, sb, b, c10::nullopt, x.scalar_type(), false);
}

// The 16-bit path: kbit::gemm (binding.cpp), through the dispatcher.
at::Tensor gemm_16bit(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                      const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k,
                      const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("kbit::gemm", "");
  torch::jit::Stack stack{x, packed, absmax, codebook, bits, n, k, bias};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

Fp8Plan plan_for(int64_t m, int64_t n, int64_t bits, at::ScalarType dtype, const Fp8Overrides& o, const char* op) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return plan(device_heuristics(), int(m), int(n), int(bits), out_type(dtype, op), sms, o, scaled_mm_at_hand(dtype, n));
}

at::Tensor gemm_fp8_planned(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                            const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k, int64_t w_exp,
                            const c10::optional<at::Tensor>& bias, const Fp8Overrides& o, c10::string_view overrides) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "kbit::gemm_fp8: x must be [M, k = " + str(k) + "]");
  check_weight("gemm_fp8", packed, absmax, codebook, bits, n, k, w_exp, x);
  const at::Tensor* b = bias.has_value() && bias->defined() ? &*bias : nullptr;
  if (b != nullptr) {
    check_dense(*b, "gemm_fp8", "bias", x.scalar_type(), x);
    TORCH_CHECK(b->numel() == n, "kbit::gemm_fp8: bias has " + str(b->numel()) + " elements, expected n = " + str(n));
  }
  if (x.size(0) > 0) {
    const c10::cuda::CUDAGuard guard(x.device());
    const Path path = plan_for(x.size(0), n, bits, x.scalar_type(), o, "gemm_fp8").path;
    if (path == Path::kDecodeFirst) return gemm_fp8_decoded(x, packed, absmax, codebook, bits, n, k, w_exp, b);
    if (path == Path::kSixteenBit) return gemm_16bit(x, packed, absmax, codebook, bits, n, k, bias);
  }
  const auto [xq, scale] = quantize_act_fp8(x, bits);
  return gemm_fp8_quantized(xq, scale, packed, absmax, codebook, bits, n, k, w_exp, x.scalar_type(), bias, overrides);
}

at::Tensor gemm_fp8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook,
                    int64_t bits, int64_t n, int64_t k, int64_t w_exp, const c10::optional<at::Tensor>& bias) {
  return gemm_fp8_planned(x, packed, absmax, codebook, bits, n, k, w_exp, bias, Fp8Overrides{}, "");
}

// kbit::gemm_fp8 with plan overrides (fp8.path forces the path, fp8.tile_m / tile_n the fused
// kernel's tile): the tests' and benchmarks' hook.
at::Tensor gemm_fp8_path(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                         const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k, int64_t w_exp,
                         const c10::optional<at::Tensor>& bias, c10::string_view overrides) {
  const Fp8Overrides o = fp8_overrides(overrides, "gemm_fp8_path");
  return gemm_fp8_planned(x, packed, absmax, codebook, bits, n, k, w_exp, bias, o, overrides);
}

// The plan kbit::gemm_fp8_quantized(..., overrides) launches for this shape on the current device
// (kbit::gemm_fp8's with no overrides), as the list of dispatch/plan_fields.h's fields.
std::vector<int64_t> fp8_plan(int64_t m, int64_t n, int64_t k, int64_t bits, at::ScalarType dtype,
                              c10::string_view overrides) {
  TORCH_CHECK(bits >= 2 && bits <= 5, "kbit::fp8_plan: bits must be 2, 3, 4 or 5, got " + str(bits));
  TORCH_CHECK(m > 0 && m < (int64_t(1) << 31) && n > 0 && n < (int64_t(1) << 31) && k > 0 && k % 32 == 0,
              "kbit::fp8_plan: bad shape (m " + str(m) + ", n " + str(n) + ", k " + str(k) + ")");
  const Fp8Overrides o = fp8_overrides(overrides, "fp8_plan");
  return field_values(fp8_plan_fields(plan_for(m, n, bits, dtype, o, "fp8_plan")));
}

// Whether this build and device run the FP8 GEMM and its activation quantizer.
bool has_fp8() { return gemm_supported() && quantize_supported(); }

}  // namespace
}  // namespace fp8
}  // namespace kbit

TORCH_LIBRARY_FRAGMENT(kbit, m) {
  m.def("fp8_plan(int m, int n, int k, int bits, ScalarType dtype, str overrides=\"\") -> int[]", &kbit::fp8::fp8_plan);
  m.def("has_fp8() -> bool", &kbit::fp8::has_fp8);
}

TORCH_LIBRARY_IMPL(kbit, CUDA, m) {
  m.impl("quantize_act_fp8", &kbit::fp8::quantize_act_fp8);
  m.impl("gemm_fp8", &kbit::fp8::gemm_fp8);
  m.impl("gemm_fp8_quantized", &kbit::fp8::gemm_fp8_quantized);
  m.impl("decode_fp8", &kbit::fp8::decode_fp8);
  m.impl("gemm_fp8_path", &kbit::fp8::gemm_fp8_path);
}
