// GEMV path dispatch: shape checks, the plan (kbit_gemv_plan.h) with the device's and the
// environment's overrides, and the call into the per-bit-width instantiations
// (generated/gemv_k<B>.cu). See kbit_gemv.cuh for the kernel design.
#include <cuda_runtime.h>

#include "gemv/gemv_kernel.cuh"
#include "dispatch/launchers.h"

namespace kbit {
namespace gemv {

extern template cudaError_t launch_bits<2>(DType, const Params&, int, int, int, cudaStream_t);
extern template cudaError_t launch_bits<3>(DType, const Params&, int, int, int, cudaStream_t);
extern template cudaError_t launch_bits<4>(DType, const Params&, int, int, int, cudaStream_t);
extern template cudaError_t launch_bits<5>(DType, const Params&, int, int, int, cudaStream_t);

}  // namespace gemv

size_t gemv_workspace_bytes(int, int, int, int, int) { return 0; }

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

// What a launch runs: the plan with the device's and the environment's overrides (a forced
// split, KBIT_GEMV_XR_SLABS, KBIT_GEMV_WARPS), shared by launch_gemv and gemv_plan_info.
struct Resolved {
  int splits, warps, slabs;
};
Resolved resolve(int m, int n, int k, int bits, int num_sms, int splits) {
  const int ku = k_units(k), nu = n_units(n);
  const bool clusters = device_is_sm90_or_newer();
  const int sms = num_sms > 0 ? num_sms : 1;
  static const bool xr_off = env_off("KBIT_GEMV_XRES");  // (read once) never x resident
  const bool xr_layout = clusters && gemv::xr_fits();  // the device gives a CTA the resident layout
  const bool resident_ok = !xr_off && xr_layout;
  // (devices without clusters: n[1] alone matters, the launch runs S = 1 anyway)
  gemv::Clusters cl = clusters ? device_clusters() : gemv::Clusters{};
  if (cl.n[1] <= 0) cl.n[1] = sms;
  const gemv::Plan plan = gemv::choose_plan(m, nu, ku, bits, sms, cl, resident_ok);
  int s = splits > 0 ? splits : plan.splits;
  if (s > gemv::kMaxSplits) s = gemv::kMaxSplits;
  if (s > ku) s = ku;
  if (!clusters) s = 1;
  static const int force_warps = env_int("KBIT_GEMV_WARPS", 0);
  int warps = plan.warps, slabs = plan.slabs;
  // A forced split (tests, benchmarks): the best G for it, if its K range fits; if none does,
  // the classic kernels run with the resident plan's 16 warps, not the classic plan's choice
  // (slower for some shapes, not wrong; never in production, which forces no split).
  if (slabs > 0 && splits > 0) slabs = gemv::choose_xr(m, nu, ku, bits, sms, cl, s).slabs;
  // KBIT_GEMV_XR_SLABS = 2 | 4 | 15 | 16 (tests and tuning; read once): x resident with that G
  // wherever the device and the K range allow, whatever the model says
  static const int force_slabs = env_int("KBIT_GEMV_XR_SLABS", 0);
  if (gemv::xr_slabs_built(force_slabs) && xr_layout) {
    const gemv::XrPlan xr = gemv::choose_xr(m, nu, ku, bits, sms, cl, splits > 0 ? s : 0, force_slabs);
    if (xr.slabs > 0) {
      slabs = xr.slabs;
      if (splits <= 0) s = xr.splits;
    }
  }
  if (slabs > 0) {
    warps = gemv::xr_warps(slabs);
  } else if (force_warps == gemv::kNarrowWarps || force_warps == gemv::kWarps || force_warps == gemv::kWideWarps) {
    warps = force_warps;
  } else if (splits > 0 && warps == gemv::kWideWarps && (long long)nu * s > num_sms) {
    warps = gemv::kWarps;  // a forced split that no longer fits one CTA per SM
  }
  return {s, warps, slabs};
}
}  // namespace

cudaError_t launch_gemv(DType dtype, const void* x, const uint32_t* packed, const uint8_t* absmax,
                        const float* codebook, const void* bias, void* y, void* /*workspace*/, int m, int n, int k,
                        int bits, int num_sms, cudaStream_t stream, int splits) {
  if (m < 1 || m > kGemvMaxM || n < 1 || k < kBlock || k % kBlock != 0) return cudaErrorInvalidValue;
  if (dtype != DType::kHalf && dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  gemv::Params p;
  p.x = x; p.packed = packed; p.absmax = absmax; p.codebook = codebook; p.bias = bias; p.y = y;
  p.m = m; p.n = n; p.k = k;
  p.ku_count = k_units(k);
  p.pdl = use_pdl();
  p.trigger = pdl_trigger();
  const Resolved r = resolve(m, n, k, bits, num_sms, splits);
  p.chunk = div_up(p.ku_count, r.splits);
  switch (bits) {
    case 2: return gemv::launch_bits<2>(dtype, p, r.splits, r.warps, r.slabs, stream);
    case 3: return gemv::launch_bits<3>(dtype, p, r.splits, r.warps, r.slabs, stream);
    case 4: return gemv::launch_bits<4>(dtype, p, r.splits, r.warps, r.slabs, stream);
    case 5: return gemv::launch_bits<5>(dtype, p, r.splits, r.warps, r.slabs, stream);
  }
  return cudaErrorInvalidValue;
}

static_assert(kGemvPlanInts == 3 + gemv::kMaxSplits, "gemv_plan_info: plan, then n[1..kMaxSplits]");
void gemv_plan_info(int m, int n, int k, int bits, int num_sms, int splits, int* out) {
  const Resolved r = resolve(m, n, k, bits, num_sms, splits);
  out[0] = r.splits, out[1] = r.warps, out[2] = r.slabs;
  const gemv::Clusters cl = device_is_sm90_or_newer() ? device_clusters() : gemv::Clusters{};
  for (int s = 1; s <= gemv::kMaxSplits; ++s) out[2 + s] = cl.n[s];
}

}  // namespace kbit
