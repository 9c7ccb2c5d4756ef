// The plan ops' fields as the binding returns them (dispatch/plan_fields.h), for plans built here
// on the CPU: GEMV, mma.sync, wgmma and FP8 GEMM plans of a few shapes (the H200's SM count, clusters and
// occupancy, every kernel built). Built and run by tests/test_plan_overrides.py with nvcc as host
// code; it prints, per plan, "plan FAMILY KERNEL" (the key as core/kernel_keys.h describes it),
// then one "field NAME VALUE" line per field in the order the ops return them.
#include <cstdio>

#include "dispatch/heuristics.h"
#include "dispatch/overrides.h"
#include "dispatch/plan_fields.h"

using namespace kbit;

static void print(const char* family, const std::string& kernel, const PlanFields& fields) {
  std::printf("plan %s %s\n", family, kernel.c_str());
  for (const auto& f : fields) std::printf("field %s %lld\n", f.first, (long long)f.second);
}

int main() {
  constexpr int kSms = 132;
  // GEMV: every kernel built, the H200's shared memory and cluster capacity
  static const gemv::GemvKernelFacts facts = {200 * 1024, 88};
  gemv::GemvTarget t;
  t.num_sms = kSms;
  t.clusters = true;
  t.smem_optin = 227 * 1024;
  t.cluster_capacity = {{0, 132, 66, 39, 30, 22, 17, 15, 15}};
  t.heuristics = &kH200Heuristics;
  t.pdl = t.pdl_trigger = true;
  const auto all_built = [](const GemvKey&) { return &facts; };
  for (const int m : {1, 16})
    for (const DType dt : {DType::kHalf, DType::kBFloat16}) {
      const GemvPlan p = plan_gemv_on(m, 28672, 4096, 3, dt, t, 0, GemvOverrides{}, all_built);
      print("gemv", describe(p.key), gemv_plan_fields(p, t.cluster_capacity));
    }
  const GemvPlan forced = plan_gemv_on(5, 4096, 14336, 5, DType::kHalf, t, 3, GemvOverrides{}, all_built);
  print("gemv", describe(forced.key), gemv_plan_fields(forced, t.cluster_capacity));
  // mma.sync: the cost model's plans and a forced config
  for (const int m : {64, 600}) {
    const MmaPlan p = mma::plan_for_overrides(kH200Heuristics, m, 4096, 14336, 4, DType::kBFloat16, kSms, MmaOverrides{});
    print("mma", describe(p.key), mma_plan_fields(p));
  }
  MmaOverrides cfg0;
  cfg0.config = 0;
  cfg0.splits = 3;
  const MmaPlan pm = mma::plan_for_overrides(kH200Heuristics, 20, 6144, 4096, 2, DType::kHalf, kSms, cfg0);
  print("mma", describe(pm.key), mma_plan_fields(pm));
  // wgmma: one CTA per SM at 128 / 256 tokens, two below; clusters up to 16 wherever asked
  wg::Occupancy one, two;
  two.per_sm = 2;
  one.spread_bytes = 232448;
  two.spread_bytes = 116736;
  one.max_splits = two.max_splits = wg::kMaxSplits;
  for (int s = 1; s <= wg::kMaxSplits; ++s) {
    one.clusters[s][0] = one.clusters[s][1] = two.clusters[s][1] = kSms / s;
    two.clusters[s][0] = 2 * kSms / s;
  }
  const auto occ = [&](int mt, int, int, int built_per_sm) -> const wg::Occupancy& {
    return mt >= 128 || built_per_sm == 1 ? one : two;
  };
  wg::WgmmaTarget wt;
  wt.bits = 4;
  wt.num_sms = kSms;
  wt.heuristics = &kH200Heuristics;
  wt.one_per_sm_deeper = true;
  wt.pdl = true;
  for (const int m : {32, 64, 256, 700}) {
    wt.dtype = m == 64 ? DType::kBFloat16 : DType::kHalf;
    const WgmmaPlan p = wg::plan_on(m, 4096, 14336, 0, wt, WgmmaOverrides{}, occ);
    print("wgmma", describe(p.key), wgmma_plan_fields(p));
  }
  WgmmaOverrides tall_wgmma;
  tall_wgmma.tile_m = 256;
  const WgmmaPlan pt = wg::plan_on(512, 4100, 4096, 2, wt, tall_wgmma, occ);  // split tall CTAs, N % 8 != 0
  print("wgmma", describe(pt.key), wgmma_plan_fields(pt));
  // FP8 GEMM: the fused kernel's tiles (64 x 128, 128 x 128, 128 x 256 on 132 SMs) and a forced
  // one; the paths: 16-bit (no scaled_mm at hand), decode-first (one at hand), fused (forced)
  for (const int m : {64, 1024, 2200}) {
    const Fp8Plan p = fp8::plan(kH200Heuristics, m, 4096, 4, m == 1024 ? DType::kBFloat16 : DType::kHalf, kSms,
                                Fp8Overrides{}, m == 1024);
    print("fp8", describe(p), fp8_plan_fields(p));
  }
  Fp8Overrides tall;
  tall.tile_m = 256;
  tall.path = 0;
  const Fp8Plan pf = fp8::plan(kH200Heuristics, 300, 200, 3, DType::kHalf, kSms, tall);
  print("fp8", describe(pf), fp8_plan_fields(pf));
  return 0;
}
