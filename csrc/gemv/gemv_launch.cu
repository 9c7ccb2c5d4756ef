// Host entry points of the GEMV path (declared in dispatch/launchers.h): the device facts the
// plan needs (dispatch/gemv_plan.h), argument checks, and the launch of the kernel the plan's key
// names (gemv_kernels.h, generated: the instantiations are gemv/instantiations/gemv_k<BITS>.cu).
#include <cuda_runtime.h>

#include "core/common.cuh"
#include "dispatch/launchers.h"
#include "gemv/gemv_kernels.h"

namespace kbit {

namespace {
// Stands in for any CTA that has an SM to itself (the GEMV's 16-warp and x-resident CTAs): how
// many clusters of s such CTAs the device runs at once, s = 1..kMaxSplits (gemv::Clusters).
__global__ void one_per_sm_cta() {}

const gemv::Clusters& device_clusters() {
  static gemv::Clusters cached[64];
  static bool asked[64];
  static const gemv::Clusters none = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return none;
  if (!asked[dev]) {
    gemv::Clusters c = {};  // (all 0 if the device refuses the size: S = 1 then)
    const int smem = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
    if (cudaFuncSetAttribute(one_per_sm_cta, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess) {
      for (int s = 1; s <= gemv::kMaxSplits; ++s) {
        int n = 0;  // (unanswered: as if every GPC's SM count were a multiple of s)
        c.n[s] = max_active_clusters(one_per_sm_cta, s, 512, smem, &n)
                     ? n : device_attribute<cudaDevAttrMultiProcessorCount>() / s;
      }
    }
    cudaGetLastError();  // an unanswered query leaves no sticky error behind
    cached[dev] = c;
    asked[dev] = true;
  }
  return cached[dev];
}
}  // namespace

gemv::Clusters gemv_device_clusters() {
  return device_is_sm90_or_newer() ? device_clusters() : gemv::Clusters{};
}

GemvPlan plan_gemv(DType dtype, int m, int n, int k, int bits, int num_sms, int splits, const PlanOverrides& o) {
  gemv::GemvTarget t;
  t.num_sms = num_sms;
  t.clusters = device_is_sm90_or_newer();
  t.smem_optin = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
  if (t.clusters) t.cluster_capacity = device_clusters();
  t.heuristics = &device_heuristics();
  t.pdl = use_pdl(o);
  t.pdl_trigger = use_pdl_trigger(o);
  return plan_gemv_on(m, n, k, bits, dtype, t, splits, o.gemv, [](const GemvKey& key) -> const gemv::GemvKernelFacts* {
    const gemv::GemvKernel* kernel = gemv::select_kernel(key);
    return kernel != nullptr ? &kernel->facts : nullptr;
  });
}

cudaError_t launch_gemv(const GemvPlan& plan, const GemmOperands& a, cudaStream_t stream) {
  if (a.m < 1 || a.m > kGemvMaxM || a.n < 1 || a.k < kBlock || a.k % kBlock != 0) return cudaErrorInvalidValue;
  if (a.dtype != DType::kHalf && a.dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  // the plan's kernel, for this call's operands
  if (plan.key.bits != a.bits || plan.key.dtype != a.dtype || plan.key.mt != (a.m > kGemvOneTileM ? 2 : 1))
    return cudaErrorInvalidValue;
  const gemv::GemvKernel* kernel = gemv::select_kernel(plan.key);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  StreamParams p;
  p.x = a.x; p.packed = a.packed; p.absmax = a.absmax; p.codebook = a.codebook; p.bias = a.bias; p.y = a.y;
  p.m = a.m; p.n = a.n; p.k = a.k;
  p.ku_count = k_units(a.k);
  p.pdl = plan.pdl;
  p.trigger = plan.pdl_trigger;
  p.chunk = plan.chunk;
  return kernel->launch(p, plan.splits, stream);
}

}  // namespace kbit
