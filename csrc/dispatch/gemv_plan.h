// The GEMV path's launch plan: split-K factor (cluster size), CTA size and whether x is resident
// in shared memory, from the shape, the SM count and how many clusters the device runs at once.
// Host code only, torch-free: tests/cpp/gemv_plan_test.cu replays it with the H200's numbers.
// The kernels it plans are gemv/gemv_kernel.cuh's; docs/DESIGN.md explains the rules and
// docs/PERFORMANCE.md has the measurements they were fitted to.
#pragma once
#include "core/kernel_keys.h"
#include "core/layout.cuh"
#include "dispatch/heuristics.h"
#include "dispatch/overrides.h"
#include "dispatch/path_rule.h"
#include "gemv/gemv_config.h"

namespace kbit {
namespace gemv {

// Clusters of s one-per-SM CTAs the device runs at once (n[s], s = 1..kMaxSplits; from
// cudaOccupancyMaxActiveClusters). A cluster sits in one GPC, so n[s] is below SMs / s where s
// does not divide a GPC's SM count; the one-per-SM plans count clusters against these, never
// CTAs against SMs.
struct Clusters {
  int n[kMaxSplits + 1];
};

// Heuristics::gemv_narrow_min_units: units a warp of the four-per-SM CTAs streams at least:
// fewer and its fixed cost dominates; more and short-K layers lose the split that fills the SMs.

struct Plan {
  int splits, warps, slabs = 0;  // slabs > 0: x resident, that many slabs per CTA of xr_warps(slabs)
};

// Estimated time of a plan, in units of one warp's unit time: the busiest warp's units, each
// costing 1 + (M / 32) / G (x's share of the L2 -> SM bytes, which grows with M), plus a fixed 2
// (table, pipeline fill, reduction; 1.5 with one warp per slab, whose partial sums need no
// cross-warp pass) and 1.5 for a cluster reduction, times the waves of `per_sm` CTAs per SM.
// `s4_unit`: one warp per slab in clusters of four streams its units faster than the resident
// plans of several warps per slab (Heuristics::gemv_s4_unit, measured; choose_xr ranks with it at
// K = 3, 4).
inline double plan_cost(const Heuristics& h, int m, int nu, int ku, int num_sms, int s, int g, int warps, int per_sm,
                        bool s4_unit = false) {
  const int chunk = div_up(ku, s);
  const long long waves = div_up((long long)div_up(nu, g) * s, (long long)num_sms * per_sm);
  const double fixed = warps == g ? 1.5 : 2.0, unit = s4_unit && warps == g && s == 4 ? h.gemv_s4_unit : 1.0;
  return waves * (div_up(chunk, warps / g) * (1.0 + m / 32.0 / g) * unit + fixed + (s > 1 ? 1.5 : 0.0));
}

// x resident: slabs per CTA G and split S for 16-warp CTAs, one per SM, by plan_cost; ties go to
// the larger G (less x), then the smaller S. S <= 2, except S = 4 for one warp per slab (G = 16)
// in one wave, with >= gemv_s4_min_units units a warp and K >= gemv_s4_min_bits (several warps per slab in
// clusters of four, and K=2, measured slower). Where G = 16, S = 4 wins, G = 15 replaces it if
// that makes more clusters that still fit one wave. `forced_s` > 0 fixes S, `forced_g` > 0 G
// (kXrFillSlabs only when forced). G = 0 where no K range fits.
struct XrPlan {
  int splits, slabs;
  double cost, rank;  // the model's lowest cost over the candidates; this one's rank (gemv_s4_unit)
};
inline XrPlan choose_xr(const Heuristics& h, int m, int nu, int ku, int bits, int num_sms, const Clusters& cl, int forced_s,
                        int forced_g = 0) {
  XrPlan best = {1, 0, 0.0, 0.0};
  double min_cost = -1.0;
  const int max_units = xr_max_units(m > kGemvOneTileM ? 2 : 1);
  for (const int g : {kXrSlabs[0], kXrSlabs[1], kXrSlabs[2], kXrFillSlabs}) {  // (15: only when forced)
    if ((forced_g > 0 && g != forced_g) || (g == kXrFillSlabs && forced_g != g)) continue;
    const int warps = xr_warps(g);
    const int s_lo = forced_s > 0 ? forced_s : 1, s_hi = forced_s > 0 ? forced_s : one_warp_a_slab(g) ? 4 : 2;
    for (int s = s_lo; s <= s_hi && s <= ku; ++s) {
      const int chunk = div_up(ku, s), se = div_up(ku, chunk);
      if (chunk > max_units) continue;
      if (forced_s <= 0 && se > 2 &&
          (se != 4 || bits < h.gemv_s4_min_bits || chunk < h.gemv_s4_min_units || div_up(nu, g) > cl.n[4]))
        continue;
      const double cost = plan_cost(h, m, nu, ku, num_sms, se, g, warps, 1);
      const double rank = plan_cost(h, m, nu, ku, num_sms, se, g, warps, 1, bits == 3 || bits == 4);
      min_cost = min_cost < 0 || cost < min_cost ? cost : min_cost;
      if (best.slabs == 0 || rank < best.rank - 1e-9 || (rank < best.rank + 1e-9 && g > best.slabs))
        best = {se, g, cost, rank};
    }
  }
  if (forced_g <= 0 && best.slabs == kWideWarps && best.splits == 4 && div_up(nu, kXrFillSlabs) <= cl.n[4] &&
      div_up(nu, kXrFillSlabs) > div_up(nu, kWideWarps))
    best.slabs = kXrFillSlabs;
  best.cost = min_cost;  // whether x resident beats the classic plan: by the model alone
  return best;
}

// The plan without x resident (x in registers at M <= 8, the per-warp ring above), every rule
// aiming at one wave of 16 warps per SM (a second wave costs a whole CTA time):
//   * slabs <= SMs: one 16-warp CTA per SM, the largest S whose clusters all run at once;
//   * M > 8: the same beyond 4 SMs of slabs too; four 4-warp CTAs per SM between;
//   * SMs < slabs <= 4 SMs: four 4-warp CTAs per SM, the largest S with slabs * S <= 4 SMs
//     while each warp streams >= gemv_narrow_min_units units;
//   * else (M <= 8): two 8-warp CTAs per SM when every warp still streams >= 8 units, one per
//     SM otherwise.
// Where x stays in registers at M > 8 (devices without the ring) a layer of SMs < slabs <= 4 SMs
// keeps the 4-warp split with 8-warp CTAs: slower, not wrong.
inline Plan choose_plan_classic(const Heuristics& h, int m, int nu, int ku, int num_sms, const Clusters& cl) {
  const int s_max = ku < kMaxSplits ? ku : kMaxSplits;
  // four CTAs per SM: the largest S with NU * S <= 4 SMs and >= gemv_narrow_min_units units per warp
  const auto largest_narrow = [&]() {
    int s = 1;
    while (s < s_max && (long long)nu * (s + 1) <= 4LL * num_sms &&
           div_up(div_up(ku, s + 1), kNarrowWarps) >= h.gemv_narrow_min_units)
      ++s;
    return s;
  };
  // one CTA per SM: the largest S whose NU clusters run at once (Clusters)
  const auto largest_alone = [&]() {
    int s = 1;
    while (s < s_max && nu <= cl.n[s + 1]) ++s;
    return s;
  };
  if (m > kGemvOneTileM) {
    if (nu > num_sms && nu <= 4LL * num_sms) return {largest_narrow(), kNarrowWarps};
    return {largest_alone(), kWideWarps};
  }
  if (nu <= num_sms) return {largest_alone(), kWideWarps};
  if (nu <= 4LL * num_sms) return {largest_narrow(), kNarrowWarps};
  const auto smallest = [&](long long ctas_wanted) {
    int s = 1;
    while (s < s_max && (long long)nu * s * 10 < 9 * ctas_wanted) ++s;
    return s;
  };
  const int s2 = smallest(2LL * num_sms);
  if (div_up(div_up(ku, s2), kWarps) >= 8) return {s2, kWarps};
  return {smallest(num_sms), kWarps};
}

// x resident where the model says it beats the classic plan (at M <= 8, where x is half the
// bytes or less, by a margin, gemv_resident_margin: the model leaves out the copy before the loop). And at K = 3, 4
// where the classic plan is four 4-warp CTAs per SM, the one-warp-a-slab clusters of four win
// at every M if they put >= gemv_fill_percent of the SMs to work: those 4-warp CTAs read the packed pair table
// and are bound by instructions, not bytes. `resident_ok`: the device has clusters and gives a
// CTA the resident layout's shared memory (and the caller allows it).
inline Plan choose_plan(const Heuristics& h, int m, int nu, int ku, int bits, int num_sms, const Clusters& cl, bool resident_ok) {
  const Plan classic = choose_plan_classic(h, m, nu, ku, num_sms, cl);
  if (!resident_ok) return classic;
  const XrPlan xr = choose_xr(h, m, nu, ku, bits, num_sms, cl, 0);
  const int s = div_up(ku, div_up(ku, classic.splits));
  const int per_sm = classic.warps == kNarrowWarps ? 4 : classic.warps == kWarps ? 2 : 1;
  const double margin = m > kGemvOneTileM ? 1.0 : h.gemv_resident_margin;
  if (xr.slabs > 0 && xr.cost < margin * plan_cost(h, m, nu, ku, num_sms, s, 1, classic.warps, per_sm))
    return {xr.splits, xr_warps(xr.slabs), xr.slabs};
  if ((bits == 3 || bits == 4) && classic.warps == kNarrowWarps && xr.splits == 4 && one_warp_a_slab(xr.slabs) &&
      100LL * 4 * div_up(nu, xr.slabs) >= (long long)h.gemv_fill_percent * num_sms)
    return {xr.splits, xr_warps(xr.slabs), xr.slabs};
  return classic;
}

// What the plan needs of the device: its SM count, whether it has thread-block clusters (sm_90),
// how much shared memory it gives one CTA, how many clusters of 1..kMaxSplits one-per-SM CTAs it
// runs at once, its tuned numbers, and whether the launch uses programmatic dependent launch.
struct GemvTarget {
  int num_sms = 1;
  bool clusters = false;
  int smem_optin = 0;               // cudaDevAttrMaxSharedMemoryPerBlockOptin
  Clusters cluster_capacity = {};
  const Heuristics* heuristics = &kGenericHeuristics;
  bool pdl = false;                 // programmatic dependent launch (sm_90, not overridden off)
  bool pdl_trigger = false;         // M <= 8: let the next kernel launch once the main loop is done
};

}  // namespace gemv

// The GEMV launch of one call: the kernel (key) and its launch.
struct GemvPlan {
  GemvKey key;
  int splits = 1;           // CTAs per cluster along K
  int chunk = 1;            // K units per CTA
  bool pdl = false;         // programmatic dependent launch
  bool pdl_trigger = false; // let the next kernel launch once the main loop is done
  int warps() const { return key.warps; }
  int slabs() const { return key.slabs; }
};

// The plan for a shape on `t`: choose_plan, then what the caller forces (a split; overrides),
// then the kernel: `facts(key)` gives a compiled kernel's GemvKernelFacts (nullptr where that
// kernel is not built). A forced split keeps x resident with the best G for it where its K range
// fits; otherwise the classic kernels run (with the resident plan's 16 warps: slower for some
// shapes, not wrong).
//   * x resident: CTAs of G slabs, x in shared memory; the wide-row table where it is built, the
//     CTA's K range fits beside it and the device gives the CTA its shared memory;
//   * 8 < M <= 16: x through the shared-memory ring (16 warps, or 4 four per SM) where the device
//     gives a 16-warp CTA the ring (not sm_86 / sm_89: 99 KB) and gemv.x_smem allows it, else the
//     8-warp kernel with x in registers;
//   * the one-CTA-per-SM kernels (16 warps, 8 at M > 8) read the wide-row table where it is
//     built and fits (gemv.wide_table=0: never).
template <typename Facts>
GemvPlan plan_gemv_on(int m, int n, int k, int bits, DType dtype, const gemv::GemvTarget& t, int splits,
                      const GemvOverrides& o, Facts&& facts) {
  using namespace gemv;
  const Heuristics& h = *t.heuristics;
  const int ku = k_units(k), nu = n_units(n);
  const int sms = t.num_sms > 0 ? t.num_sms : 1;
  const int mt = m > kGemvOneTileM ? 2 : 1;
  const auto fits = [&](const GemvKey& key, int chunk) {
    const GemvKernelFacts* f = facts(key);
    return f != nullptr && f->smem_bytes <= t.smem_optin && (key.slabs == 0 || chunk <= f->xr_units);
  };
  const auto key_of = [&](int kmt, int warps, bool wide, bool x_smem, int slabs) {
    GemvKey key;
    key.bits = bits;
    key.dtype = dtype;
    key.mt = kmt;
    key.warps = warps;
    key.wide = wide;
    key.x_smem = x_smem;
    key.slabs = slabs;
    return key;
  };
  // x resident needs clusters and a device that gives the 16-slab CTAs their shared memory
  const bool resident_layout = t.clusters && fits(key_of(2, kWideWarps, false, true, 16), 0) &&
                               fits(key_of(1, kWideWarps, false, true, 16), 0);
  const bool resident_ok = o.x_resident && resident_layout;
  // (devices without clusters: n[1] alone matters, the launch runs S = 1 anyway)
  Clusters cl = t.clusters ? t.cluster_capacity : Clusters{};
  if (cl.n[1] <= 0) cl.n[1] = sms;
  const Plan plan = choose_plan(h, m, nu, ku, bits, sms, cl, resident_ok);
  int s = splits > 0 ? splits : plan.splits;
  if (s > kMaxSplits) s = kMaxSplits;
  if (s > ku) s = ku;
  if (!t.clusters) s = 1;
  int warps = plan.warps, slabs = plan.slabs;
  if (slabs > 0 && splits > 0) slabs = choose_xr(h, m, nu, ku, bits, sms, cl, s).slabs;
  // forced G: x resident with it wherever the device and the K range allow, whatever the model says
  if (xr_slabs_built(o.slabs) && resident_layout) {
    const XrPlan xr = choose_xr(h, m, nu, ku, bits, sms, cl, splits > 0 ? s : 0, o.slabs);
    if (xr.slabs > 0) {
      slabs = xr.slabs;
      if (splits <= 0) s = xr.splits;
    }
  }
  if (slabs > 0) {
    warps = xr_warps(slabs);
  } else if (o.warps == kNarrowWarps || o.warps == kWarps || o.warps == kWideWarps) {
    warps = o.warps;
  } else if (splits > 0 && warps == kWideWarps && (long long)nu * s > t.num_sms) {
    warps = kWarps;  // a forced split that no longer fits one CTA per SM
  }
  GemvPlan r;
  r.splits = s;
  r.chunk = div_up(ku, s);
  r.pdl = t.pdl;
  r.pdl_trigger = t.pdl_trigger;
  // the kernel
  if (slabs > 0) {
    const GemvKey wide = key_of(mt, xr_warps(slabs), true, true, slabs);
    r.key = o.wide_table && fits(wide, r.chunk) ? wide : key_of(mt, xr_warps(slabs), false, true, slabs);
    return r;
  }
  // one CTA per SM: the wide-row table where it is built and fits
  const auto alone = [&](int kmt, int w, bool x_smem) {
    const GemvKey wide = key_of(kmt, w, true, x_smem, 0);
    return o.wide_table && fits(wide, 0) ? wide : key_of(kmt, w, false, x_smem, 0);
  };
  if (mt == 2) {
    if (o.x_smem && fits(key_of(2, kWideWarps, false, true, 0), 0))
      r.key = warps == kNarrowWarps ? key_of(2, kNarrowWarps, false, true, 0) : alone(2, kWideWarps, true);
    else
      r.key = alone(2, kWarps, false);
  } else {
    r.key = warps == kWideWarps ? alone(1, kWideWarps, false) : key_of(1, warps == kNarrowWarps ? kNarrowWarps : kWarps, false, false, 0);
  }
  return r;
}

}  // namespace kbit
