// Host entry points of the wgmma kbit GEMM (declared in dispatch/launchers.h): argument checks,
// whether this build and device can run it, and the dispatch on bits to the per-bit-width
// instantiations (wgmma/instantiations/wgmma_k<BITS>.cu), which hold the kernels and so the
// occupancy the plan needs.
#include <cuda_runtime.h>

#include "dispatch/launchers.h"
#include "wgmma/wgmma_kernel.cuh"

namespace kbit {
namespace wg {
#define KBIT_WGMMA_EXTERN_BITS(BITS)                                                                    \
  extern template WgmmaPlan plan_bits<BITS>(DType, int, int, int, int, int, bool, const WgmmaOverrides&); \
  extern template cudaError_t launch_bits<BITS>(DType, const Params&, const WgmmaPlan&, cudaStream_t)
KBIT_WGMMA_EXTERN_BITS(2);
KBIT_WGMMA_EXTERN_BITS(3);
KBIT_WGMMA_EXTERN_BITS(4);
KBIT_WGMMA_EXTERN_BITS(5);
#undef KBIT_WGMMA_EXTERN_BITS
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

WgmmaPlan plan_wgmma(DType dtype, int m, int n, int k, int bits, int num_sms, int splits, const PlanOverrides& o) {
  const int sms = num_sms > 0 ? num_sms : 1;
  const bool pdl = use_pdl(o);
  switch (bits) {
    case 2: return wg::plan_bits<2>(dtype, m, n, k, sms, splits, pdl, o.wgmma);
    case 3: return wg::plan_bits<3>(dtype, m, n, k, sms, splits, pdl, o.wgmma);
    case 4: return wg::plan_bits<4>(dtype, m, n, k, sms, splits, pdl, o.wgmma);
    default: return wg::plan_bits<5>(dtype, m, n, k, sms, splits, pdl, o.wgmma);
  }
}

cudaError_t launch_wgmma(const WgmmaPlan& plan, const GemmOperands& a, void* workspace, int* zeroed_counters,
                         cudaStream_t stream) {
  if (a.m < 1 || a.n < 1 || a.k < kBlock || a.k % kBlock != 0 || a.bits < 2 || a.bits > 5) return cudaErrorInvalidValue;
  if (a.dtype != DType::kHalf && a.dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  if (!wgmma_supported()) return cudaErrorNotSupported;
  // TMA and bulk copies need 16 B-aligned global addresses: x rows (K % 32 == 0) and units are
  // 16 B multiples, so only the bases matter
  const auto misaligned = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) != 0; };
  if (misaligned(a.x) || misaligned(a.packed) || misaligned(a.absmax) || misaligned(workspace))
    return cudaErrorInvalidValue;
  wg::Params p;
  p.x = a.x; p.packed = a.packed; p.absmax = a.absmax; p.codebook = a.codebook; p.bias = a.bias; p.y = a.y;
  p.m = a.m; p.n = a.n; p.k = a.k;
  p.ku_count = k_units(a.k);
  p.chunk = p.ku_count;
  p.pdl = plan.pdl;
  p.trigger = false;  // the early trigger pays only at the GEMV's M (launchers.h, use_pdl_trigger)
  p.partial = static_cast<float4*>(workspace);
  p.counters = zeroed_counters;
  switch (a.bits) {
    case 2: return wg::launch_bits<2>(a.dtype, p, plan, stream);
    case 3: return wg::launch_bits<3>(a.dtype, p, plan, stream);
    case 4: return wg::launch_bits<4>(a.dtype, p, plan, stream);
    default: return wg::launch_bits<5>(a.dtype, p, plan, stream);
  }
}

}  // namespace kbit
