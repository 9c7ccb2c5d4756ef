// The one torch binding of the kbit kernels: checks, allocation with the torch allocator, one
// plan per call, launch on the current stream, launch-error check. Schemas of kbit::repack /
// gemm / quantize / moe_gemm / moe_gemm_grouped / dequantize_experts are defined in Python
// (vllm_kbit/ops.py); this file registers their CUDA kernels and adds C++-only ops for tests and benchmarks
// (TORCH_LIBRARY_FRAGMENT below).
//
// gemm picks its path from the shape inside the op (dispatch/path_rule.h), with no host sync
// and a grid that depends on shapes only, so it can be captured in a CUDA graph and is opaque
// to torch.compile. gemm_path forces a path and takes plan overrides (dispatch/overrides.h).
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <atomic>
#include <map>
#include <optional>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dispatch/launchers.h"
#include "dispatch/overrides.h"
#include "dispatch/plan_fields.h"
#include "moe/grouped_config.h"
#include "moe/moe_launchers.h"

namespace kbit {
namespace {

constexpr int64_t kBlockSize = 32;
constexpr int64_t kUnit = 64;


// Error messages are assembled here with std::to_string, never with iostreams: an ostream
// number insertion from this library can crash where the std::num_put facet is looked up from
// this .so's own template instance. c10::str of a single std::string, which TORCH_CHECK then
// does, takes no ostream path.
void append(std::string& s, const char* v) { s += v; }
void append(std::string& s, at::ScalarType v) { s += c10::toString(v); }
void append(std::string& s, const c10::Device& v) { s += v.str(); }
void append(std::string& s, at::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += "]";
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void append(std::string& s, T v) { s += std::to_string(v); }
template <typename... A>
std::string msg(const A&... a) {
  std::string s;
  (append(s, a), ...);
  return s;
}

// The arch rule, separate from the device query so a test can reach the error path.
void check_arch(int64_t major, int64_t minor) {
  TORCH_CHECK(major >= 8, msg("kbit CUDA kernels need compute capability 8.0 (Ampere) or newer; this GPU is sm_",
              major, minor, ". Use the PyTorch reference path (VLLM_KBIT_REFERENCE=1) on older GPUs."));
}

const cudaDeviceProp& device_props(const at::Tensor& t) {
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(t.device().index());
  check_arch(p->major, p->minor);
  return *p;
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, msg("kbit::", what, ": CUDA error: ", cudaGetErrorString(err)));
}

void check_bits(int64_t bits) {
  TORCH_CHECK(bits >= 2 && bits <= 5, msg("kbit: bits must be 2, 3, 4 or 5, got ", bits));
}

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Tensor& ref,
                  int64_t align = 16) {
  TORCH_CHECK(t.is_cuda(), msg("kbit: ", name, " must be a CUDA tensor"));
  TORCH_CHECK(t.device() == ref.device(), msg("kbit: ", name, " is on ", t.device(), " but the input is on ",
              ref.device()));
  TORCH_CHECK(t.scalar_type() == dtype, msg("kbit: ", name, " must be ", dtype, ", got ", t.scalar_type()));
  TORCH_CHECK(t.is_contiguous(), msg("kbit: ", name, " must be contiguous"));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % align == 0, msg("kbit: ", name, " must be ", align,
              "-byte aligned"));
}

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return DType::kHalf;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat: return DType::kFloat32;
    default: TORCH_CHECK(false, msg("kbit: unsupported dtype ", t));
  }
  return DType::kHalf;
}

int64_t units(int64_t n, int64_t k) { return ((n + kUnit - 1) / kUnit) * ((k + kUnit - 1) / kUnit); }

void check_codebook(const at::Tensor& codebook, int64_t bits, const at::Tensor& ref) {
  check_tensor(codebook, "codebook", at::kFloat, ref);
  TORCH_CHECK(codebook.numel() == (int64_t(1) << bits), msg("kbit: codebook has ", codebook.numel(),
              " entries, bits=", bits, " needs ", int64_t(1) << bits));
}

// ---------------------------------------------------------------------------------- repack

std::tuple<at::Tensor, at::Tensor> repack(const at::Tensor& qweight, const at::Tensor& absmax, int64_t bits) {
  check_bits(bits);
  check_tensor(qweight, "qweight", at::kInt, qweight);
  check_tensor(absmax, "absmax", at::kByte, qweight);
  device_props(qweight);
  TORCH_CHECK(absmax.dim() == 2 && qweight.dim() == 2, msg("kbit::repack: qweight and absmax must be 2-D"));
  const int64_t n = absmax.size(0), nb = absmax.size(1);
  TORCH_CHECK(n > 0 && nb > 0, msg("kbit::repack: empty weight"));
  TORCH_CHECK(qweight.size(0) == n && qweight.size(1) == nb * bits, msg("kbit::repack: qweight shape ",
              qweight.sizes(), " does not match absmax ", absmax.sizes(), " for bits=", bits));
  const int64_t k = nb * kBlockSize;
  TORCH_CHECK(n < (int64_t(1) << 31) && k < (int64_t(1) << 31), msg("kbit::repack: weight too large"));
  const c10::cuda::CUDAGuard guard(qweight.device());
  const int64_t u = units(n, k);
  at::Tensor packed = at::empty({u * bits * 128}, qweight.options());
  at::Tensor absmax_packed = at::empty({u * 128}, absmax.options());
  check_cuda(launch_repack(reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>()), absmax.data_ptr<uint8_t>(),
                           reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>()), absmax_packed.data_ptr<uint8_t>(),
                           int(n), int(k), int(bits), at::cuda::getCurrentCUDAStream()),
             "repack");
  return {packed, absmax_packed};
}

// ---------------------------------------------------------------------------------- quantize

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& weight, const at::Tensor& codebook, int64_t bits) {
  check_bits(bits);
  TORCH_CHECK(weight.is_cuda() && weight.dim() == 2, msg("kbit::quantize: weight must be a 2-D CUDA tensor"));
  check_tensor(weight, "weight", weight.scalar_type(), weight, /*align=*/4);
  check_codebook(codebook, bits, weight);
  device_props(weight);
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % kBlockSize == 0, msg("kbit::quantize: in_features ", k, " is not a multiple of 32"));
  TORCH_CHECK(n < (int64_t(1) << 31) && k < (int64_t(1) << 31), msg("kbit::quantize: weight too large"));
  const DType dt = to_dtype(weight.scalar_type());
  const c10::cuda::CUDAGuard guard(weight.device());
  at::Tensor qweight = at::empty({n, k / kBlockSize * bits}, weight.options().dtype(at::kInt));
  at::Tensor absmax = at::empty({n, k / kBlockSize}, weight.options().dtype(at::kByte));
  if (n == 0 || k == 0) return {qweight, absmax};
  check_cuda(launch_quantize(dt, weight.data_ptr(), codebook.data_ptr<float>(),
                             reinterpret_cast<uint32_t*>(qweight.data_ptr<int32_t>()), absmax.data_ptr<uint8_t>(),
                             int(n), int(k), int(bits), at::cuda::getCurrentCUDAStream()),
             "quantize");
  return {qweight, absmax};
}

// ---------------------------------------------------------------------------------- gemm

struct GemmArgs {
  int64_t m, n, k;
  DType dtype;
};

GemmArgs check_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                    const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k,
                    const c10::optional<at::Tensor>& bias) {
  check_bits(bits);
  TORCH_CHECK(x.is_cuda(), msg("kbit::gemm: x must be a CUDA tensor"));
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              msg("kbit::gemm: x must be float16 or bfloat16, got ", x.scalar_type()));
  TORCH_CHECK(x.dim() == 2, msg("kbit::gemm: x must be 2-D [M, K], got ", x.sizes()));
  check_tensor(x, "x", x.scalar_type(), x);
  TORCH_CHECK(k > 0 && k % kBlockSize == 0, msg("kbit::gemm: k = ", k, " must be a positive multiple of 32"));
  TORCH_CHECK(n > 0, msg("kbit::gemm: n must be positive"));
  TORCH_CHECK(n < (int64_t(1) << 31) && k < (int64_t(1) << 31), msg("kbit::gemm: weight too large"));
  TORCH_CHECK(x.size(1) == k, msg("kbit::gemm: x has ", x.size(1), " columns, expected k = ", k));
  TORCH_CHECK(x.size(0) < (int64_t(1) << 31), msg("kbit::gemm: too many rows"));
  check_tensor(packed, "packed", at::kInt, x);
  check_tensor(absmax, "absmax", at::kByte, x);
  const int64_t u = units(n, k);
  TORCH_CHECK(packed.numel() == u * bits * 128, msg("kbit::gemm: packed has ", packed.numel(),
              " words, the tiled layout of ", n, "x", k, " at bits=", bits, " has ", u * bits * 128,
              " (pass the output of kbit::repack)"));
  TORCH_CHECK(absmax.numel() == u * 128, msg("kbit::gemm: absmax has ", absmax.numel(), " bytes, expected ", u * 128,
              " (pass the output of kbit::repack)"));
  check_codebook(codebook, bits, x);
  if (bias.has_value() && bias->defined()) {
    check_tensor(*bias, "bias", x.scalar_type(), x, /*align=*/2);
    TORCH_CHECK(bias->numel() == n, msg("kbit::gemm: bias has ", bias->numel(), " elements, expected n = ", n));
  }
  device_props(x);
  return {x.size(0), n, k, to_dtype(x.scalar_type())};
}

// Large-M path: dequantize row chunks of W into a bounded scratch and multiply with cuBLAS. As
// few chunks as the budget allows, of equal size up to 64-row rounding (the last takes the
// rest): uneven chunks measured slower, and fewer rows per cuBLAS call lose more than a chunk
// that fits the L2 saves.
void gemm_dequant(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook,
                  int64_t bits, const GemmArgs& a, const at::Tensor* bias, at::Tensor& y, const PlanOverrides& o) {
  const int64_t budget = (o.dequant_chunk_mib > 0 ? o.dequant_chunk_mib : kDequantChunkMib) << 20;
  const int64_t max_rows = std::max<int64_t>(kUnit, budget / (a.k * int64_t(x.element_size())) / kUnit * kUnit);
  const int64_t chunks = (a.n + max_rows - 1) / max_rows;
  int64_t rows = ((a.n + chunks - 1) / chunks + kUnit - 1) / kUnit * kUnit;
  if (rows > a.n) rows = a.n;
  at::Tensor w = at::empty({rows, a.k}, x.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int64_t n0 = 0; n0 < a.n; n0 += rows) {
    const int64_t len = std::min(rows, a.n - n0);
    at::Tensor wc = w.narrow(0, 0, len);
    check_cuda(launch_dequantize(a.dtype, reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
                                 absmax.data_ptr<uint8_t>(), codebook.data_ptr<float>(), wc.data_ptr(), int(n0),
                                 int(n0 + len), int(a.k), int(bits), stream),
               "gemm (dequantize)");
    at::Tensor yc = y.narrow(1, n0, len);
    if (bias != nullptr)
      at::addmm_out(yc, bias->narrow(0, n0, len).unsqueeze(0).expand({a.m, len}), x, wc.t());
    else
      at::mm_out(yc, x, wc.t());
  }
}

// The path kbit::gemm takes (dispatch/path_rule.h). Between wgmma_short_max_m and wgmma_max_m the
// rule asks the wgmma plan, which is kept in *wgmma_plan for the launch (computed once a call).
Path auto_path(DType dtype, int64_t m, int64_t n, int64_t k, int64_t bits, int num_sms, const PlanOverrides& o,
               std::optional<WgmmaPlan>* wgmma_plan) {
  return choose_path(device_heuristics(), m, int(bits), wgmma_supported(), has_mma(), [&] {
    *wgmma_plan = plan_wgmma(dtype, int(m), int(n), int(k), int(bits), num_sms, 0, o);
    return (*wgmma_plan)->tile_m() == 256;
  });
}

// What one kbit::gemm_path call runs: its path, and the plan (naming the kernel) of that path.
struct CallPlan {
  Path path = kDequantPath;
  GemvPlan gemv;
  MmaPlan mma{};
  WgmmaPlan wgmma;
};

// The path and plan of a call (kbit::gemm_path's rules: kAutoPath with forced splits, a tuning
// call, chooses the path as for splits = 0).
CallPlan plan_call(DType dtype, int64_t m, int64_t n, int64_t k, int64_t bits, int num_sms, int64_t path_arg,
                   int64_t splits, const PlanOverrides& o) {
  CallPlan c;
  std::optional<WgmmaPlan> wgmma_plan;
  c.path = path_arg == kAutoPath ? auto_path(dtype, m, n, k, bits, num_sms, o, &wgmma_plan) : Path(path_arg);
  TORCH_CHECK(c.path != kWgmmaPath || wgmma_supported(), msg("kbit::gemm_path: the wgmma path needs a build with ",
              "TORCH_CUDA_ARCH_LIST containing 9.0a and a compute capability 9.0 GPU"));
  TORCH_CHECK(c.path != kGemvPath || m <= kGemvMaxM, msg("kbit::gemm_path: the GEMV path serves M <= ", kGemvMaxM,
              ", got M = ", m));
  switch (c.path) {
    case kGemvPath:
      c.gemv = plan_gemv(dtype, int(m), int(n), int(k), int(bits), num_sms, int(splits), o);
      break;
    case kMmaPath:
      c.mma = plan_mma(dtype, int(m), int(n), int(k), int(bits), num_sms, o.mma);
      break;
    case kWgmmaPath:
      c.wgmma = wgmma_plan && splits == 0 ? *wgmma_plan
                                          : plan_wgmma(dtype, int(m), int(n), int(k), int(bits), num_sms, int(splits), o);
      break;
    default:
      break;
  }
  return c;
}

// The kernel a call plan launches, as core/kernel_keys.h describes keys.
std::string describe(const CallPlan& c, DType dtype, int64_t bits) {
  switch (c.path) {
    case kGemvPath: return describe(c.gemv.key);
    case kMmaPath: return describe(c.mma.key);
    case kWgmmaPath: return describe(c.wgmma.key);
    default: {
      DequantKey key;
      key.bits = int(bits);
      key.dtype = dtype;
      return describe(key) + " + cublas";
    }
  }
}

// The wgmma kernel's cluster-group counters: one zeroed int32 buffer per device and stream, left
// zero by every launch (the last CTA at a counter resets it), so a launch needs no memset before
// it (a memset node before each launch costs more than the cluster groups gain on small layers).
// Per stream, because launches on two streams may overlap; launches on one stream do not touch
// them at once (a kernel reaches its epilogue only after griddepcontrol.wait, so after the kernel
// before it has finished). Allocated by the first call on a stream outside CUDA-graph capture,
// whatever its path: vLLM captures on the stream its eager profile run used. A call on a stream
// without one (first call under capture) zeroes counters in its own workspace instead. A graph
// replayed on another stream than it was captured on uses the capture stream's counters.
//
// Every GEMM asks, so the lookup is lock-free: per device, the first kCounterSlots streams sit
// in an append-only table published by a release store of its length; more streams, and the
// allocation itself, go through a mutex.
constexpr int kCounterDevices = 64, kCounterSlots = 8;
struct CounterTable {
  std::atomic<int> filled{0};
  cudaStream_t streams[kCounterSlots] = {};
  int* counters[kCounterSlots] = {};
};
CounterTable counter_tables[kCounterDevices];

int* zeroed_counters_slow(const at::Tensor& like, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, int*> overflow;
  const int dev = int(like.get_device());
  CounterTable& table = counter_tables[dev];
  const std::lock_guard<std::mutex> lock(mu);
  const int filled = table.filled.load(std::memory_order_relaxed);
  for (int i = 0; i < filled; ++i)
    if (table.streams[i] == stream) return table.counters[i];
  const auto it = overflow.find({dev, stream});
  if (it != overflow.end()) return it->second;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone)
    return nullptr;
  // never freed: the buffers outlive the context at exit
  at::Tensor* buf = new at::Tensor(at::zeros({kWgmmaZeroedCounters}, like.options().dtype(at::kInt)));
  int* counters = buf->data_ptr<int>();
  if (filled < kCounterSlots) {
    table.streams[filled] = stream;
    table.counters[filled] = counters;
    table.filled.store(filled + 1, std::memory_order_release);
  } else {
    overflow.emplace(std::make_pair(dev, stream), counters);
  }
  return counters;
}

int* zeroed_counters(const at::Tensor& like, cudaStream_t stream) {
  const int dev = int(like.get_device());
  if (dev < 0 || dev >= kCounterDevices) return nullptr;
  const CounterTable& table = counter_tables[dev];
  const int filled = table.filled.load(std::memory_order_acquire);
  for (int i = 0; i < filled; ++i)
    if (table.streams[i] == stream) return table.counters[i];
  return zeroed_counters_slow(like, stream);
}

void* workspace_ptr(at::Tensor& ws, size_t bytes, const at::Tensor& like) {
  if (bytes == 0) return nullptr;
  ws = at::empty({int64_t(bytes)}, like.options().dtype(at::kByte));
  return ws.data_ptr();
}

at::Tensor gemm_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                     const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k,
                     const c10::optional<at::Tensor>& bias_opt, int64_t path_arg, int64_t splits,
                     const PlanOverrides& o) {
  const GemmArgs a = check_gemm(x, packed, absmax, codebook, bits, n, k, bias_opt);
  TORCH_CHECK(path_arg >= kAutoPath && path_arg <= kWgmmaPath,
              msg("kbit::gemm_path: path must be 0..4, got ", path_arg));
  TORCH_CHECK(splits >= 0 && splits <= 16, msg("kbit::gemm_path: splits must be 0..16 (the GEMV takes at most 8)"));
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({a.m, a.n}, x.options());
  if (a.m == 0) return y;
  const at::Tensor* bias = bias_opt.has_value() && bias_opt->defined() ? &*bias_opt : nullptr;
  const int num_sms = device_props(x).multiProcessorCount;
  const CallPlan plan = plan_call(a.dtype, a.m, a.n, a.k, bits, num_sms, path_arg, splits, o);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // (on any path: the first eager call allocates them, dispatch may reach wgmma under capture)
  int* const counters = wgmma_supported() && o.wgmma.zeroed_counters ? zeroed_counters(x, stream) : nullptr;
  const GemmOperands ops = {a.dtype, x.data_ptr(), reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
                            absmax.data_ptr<uint8_t>(), codebook.data_ptr<float>(),
                            bias != nullptr ? bias->data_ptr() : nullptr, y.data_ptr(),
                            int(a.m), int(a.n), int(a.k), int(bits)};
  at::Tensor ws;
  switch (plan.path) {
    case kGemvPath:
      check_cuda(launch_gemv(plan.gemv, ops, stream), "gemm (gemv)");
      break;
    case kMmaPath: {
      void* w = workspace_ptr(ws, mma_workspace_bytes(plan.mma), x);
      check_cuda(launch_mma(plan.mma, ops, w, stream), "gemm (mma)");
      break;
    }
    case kWgmmaPath: {
      void* w = workspace_ptr(ws, wg::workspace_bytes(plan.wgmma), x);
      check_cuda(launch_wgmma(plan.wgmma, ops, w, counters, stream), "gemm (wgmma)");
      break;
    }
    default:
      gemm_dequant(x, packed, absmax, codebook, bits, a, bias, y, o);
  }
  return y;
}

PlanOverrides overrides_from(const std::string& text, const char* op) {
  PlanOverrides o;
  const std::string err = parse_overrides(text, &o);
  TORCH_CHECK(err.empty(), msg("kbit::", op, ": ", err.c_str()));
  return o;
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook,
                int64_t bits, int64_t n, int64_t k, const c10::optional<at::Tensor>& bias) {
  static const PlanOverrides defaults;
  return gemm_impl(x, packed, absmax, codebook, bits, n, k, bias, kAutoPath, 0, defaults);
}

at::Tensor gemm_path(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                     const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k,
                     const c10::optional<at::Tensor>& bias, int64_t path, int64_t splits, c10::string_view overrides) {
  const PlanOverrides o = overrides_from(std::string(overrides), "gemm_path");
  return gemm_impl(x, packed, absmax, codebook, bits, n, k, bias, path, splits, o);
}

// Tiled layout -> W[n, k] (test hook for launch_dequantize).
at::Tensor dequantize_tiled(const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook,
                            int64_t bits, int64_t n, int64_t k, at::ScalarType dtype) {
  check_bits(bits);
  check_tensor(packed, "packed", at::kInt, packed);
  check_tensor(absmax, "absmax", at::kByte, packed);
  check_codebook(codebook, bits, packed);
  device_props(packed);
  TORCH_CHECK(n > 0 && k > 0 && k % kBlockSize == 0, msg("kbit::dequantize_tiled: bad shape"));
  TORCH_CHECK(packed.numel() == units(n, k) * bits * 128 && absmax.numel() == units(n, k) * 128,
              msg("kbit::dequantize_tiled: layout size does not match n, k, bits"));
  const DType dt = to_dtype(dtype);
  const c10::cuda::CUDAGuard guard(packed.device());
  at::Tensor w = at::empty({n, k}, packed.options().dtype(dtype));
  check_cuda(launch_dequantize(dt, reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
                               absmax.data_ptr<uint8_t>(), codebook.data_ptr<float>(), w.data_ptr(), 0, int(n), int(k),
                               int(bits), at::cuda::getCurrentCUDAStream()),
             "dequantize_tiled");
  return w;
}

// ---------------------------------------------------------------------------------- MoE experts

// Stacked tiled experts: packed int32 [E, units * bits * 128], absmax uint8 [E, units * 128]
// (row e = kbit::repack of expert e). Returns E.
int64_t check_experts(const char* op, const at::Tensor& packed, const at::Tensor& absmax, int64_t bits, int64_t n,
                      int64_t k, const at::Tensor& ref) {
  check_bits(bits);
  check_tensor(packed, "packed", at::kInt, ref);
  check_tensor(absmax, "absmax", at::kByte, ref);
  TORCH_CHECK(k > 0 && k % kBlockSize == 0, msg("kbit::", op, ": k = ", k, " must be a positive multiple of 32"));
  TORCH_CHECK(n > 0, msg("kbit::", op, ": n must be positive"));
  TORCH_CHECK(n <= int64_t(65535) * kUnit && k < (int64_t(1) << 31), msg("kbit::", op, ": expert weight too large"));
  TORCH_CHECK(packed.dim() == 2 && absmax.dim() == 2, msg("kbit::", op, ": packed and absmax must be the stacked ",
              "tiled experts [E, words] / [E, bytes], got ", packed.sizes(), " and ", absmax.sizes()));
  const int64_t e = packed.size(0), u = units(n, k);
  TORCH_CHECK(e > 0 && e <= 65535, msg("kbit::", op, ": packed has ", e, " experts, expected 1..65535"));
  TORCH_CHECK(packed.size(1) == u * bits * 128, msg("kbit::", op, ": packed has ", packed.size(1), " words an expert, ",
              "the tiled layout of ", n, "x", k, " at bits=", bits, " has ", u * bits * 128,
              " (stack the outputs of kbit::repack)"));
  TORCH_CHECK(absmax.size(0) == e && absmax.size(1) == u * 128, msg("kbit::", op, ": absmax has shape ",
              absmax.sizes(), ", expected [", e, ", ", u * 128, "] (stack the outputs of kbit::repack)"));
  device_props(ref);
  return e;
}

// The experts' codebook: float32 [2^bits], one for all E experts, or [E, 2^bits], one per
// expert (convert --fit-codebook). Returns the launchers' codebook stride: 0 or 2^bits.
int check_expert_codebook(const char* op, const at::Tensor& codebook, int64_t bits, int64_t e, const at::Tensor& ref) {
  check_tensor(codebook, "codebook", at::kFloat, ref);
  const int64_t entries = int64_t(1) << bits;
  const bool shared = codebook.dim() == 1 && codebook.size(0) == entries;
  const bool per_expert = codebook.dim() == 2 && codebook.size(0) == e && codebook.size(1) == entries;
  TORCH_CHECK(shared || per_expert, msg("kbit::", op, ": codebook has shape ", codebook.sizes(), "; bits=", bits,
              " needs [", entries, "] (one for all experts) or [E = ", e, ", ", entries, "] (one per expert)"));
  return per_expert ? int(entries) : 0;
}

void check_index(const char* op, const at::Tensor& t, const char* name, const at::Tensor& ref) {
  check_tensor(t, name, at::kInt, ref, /*align=*/4);
  TORCH_CHECK(t.dim() == 1, msg("kbit::", op, ": ", name, " must be 1-D, got ", t.sizes()));
}

// The checks kbit::moe_gemm and kbit::moe_gemm_grouped share (x, the stacked experts, their
// codebook, vLLM's alignment output, topk_weights) and what the launchers take of them.
struct MoeCall {
  int64_t experts, num_pairs, num_sorted;
  int cb_stride;
  const float* weights;
};

MoeCall check_moe_call(const char* op, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                       const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k,
                       const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                       const at::Tensor& num_tokens_post_padded, int64_t block_m, int64_t top_k,
                       const c10::optional<at::Tensor>& topk_weights) {
  TORCH_CHECK(x.is_cuda(), msg("kbit::", op, ": x must be a CUDA tensor"));
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              msg("kbit::", op, ": x must be float16 or bfloat16, got ", x.scalar_type()));
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, msg("kbit::", op, ": x must be [T, k = ", k, "], got ", x.sizes()));
  check_tensor(x, "x", x.scalar_type(), x);
  MoeCall c;
  c.experts = check_experts(op, packed, absmax, bits, n, k, x);
  c.cb_stride = check_expert_codebook(op, codebook, bits, c.experts, x);
  check_index(op, sorted_token_ids, "sorted_token_ids", x);
  check_index(op, expert_ids, "expert_ids", x);
  check_index(op, num_tokens_post_padded, "num_tokens_post_padded", x);
  TORCH_CHECK(block_m >= 1, msg("kbit::", op, ": block_m must be positive, got ", block_m));
  TORCH_CHECK(top_k >= 1, msg("kbit::", op, ": top_k must be positive, got ", top_k));
  c.num_sorted = sorted_token_ids.size(0);
  const int64_t num_blocks = (c.num_sorted + block_m - 1) / block_m;
  TORCH_CHECK(expert_ids.size(0) >= num_blocks, msg("kbit::", op, ": expert_ids has ", expert_ids.size(0),
              " entries, the ", c.num_sorted, " sorted ids make ", num_blocks, " blocks of block_m = ", block_m));
  TORCH_CHECK(num_tokens_post_padded.size(0) >= 1, msg("kbit::", op, ": num_tokens_post_padded is empty"));
  c.num_pairs = x.size(0) * top_k;
  TORCH_CHECK(c.num_pairs < (int64_t(1) << 31) && c.num_pairs * n < (int64_t(1) << 62) &&
              c.num_sorted < (int64_t(1) << 31), msg("kbit::", op, ": too many pairs"));
  c.weights = nullptr;
  if (topk_weights.has_value() && topk_weights->defined()) {
    check_tensor(*topk_weights, "topk_weights", at::kFloat, x, /*align=*/4);
    TORCH_CHECK(topk_weights->numel() == c.num_pairs, msg("kbit::", op, ": topk_weights has ", topk_weights->numel(),
                " elements, expected T * top_k = ", c.num_pairs));
    c.weights = topk_weights->data_ptr<float>();
  }
  return c;
}

at::Tensor moe_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook,
                    int64_t bits, int64_t n, int64_t k, const at::Tensor& sorted_token_ids,
                    const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded, int64_t block_m,
                    int64_t top_k, const c10::optional<at::Tensor>& topk_weights) {
  const MoeCall c = check_moe_call("moe_gemm", x, packed, absmax, codebook, bits, n, k, sorted_token_ids, expert_ids,
                                   num_tokens_post_padded, block_m, top_k, topk_weights);
  TORCH_CHECK(block_m <= kMoeMaxBlockM, msg("kbit::moe_gemm: block_m must be 1..", kMoeMaxBlockM, ", got ", block_m));
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({c.num_pairs, n}, x.options());
  check_cuda(launch_moe_gemm(to_dtype(x.scalar_type()), x.data_ptr(),
                             reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()), absmax.data_ptr<uint8_t>(),
                             codebook.data_ptr<float>(), c.cb_stride, sorted_token_ids.data_ptr<int32_t>(),
                             expert_ids.data_ptr<int32_t>(), num_tokens_post_padded.data_ptr<int32_t>(), c.weights,
                             y.data_ptr(), int(c.experts), int(c.num_pairs), int(c.num_sorted), int(block_m),
                             int(top_k), int(n), int(k), int(bits), at::cuda::getCurrentCUDAStream()),
             "moe_gemm");
  return y;
}

// The grouped wgmma form (Hopper): blocks of block_m = 64, 128 or 256, the activation fused into
// the epilogue (vllm_kbit/ops.py MOE_ACTIVATIONS), uncovered rows zeroed only on request.
at::Tensor moe_gemm_grouped(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                            const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k,
                            const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                            const at::Tensor& num_tokens_post_padded, int64_t block_m, int64_t top_k,
                            const c10::optional<at::Tensor>& topk_weights, int64_t activation, bool zero_uncovered,
                            c10::string_view overrides) {
  const PlanOverrides o = overrides_from(std::string(overrides), "moe_gemm_grouped");
  TORCH_CHECK(moe_grouped_block_m_ok(int(block_m)), msg("kbit::moe_gemm_grouped: block_m must be 64, 128 or 256 ",
              "(the kernels' tokens per CTA), got ", block_m));
  const MoeCall c = check_moe_call("moe_gemm_grouped", x, packed, absmax, codebook, bits, n, k, sorted_token_ids,
                                   expert_ids, num_tokens_post_padded, block_m, top_k, topk_weights);
  TORCH_CHECK(activation >= 0 && activation < moe::kActivations, msg("kbit::moe_gemm_grouped: activation must be ",
              "0..", moe::kActivations - 1, " (vllm_kbit.ops.MOE_ACTIVATIONS), got ", activation));
  const bool gated = moe::is_gated(int(activation));
  TORCH_CHECK(!gated || n % 128 == 0, msg("kbit::moe_gemm_grouped: a gated activation needs n = 2 x the ",
              "intermediate size, a multiple of 128; got n = ", n));
  TORCH_CHECK(moe_grouped_supported(), msg("kbit::moe_gemm_grouped: no grouped wgmma kernel on this build / device ",
              "(it needs sm_90a code and a compute capability 9.0 GPU); use kbit::moe_gemm or the dense path"));
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({c.num_pairs, gated ? n / 2 : n}, x.options());
  check_cuda(launch_moe_grouped(to_dtype(x.scalar_type()), x.data_ptr(),
                                reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
                                absmax.data_ptr<uint8_t>(), codebook.data_ptr<float>(), c.cb_stride,
                                sorted_token_ids.data_ptr<int32_t>(), expert_ids.data_ptr<int32_t>(),
                                num_tokens_post_padded.data_ptr<int32_t>(), c.weights, y.data_ptr(), int(c.experts),
                                int(c.num_pairs), int(c.num_sorted), int(block_m), int(top_k), int(n), int(k),
                                int(bits), int(activation), zero_uncovered, o.moe.one_per_sm,
                                at::cuda::getCurrentCUDAStream()),
             "moe_gemm_grouped");
  return y;
}

at::Tensor dequantize_experts(const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook,
                              int64_t bits, int64_t n, int64_t k, at::ScalarType dtype) {
  TORCH_CHECK(packed.is_cuda(), msg("kbit::dequantize_experts: packed must be a CUDA tensor"));
  const int64_t experts = check_experts("dequantize_experts", packed, absmax, bits, n, k, packed);
  const int cb_stride = check_expert_codebook("dequantize_experts", codebook, bits, experts, packed);
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              msg("kbit::dequantize_experts: dtype must be float16, bfloat16 or float32, got ", dtype));
  const c10::cuda::CUDAGuard guard(packed.device());
  at::Tensor w = at::empty({experts, n, k}, packed.options().dtype(dtype));
  check_cuda(launch_dequantize_experts(to_dtype(dtype), reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
                                       absmax.data_ptr<uint8_t>(), codebook.data_ptr<float>(), cb_stride,
                                       w.data_ptr(), int(experts), int(n), int(k), int(bits),
                                       at::cuda::getCurrentCUDAStream()),
             "dequantize_experts");
  return w;
}

void check_arch_op(int64_t major, int64_t minor) { check_arch(major, minor); }

int64_t gemv_max_m_op(int64_t bits) {
  check_bits(bits);
  return gemv_max_m(int(bits));
}

int64_t dequant_min_m_op(int64_t bits) {
  check_bits(bits);
  return dequant_min_m(device_heuristics(), int(bits));
}

bool has_mma_op() { return has_mma(); }

int64_t auto_path_op(int64_t m, int64_t n, int64_t k, int64_t bits, at::ScalarType dtype, c10::string_view overrides) {
  check_bits(bits);
  TORCH_CHECK(m > 0 && n > 0 && k > 0 && k % kBlockSize == 0,
              msg("kbit::auto_path: bad shape M = ", m, ", N = ", n, ", K = ", k));
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              msg("kbit::auto_path: dtype must be float16 or bfloat16 (kbit::gemm's), got ", dtype));
  const PlanOverrides o = overrides_from(std::string(overrides), "auto_path");
  std::optional<WgmmaPlan> unused;
  return auto_path(to_dtype(dtype), m, n, k, bits, at::cuda::getCurrentDeviceProperties()->multiProcessorCount, o,
                   &unused);
}

bool has_wgmma_op() { return wgmma_supported(); }

int64_t wgmma_max_m_op(int64_t bits) {
  check_bits(bits);
  return wgmma_max_m(device_heuristics(), int(bits));
}

int64_t wgmma_short_max_m_op(int64_t bits) {
  check_bits(bits);
  return wgmma_short_max_m(device_heuristics(), int(bits));
}

DType plan_dtype(const c10::optional<at::ScalarType>& dtype, const char* op) {
  const at::ScalarType t = dtype.value_or(at::kHalf);
  TORCH_CHECK(t == at::kHalf || t == at::kBFloat16, msg("kbit::", op, ": dtype must be float16 or bfloat16, got ", t));
  return to_dtype(t);
}

// The plan ops return a plan's fields as a list, its kernel's key first, in the order
// dispatch/plan_fields.h names them; vllm_kbit/ops.py wraps each in a named tuple of those names
// (GemvPlan, MmaPlan, WgmmaPlan).
std::vector<int64_t> wgmma_plan_op(int64_t m, int64_t n, int64_t k, int64_t bits, at::ScalarType dtype,
                                   int64_t splits, c10::string_view overrides) {
  check_bits(bits);
  TORCH_CHECK(wgmma_supported(), msg("kbit::wgmma_plan: no wgmma kernel on this build / device"));
  TORCH_CHECK(m > 0 && n > 0 && k > 0 && k % kBlockSize == 0, msg("kbit::wgmma_plan: bad shape"));
  TORCH_CHECK(splits >= 0 && splits <= 16, msg("kbit::wgmma_plan: splits must be 0..16"));
  const PlanOverrides o = overrides_from(std::string(overrides), "wgmma_plan");
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const DType dt = plan_dtype(dtype, "wgmma_plan");
  return field_values(wgmma_plan_fields(plan_wgmma(dt, int(m), int(n), int(k), int(bits), num_sms, int(splits), o)));
}

std::vector<int64_t> gemv_plan_op(int64_t m, int64_t n, int64_t k, int64_t bits, int64_t splits,
                                  c10::string_view overrides, const c10::optional<at::ScalarType>& dtype) {
  check_bits(bits);
  TORCH_CHECK(m > 0 && m <= kGemvMaxM && n > 0 && k > 0 && k % kBlockSize == 0, msg("kbit::gemv_plan: bad shape"));
  TORCH_CHECK(splits >= 0 && splits <= 16, msg("kbit::gemv_plan: splits must be 0..16"));
  const PlanOverrides o = overrides_from(std::string(overrides), "gemv_plan");
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const GemvPlan p = plan_gemv(plan_dtype(dtype, "gemv_plan"), int(m), int(n), int(k), int(bits), num_sms,
                               int(splits), o);
  return field_values(gemv_plan_fields(p, gemv_device_clusters()));
}

std::vector<int64_t> mma_plan_op(int64_t m, int64_t n, int64_t k, int64_t bits, c10::string_view overrides,
                                 const c10::optional<at::ScalarType>& dtype) {
  check_bits(bits);
  TORCH_CHECK(has_mma(), msg("kbit::mma_plan: this build has no tensor-core kernel"));
  TORCH_CHECK(m > 0 && n > 0 && k > 0 && k % kBlockSize == 0, msg("kbit::mma_plan: bad shape"));
  const PlanOverrides o = overrides_from(std::string(overrides), "mma_plan");
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return field_values(mma_plan_fields(plan_mma(plan_dtype(dtype, "mma_plan"), int(m), int(n), int(k), int(bits),
                                               num_sms, o.mma)));
}

// The kernel kbit::gemm_path(..., path, splits, overrides) launches for this shape on the current
// device (kbit::gemm's: path 0, no overrides), as core/kernel_keys.h describes its key.
std::string gemm_kernel_op(int64_t m, int64_t n, int64_t k, int64_t bits, at::ScalarType dtype, int64_t path,
                           int64_t splits, c10::string_view overrides) {
  check_bits(bits);
  TORCH_CHECK(m > 0 && n > 0 && k > 0 && k % kBlockSize == 0, msg("kbit::gemm_kernel: bad shape"));
  TORCH_CHECK(path >= kAutoPath && path <= kWgmmaPath, msg("kbit::gemm_kernel: path must be 0..4, got ", path));
  TORCH_CHECK(splits >= 0 && splits <= 16, msg("kbit::gemm_kernel: splits must be 0..16"));
  const PlanOverrides o = overrides_from(std::string(overrides), "gemm_kernel");
  const DType dt = plan_dtype(dtype, "gemm_kernel");
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return describe(plan_call(dt, m, n, k, bits, num_sms, path, splits, o), dt, bits);
}

// The MoE GEMV kernel kbit::moe_gemm launches for a bit width and dtype.
std::string moe_kernel_op(int64_t bits, at::ScalarType dtype) {
  check_bits(bits);
  return describe(moe_key(int(bits), plan_dtype(dtype, "moe_kernel")));
}

bool has_moe_grouped_op() { return moe_grouped_supported(); }

// The grouped MoE kernel kbit::moe_gemm_grouped launches for these shapes on the current device.
std::string moe_grouped_kernel_op(int64_t bits, at::ScalarType dtype, int64_t block_m, int64_t num_sorted, int64_t n,
                                  int64_t activation, c10::string_view overrides) {
  check_bits(bits);
  TORCH_CHECK(moe_grouped_block_m_ok(int(block_m)), msg("kbit::moe_grouped_kernel: block_m must be 64, 128 or 256, ",
              "got ", block_m));
  TORCH_CHECK(num_sorted >= 0 && num_sorted < (int64_t(1) << 31) && n > 0 && n <= int64_t(65535) * kUnit &&
              activation >= 0 && activation < moe::kActivations, msg("kbit::moe_grouped_kernel: bad arguments"));
  const PlanOverrides o = overrides_from(std::string(overrides), "moe_grouped_kernel");
  return describe(moe_grouped_key(int(bits), plan_dtype(dtype, "moe_grouped_kernel"), int(block_m), int(num_sorted),
                                  int(n), int(activation), o.moe.one_per_sm));
}

// The name of the current device's heuristics table (dispatch/heuristics.h).
std::string heuristics_op() { return device_heuristics().name; }

}  // namespace
}  // namespace kbit

// C++-only helper ops (tests, benchmarks). The public schemas live in vllm_kbit/ops.py.
// `overrides`: plan overrides, "key=value,..." (dispatch/overrides.h lists the keys).
// The plan ops' fields: dispatch/plan_fields.h.
TORCH_LIBRARY_FRAGMENT(kbit, m) {
  m.def("gemm_path(Tensor x, Tensor packed, Tensor absmax, Tensor codebook, int bits, int n, int k, "
        "Tensor? bias, int path, int splits=0, str overrides=\"\") -> Tensor");
  m.def("dequantize_tiled(Tensor packed, Tensor absmax, Tensor codebook, int bits, int n, int k, "
        "ScalarType dtype) -> Tensor");
  m.def("check_arch(int major, int minor) -> ()", &kbit::check_arch_op);
  m.def("gemv_max_m(int bits) -> int", &kbit::gemv_max_m_op);
  m.def("dequant_min_m(int bits) -> int", &kbit::dequant_min_m_op);
  m.def("has_mma() -> bool", &kbit::has_mma_op);
  m.def("has_wgmma() -> bool", &kbit::has_wgmma_op);
  m.def("wgmma_max_m(int bits) -> int", &kbit::wgmma_max_m_op);
  m.def("wgmma_short_max_m(int bits) -> int", &kbit::wgmma_short_max_m_op);
  m.def("auto_path(int m, int n, int k, int bits, ScalarType dtype, str overrides=\"\") -> int", &kbit::auto_path_op);
  m.def("wgmma_plan(int m, int n, int k, int bits, ScalarType dtype, int splits=0, str overrides=\"\") -> int[]",
        &kbit::wgmma_plan_op);
  m.def("gemv_plan(int m, int n, int k, int bits, int splits=0, str overrides=\"\", ScalarType? dtype=None) -> int[]",
        &kbit::gemv_plan_op);
  m.def("mma_plan(int m, int n, int k, int bits, str overrides=\"\", ScalarType? dtype=None) -> int[]",
        &kbit::mma_plan_op);
  m.def("gemm_kernel(int m, int n, int k, int bits, ScalarType dtype, int path=0, int splits=0, "
        "str overrides=\"\") -> str", &kbit::gemm_kernel_op);
  m.def("moe_kernel(int bits, ScalarType dtype) -> str", &kbit::moe_kernel_op);
  m.def("has_moe_grouped() -> bool", &kbit::has_moe_grouped_op);
  m.def("moe_grouped_kernel(int bits, ScalarType dtype, int block_m, int num_sorted, int n, int activation=0, "
        "str overrides=\"\") -> str", &kbit::moe_grouped_kernel_op);
  m.def("heuristics() -> str", &kbit::heuristics_op);
}

TORCH_LIBRARY_IMPL(kbit, CUDA, m) {
  m.impl("repack", &kbit::repack);
  m.impl("gemm", &kbit::gemm);
  m.impl("quantize", &kbit::quantize);
  m.impl("gemm_path", &kbit::gemm_path);
  m.impl("dequantize_tiled", &kbit::dequantize_tiled);
  m.impl("moe_gemm", &kbit::moe_gemm);
  m.impl("moe_gemm_grouped", &kbit::moe_gemm_grouped);
  m.impl("dequantize_experts", &kbit::dequantize_experts);
}

// `import vllm_kbit._C` loads this library (which runs the registrations above); the module
// itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "kbit CUDA kernels (registered as torch.ops.kbit.*)", -1,
                            nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&def);
}
