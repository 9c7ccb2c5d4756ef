// Host entry points of the wgmma kbit GEMM (declared in kbit_ops.h): argument checks, whether
// this build and device can run it, and the dispatch on bits to csrc/generated/wgmma_k*.cu.
#include <cuda_runtime.h>

#include "dispatch/launchers.h"
#include "wgmma/wgmma_kernel.cuh"

namespace kbit {
namespace wg {
extern template cudaError_t launch_bits<2>(DType, const Params&, int, int, cudaStream_t, int*);
extern template cudaError_t launch_bits<3>(DType, const Params&, int, int, cudaStream_t, int*);
extern template cudaError_t launch_bits<4>(DType, const Params&, int, int, cudaStream_t, int*);
extern template cudaError_t launch_bits<5>(DType, const Params&, int, int, cudaStream_t, int*);

namespace {
cudaError_t dispatch(DType dtype, const Params& p, int bits, int splits, int num_sms, cudaStream_t stream,
                     int* plan) {
  switch (bits) {
    case 2: return launch_bits<2>(dtype, p, splits, num_sms, stream, plan);
    case 3: return launch_bits<3>(dtype, p, splits, num_sms, stream, plan);
    case 4: return launch_bits<4>(dtype, p, splits, num_sms, stream, plan);
    case 5: return launch_bits<5>(dtype, p, splits, num_sms, stream, plan);
  }
  return cudaErrorInvalidValue;
}
}  // namespace
}  // namespace wg

// sm_90a code exists only when the build targeted it (setup.py defines KBIT_HAS_SM90A when
// TORCH_CUDA_ARCH_LIST names 9.0a), and runs only on compute capability 9.0 exactly.
bool wgmma_supported() {
#ifdef KBIT_HAS_SM90A
  return device_attribute<cudaDevAttrComputeCapabilityMajor>() == 9 &&
         device_attribute<cudaDevAttrComputeCapabilityMinor>() == 0;
#else
  return false;
#endif
}

cudaError_t launch_wgmma(DType dtype, const void* x, const uint32_t* packed, const uint8_t* absmax,
                         const float* codebook, const void* bias, void* y, int m, int n, int k, int bits,
                         int num_sms, cudaStream_t stream, int splits, void* workspace, int* zeroed_counters) {
  if (m < 1 || n < 1 || k < kBlock || k % kBlock != 0 || bits < 2 || bits > 5) return cudaErrorInvalidValue;
  if (dtype != DType::kHalf && dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  if (!wgmma_supported()) return cudaErrorNotSupported;
  // TMA and bulk copies need 16 B-aligned global addresses: x rows (K % 32 == 0) and units are
  // 16 B multiples, so only the bases matter
  const auto misaligned = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) != 0; };
  if (misaligned(x) || misaligned(packed) || misaligned(absmax)) return cudaErrorInvalidValue;
  wg::Params p;
  p.x = x; p.packed = packed; p.absmax = absmax; p.codebook = codebook; p.bias = bias; p.y = y;
  p.m = m; p.n = n; p.k = k;
  p.ku_count = k_units(k);
  p.chunk = p.ku_count;
  p.pdl = use_pdl();
  p.trigger = false;  // never timed on its own above the GEMV's M (pdl_trigger, kbit_ops.h)
  p.partial = static_cast<float4*>(workspace);
  p.counters = zeroed_counters;
  if (misaligned(workspace)) return cudaErrorInvalidValue;
  return wg::dispatch(dtype, p, bits, splits, num_sms > 0 ? num_sms : 1, stream, nullptr);
}

void wgmma_plan_info(DType dtype, int m, int n, int k, int bits, int num_sms, int splits, int* out) {
  wg::Params p = {};
  p.m = m; p.n = n; p.k = k;
  p.ku_count = k_units(k);
  wg::dispatch(dtype, p, bits, splits, num_sms > 0 ? num_sms : 1, nullptr, out);
}

size_t wgmma_workspace_bytes(DType dtype, int m, int n, int k, int bits, int num_sms, int splits) {
  int out[kWgmmaPlanInts] = {};
  wgmma_plan_info(dtype, m, n, k, bits, num_sms, splits, out);
  return wg::workspace_bytes(out);
}

}  // namespace kbit
