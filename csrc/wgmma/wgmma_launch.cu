// Host entry points of the wgmma kbit GEMM (declared in dispatch/launchers.h): whether this build
// and device can run it, the plan (dispatch/wgmma_plan.h) from the occupancy of the compiled
// kernels, argument checks, and the launch of the kernel the plan's key names (wgmma_kernels.h,
// generated: the instantiations are wgmma/instantiations/wgmma_k<BITS>.cu).
#include <cuda_runtime.h>

#include "core/common.cuh"
#include "dispatch/launchers.h"
#include "wgmma/wgmma_kernels.h"

namespace kbit {

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

namespace {
WgmmaKey wgmma_key(int bits, DType dtype, int mt, int columns, int row_split, int built_per_sm) {
  WgmmaKey key;
  key.bits = bits;
  key.dtype = dtype;
  key.tile_m = mt;
  key.columns = columns;
  key.row_split = row_split;
  key.built_per_sm = built_per_sm;
  return key;
}
}  // namespace

WgmmaPlan plan_wgmma(DType dtype, int m, int n, int k, int bits, int num_sms, int splits, const PlanOverrides& o) {
  static const wg::Occupancy none = {};
  const auto occupancy = [&](int mt, int columns, int row_split, int built_per_sm) -> const wg::Occupancy& {
    const wg::WgmmaKernel* kernel = wg::select_kernel(wgmma_key(bits, dtype, mt, columns, row_split, built_per_sm));
    return kernel != nullptr ? kernel->occupancy() : none;
  };
  // whether the 64-token tile built for one CTA per SM has more pipeline stages than the one
  // built for two (true at K = 3..5, whose tables and units leave two CTAs per SM 4-6 stages)
  const wg::WgmmaKernel* one = wg::select_kernel(wgmma_key(bits, dtype, 64, 256, 2, 1));
  const wg::WgmmaKernel* two = wg::select_kernel(wgmma_key(bits, dtype, 64, 256, 2, 2));
  wg::WgmmaTarget t;
  t.bits = bits;
  t.dtype = dtype;
  t.num_sms = num_sms > 0 ? num_sms : 1;
  t.heuristics = &device_heuristics();
  t.one_per_sm_deeper = one != nullptr && two != nullptr && one->stages > two->stages;
  t.pdl = use_pdl(o);
  return wg::plan_on(m, n, k, splits, t, o.wgmma, occupancy);
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
  if (plan.key.bits != a.bits || plan.key.dtype != a.dtype) return cudaErrorInvalidValue;
  const wg::WgmmaKernel* kernel = wg::select_kernel(plan.key);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  StreamParams p;
  p.x = a.x; p.packed = a.packed; p.absmax = a.absmax; p.codebook = a.codebook; p.bias = a.bias; p.y = a.y;
  p.m = a.m; p.n = a.n; p.k = a.k;
  p.ku_count = k_units(a.k);
  p.chunk = plan.chunk;
  p.groups = plan.groups;
  p.pdl = plan.pdl;
  p.trigger = false;  // the early trigger pays only at the GEMV's M (launchers.h, use_pdl_trigger)
  p.y_tma = plan.y_tma;
  p.partial = static_cast<float4*>(workspace);
  p.counters = zeroed_counters;
  // With cluster groups the workspace holds the group counters (unless the caller's zeroed
  // counters serve) and then the groups' sums.
  if (plan.groups > 1) {
    if (p.partial == nullptr) return cudaErrorInvalidValue;
    const size_t counter_bytes = wg::group_counter_bytes(plan);
    if (p.counters == nullptr || wg::group_counters(plan) > size_t(kWgmmaZeroedCounters)) {
      p.counters = reinterpret_cast<int*>(p.partial);
      const cudaError_t e = cudaMemsetAsync(p.counters, 0, counter_bytes, stream);  // graph-capturable
      if (e != cudaSuccess) return e;
    }  // else the caller's counters, zero and left zero by every launch (self-reset)
    p.partial = reinterpret_cast<float4*>(reinterpret_cast<char*>(p.partial) + counter_bytes);
  }
  return kernel->launch(p, plan.grid_x(), plan.spread, stream);
}

}  // namespace kbit
