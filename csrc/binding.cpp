// The one torch binding of the kbit kernels: checks, allocation with the torch allocator,
// launch on the current stream, launch-error check. Schemas of kbit::repack / gemm / quantize
// are defined in Python (vllm_kbit/ops.py); this file registers their CUDA kernels and adds a
// few C++-only ops for tests and benchmarks (TORCH_LIBRARY_FRAGMENT below).
//
// gemm picks its path from the shape inside the op (GEMV for M <= gemv_max_m(bits), then on Hopper
// the wgmma kernel up to wgmma_max_m(bits) (above wgmma_short_max_m only where its plan takes
// 256-token tiles), else the mma.sync kernel below dequant_min_m(bits), dequantize + cuBLAS from
// there; see kbit_ops.h and auto_path below), with no
// host sync and a grid that depends on shapes only, so it can be captured in a CUDA graph
// and is opaque to torch.compile.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dispatch/launchers.h"

namespace kbit {
namespace {

constexpr int64_t kBlockSize = 32;
constexpr int64_t kUnit = 64;

enum Path : int64_t { kAuto = 0, kGemv = 1, kMma = 2, kDequant = 3, kWgmma = 4 };

// Error messages are assembled here with std::to_string, never with iostreams: on the H200
// image an ostream number insertion from this library crashed (the std::num_put facet looked
// up from this .so's own template instance; backtrace in the report). c10::str of a single
// std::string, which TORCH_CHECK then does, takes no ostream path.
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

#if __has_include("mma/mma_kernel.cuh")
constexpr bool kHasMma = true;
#else
constexpr bool kHasMma = false;
#endif

// Scratch budget of the dequantize + cuBLAS path; KBIT_DEQUANT_CHUNK_MIB overrides it (tuning).
// A chunk that fits the 50 MB L2 does not pay: the 8B decode step at M = 512 / 1024 took 20145 /
// 31071 us with 24 MiB, 18536 / 29438 with 64 and 17761 / 28875 with 128 (bench_decode.py
// --kbit-paths dequant:0, H200, one call): cuBLAS on fewer rows per call loses more than the
// L2 saves, most on K-heavy layers (64 MiB gave 8192x28672 chunks of 1152 rows: 36 output tiles
// at M = 1024 for 132 SMs). 256 MiB holds every 8B layer whole and 70B's in 2-4 chunks: against
// 64, single kernels at M = 1024 (K=4, L2 flushed) 4096x14336 211 / 233, 28672x4096 424 / 455,
// 8192x28672 911 / 1009, 57344x8192 1800 / 1914 us; the 8B step at M = 1024 / 2048 -1.4..-2.7% /
// -1..-1.8% at K = 2, 4, 5 (bench_decode_dequant_chunk256_6947cd6.json, same call, H200).
int64_t dequant_chunk_bytes() {
  static const int64_t bytes = [] {
    const char* f = std::getenv("KBIT_DEQUANT_CHUNK_MIB");
    const int64_t mib = f != nullptr ? std::atoll(f) : 0;
    return (mib > 0 ? mib : int64_t(256)) << 20;
  }();
  return bytes;
}

// Large-M fallback: dequantize row chunks of W into a bounded scratch and multiply with cuBLAS.
void gemm_dequant(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook,
                  int64_t bits, const GemmArgs& a, const at::Tensor* bias, at::Tensor& y) {
  // As few chunks as the budget allows, of equal size up to 64-row rounding (the last takes the
  // rest). Uneven chunks measured slower: 8192x28672 (70B's down, 470 MB in bf16) ran as 4672 +
  // 3520 rows; as 2 x 4096, 868 -> 812 us at M = 1024 and 1677 -> 1611 at 2048 (L2 flushed), the
  // 70B step's down 1805 -> 1671 us at M = 2048; 57344x8192 (4 x 14336 instead of 3 x 16384 +
  // 8192) within the run's spread (H200, alternated twice in one call,
  // bench_dequant_chunks_ab_6dc9c16.json). The cause is not isolated: fewer output tiles per
  // cuBLAS call, or row counts that are not multiples of 128.
  const int64_t budget = dequant_chunk_bytes();
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

// The path kbit::gemm takes (kbit_ops.h): from M, and between wgmma_short_max_m and wgmma_max_m
// from the wgmma plan too (wgmma only where it takes 256-token tiles).
int64_t auto_path(DType dtype, int64_t m, int64_t n, int64_t k, int64_t bits, int num_sms) {
  if (m <= gemv_max_m(int(bits))) return kGemv;
  if (m <= wgmma_max_m(int(bits)) && wgmma_supported()) {
    if (m <= wgmma_short_max_m(int(bits))) return kWgmma;
    int plan[kWgmmaPlanInts] = {};
    wgmma_plan_info(dtype, int(m), int(n), int(k), int(bits), num_sms, 0, plan);
    return plan[0] == 256 ? kWgmma : kDequant;
  }
  return kHasMma && m < dequant_min_m(int(bits)) ? kMma : kDequant;
}

// The wgmma kernel's cluster-group counters (kbit_wgmma.cuh, choose_groups): one zeroed int32
// buffer per device and stream, left zero by every launch (the last CTA at a counter resets it),
// so a launch needs no memset before it. A memset node before each launch cost ~3 us a call in
// the decode graph, which took the gain of 4096x14336 at 256 tokens from 11% to 6% and made
// 4096x4096 10% slower (docs/MMA.md). Per stream, because launches on two streams may overlap
// and would share counters; launches on one stream do not touch them at once (a kernel reaches
// its epilogue only after griddepcontrol.wait, so after the kernel before it has finished).
// Allocated by the first call on a stream outside CUDA-graph capture: vLLM captures on the
// stream its profile run used, eagerly, before (compilation/cuda_graph.py). A call on a stream
// without one (first call under capture), or with KBIT_WGMMA_ZEROED=0, zeroes counters in its
// own workspace on-stream instead. A graph replayed on another stream than it was captured on
// uses the capture stream's counters.
int* zeroed_counters(const at::Tensor& like, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, at::Tensor*> bufs;  // never freed: outlive the context at exit
  if (env_int("KBIT_WGMMA_ZEROED", 1) == 0) return nullptr;
  const auto key = std::make_pair(int(like.get_device()), stream);
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = bufs.find(key);
  if (it != bufs.end()) return it->second->data_ptr<int>();
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone)
    return nullptr;
  at::Tensor* buf = new at::Tensor(at::zeros({kWgmmaZeroedCounters}, like.options().dtype(at::kInt)));
  bufs.emplace(key, buf);
  return buf->data_ptr<int>();
}

at::Tensor gemm_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                     const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k,
                     const c10::optional<at::Tensor>& bias_opt, int64_t path, int64_t splits) {
  const GemmArgs a = check_gemm(x, packed, absmax, codebook, bits, n, k, bias_opt);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({a.m, a.n}, x.options());
  if (a.m == 0) return y;
  const at::Tensor* bias = bias_opt.has_value() && bias_opt->defined() ? &*bias_opt : nullptr;
  const void* bias_ptr = bias != nullptr ? bias->data_ptr() : nullptr;
  const int num_sms = device_props(x).multiProcessorCount;
  // (kAuto with forced splits, a tuning call: the path is chosen as for splits = 0)
  if (path == kAuto) path = auto_path(a.dtype, a.m, a.n, a.k, bits, num_sms);
  TORCH_CHECK(path >= kGemv && path <= kWgmma, msg("kbit::gemm_path: path must be 0..4, got ", path));
  TORCH_CHECK(path != kWgmma || wgmma_supported(), msg("kbit::gemm_path: the wgmma path needs a build with ",
              "TORCH_CUDA_ARCH_LIST containing 9.0a and a compute capability 9.0 GPU"));
  TORCH_CHECK(path != kGemv || a.m <= kGemvMaxM, msg("kbit::gemm_path: the GEMV path serves M <= ", kGemvMaxM,
              ", got M = ", a.m));
  TORCH_CHECK(path != kMma || kHasMma, msg("kbit::gemm_path: this build has no tensor-core kernel"));
  TORCH_CHECK(splits >= 0 && splits <= 16, msg("kbit::gemm_path: splits must be 0..16 (the GEMV takes at most 8)"));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  int* const counters = wgmma_supported() ? zeroed_counters(x, stream) : nullptr;  // (any path: the first eager call)
  const auto* pk = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  if (path == kGemv) {
    const size_t ws_bytes = gemv_workspace_bytes(int(a.m), int(a.n), int(a.k), int(bits), num_sms);
    at::Tensor ws = at::empty({int64_t(ws_bytes)}, x.options().dtype(at::kByte));
    const cudaError_t err = launch_gemv(a.dtype, x.data_ptr(), pk, absmax.data_ptr<uint8_t>(),
                                        codebook.data_ptr<float>(), bias_ptr, y.data_ptr(),
                                        ws_bytes ? ws.data_ptr() : nullptr, int(a.m), int(a.n), int(a.k), int(bits),
                                        num_sms, stream, int(splits));
    check_cuda(err, "gemm (gemv)");
  }
  if (path == kMma) {
    const size_t ws_bytes = mma_workspace_bytes(int(a.m), int(a.n), int(a.k), int(bits), num_sms);
    at::Tensor ws = at::empty({int64_t(ws_bytes)}, x.options().dtype(at::kByte));
    check_cuda(launch_mma(a.dtype, x.data_ptr(), pk, absmax.data_ptr<uint8_t>(), codebook.data_ptr<float>(), bias_ptr,
                          y.data_ptr(), ws_bytes ? ws.data_ptr() : nullptr, int(a.m), int(a.n), int(a.k), int(bits),
                          num_sms, stream),
               "gemm (mma)");
  } else if (path == kWgmma) {
    const size_t ws_bytes = wgmma_workspace_bytes(a.dtype, int(a.m), int(a.n), int(a.k), int(bits), num_sms,
                                                  int(splits));
    at::Tensor ws = at::empty({int64_t(ws_bytes)}, x.options().dtype(at::kByte));
    check_cuda(launch_wgmma(a.dtype, x.data_ptr(), pk, absmax.data_ptr<uint8_t>(), codebook.data_ptr<float>(),
                            bias_ptr, y.data_ptr(), int(a.m), int(a.n), int(a.k), int(bits), num_sms, stream,
                            int(splits), ws_bytes ? ws.data_ptr() : nullptr,
                            counters),
               "gemm (wgmma)");
  } else if (path == kDequant) {
    gemm_dequant(x, packed, absmax, codebook, bits, a, bias, y);
  }
  return y;
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook,
                int64_t bits, int64_t n, int64_t k, const c10::optional<at::Tensor>& bias) {
  return gemm_impl(x, packed, absmax, codebook, bits, n, k, bias, kAuto, 0);
}

at::Tensor gemm_path(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                     const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k,
                     const c10::optional<at::Tensor>& bias, int64_t path, int64_t splits) {
  return gemm_impl(x, packed, absmax, codebook, bits, n, k, bias, path, splits);
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

void check_arch_op(int64_t major, int64_t minor) { check_arch(major, minor); }

int64_t gemv_max_m_op(int64_t bits) {
  check_bits(bits);
  return gemv_max_m(int(bits));
}

int64_t dequant_min_m_op(int64_t bits) {
  check_bits(bits);
  return dequant_min_m(int(bits));
}

bool has_mma_op() { return kHasMma; }

int64_t auto_path_op(int64_t m, int64_t n, int64_t k, int64_t bits, at::ScalarType dtype) {
  check_bits(bits);
  TORCH_CHECK(m > 0 && n > 0 && k > 0 && k % kBlockSize == 0,
              msg("kbit::auto_path: bad shape M = ", m, ", N = ", n, ", K = ", k));
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              msg("kbit::auto_path: dtype must be float16 or bfloat16 (kbit::gemm's), got ", dtype));
  return auto_path(to_dtype(dtype), m, n, k, bits, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
}

bool has_wgmma_op() { return wgmma_supported(); }

int64_t wgmma_max_m_op(int64_t bits) {
  check_bits(bits);
  return wgmma_max_m(int(bits));
}

int64_t wgmma_short_max_m_op(int64_t bits) {
  check_bits(bits);
  return wgmma_short_max_m(int(bits));
}

// The wgmma launch plan on the current device: [tile_m, splits, grid x, grid y, grid z, columns per
// CTA, CTAs per SM the launch allows, row split (warpgroups sharing a CTA's slabs), CTAs per SM the
// kernel is built for] (kbit_ops.h).
std::vector<int64_t> wgmma_plan_op(int64_t m, int64_t n, int64_t k, int64_t bits, at::ScalarType dtype,
                                   int64_t splits) {
  check_bits(bits);
  TORCH_CHECK(wgmma_supported(), msg("kbit::wgmma_plan: no wgmma kernel on this build / device"));
  TORCH_CHECK(m > 0 && n > 0 && k > 0 && k % kBlockSize == 0, msg("kbit::wgmma_plan: bad shape"));
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int out[kWgmmaPlanInts] = {};
  wgmma_plan_info(to_dtype(dtype), int(m), int(n), int(k), int(bits), num_sms, int(splits), out);
  return std::vector<int64_t>(out, out + kWgmmaPlanInts);
}

// The GEMV launch plan on the current device: [splits, warps per CTA, slabs per CTA (0: x not
// resident), clusters of 1..8 one-per-SM CTAs the device runs at once] (kbit_ops.h).
std::vector<int64_t> gemv_plan_op(int64_t m, int64_t n, int64_t k, int64_t bits, int64_t splits) {
  check_bits(bits);
  TORCH_CHECK(m > 0 && m <= kGemvMaxM && n > 0 && k > 0 && k % kBlockSize == 0, msg("kbit::gemv_plan: bad shape"));
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int out[kGemvPlanInts] = {};
  gemv_plan_info(int(m), int(n), int(k), int(bits), num_sms, int(splits), out);
  return std::vector<int64_t>(out, out + kGemvPlanInts);
}

// ---- BEGIN MMA plan hook (owner: tensor-core kernel, csrc/kbit_mma.cu) ----
// The tensor-core launch plan for a shape on the current device, for tests and benchmarks:
// [cfg, tile_m, tile_n, splits, k_tiles_per_split, items, grid, workspace_bytes].
}  // namespace
void mma_plan_info(int m, int n, int k, int bits, int num_sms, int64_t* out);  // kbit_mma.cu
namespace {
std::vector<int64_t> mma_plan_op(int64_t m, int64_t n, int64_t k, int64_t bits) {
  check_bits(bits);
  TORCH_CHECK(kHasMma, msg("kbit::mma_plan: this build has no tensor-core kernel"));
  TORCH_CHECK(m > 0 && n > 0 && k > 0 && k % kBlockSize == 0, msg("kbit::mma_plan: bad shape"));
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  std::vector<int64_t> out(8);
  mma_plan_info(int(m), int(n), int(k), int(bits), num_sms, out.data());
  return out;
}
// ---- END MMA plan hook ----

}  // namespace
}  // namespace kbit

// C++-only helper ops (tests, benchmarks). The three public schemas live in vllm_kbit/ops.py.
TORCH_LIBRARY_FRAGMENT(kbit, m) {
  m.def("gemm_path(Tensor x, Tensor packed, Tensor absmax, Tensor codebook, int bits, int n, int k, "
        "Tensor? bias, int path, int splits=0) -> Tensor");
  m.def("dequantize_tiled(Tensor packed, Tensor absmax, Tensor codebook, int bits, int n, int k, "
        "ScalarType dtype) -> Tensor");
  m.def("check_arch(int major, int minor) -> ()", &kbit::check_arch_op);
  m.def("gemv_max_m(int bits) -> int", &kbit::gemv_max_m_op);
  m.def("dequant_min_m(int bits) -> int", &kbit::dequant_min_m_op);
  m.def("has_mma() -> bool", &kbit::has_mma_op);
  m.def("has_wgmma() -> bool", &kbit::has_wgmma_op);
  m.def("wgmma_max_m(int bits) -> int", &kbit::wgmma_max_m_op);
  m.def("wgmma_short_max_m(int bits) -> int", &kbit::wgmma_short_max_m_op);
  m.def("auto_path(int m, int n, int k, int bits, ScalarType dtype) -> int", &kbit::auto_path_op);
  m.def("wgmma_plan(int m, int n, int k, int bits, ScalarType dtype, int splits=0) -> int[]", &kbit::wgmma_plan_op);
  m.def("gemv_plan(int m, int n, int k, int bits, int splits=0) -> int[]", &kbit::gemv_plan_op);
  m.def("mma_plan(int m, int n, int k, int bits) -> int[]", &kbit::mma_plan_op);  // MMA plan hook
}

TORCH_LIBRARY_IMPL(kbit, CUDA, m) {
  m.impl("repack", &kbit::repack);
  m.impl("gemm", &kbit::gemm);
  m.impl("quantize", &kbit::quantize);
  m.impl("gemm_path", &kbit::gemm_path);
  m.impl("dequantize_tiled", &kbit::dequantize_tiled);
}

// `import vllm_kbit._C` loads this library (which runs the registrations above); the module
// itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "kbit CUDA kernels (registered as torch.ops.kbit.*)", -1,
                            nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&def);
}
