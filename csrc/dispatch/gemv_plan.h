// The GEMV path's launch plan (kbit_gemv.cu): split-K factor, CTA size and x residency from the
// shape, the SM count and how many clusters the device runs at once (Clusters, which
// kbit_gemv.cu asks it). Host code with no CUDA runtime calls, so CI checks its choices
// on a CPU machine (tests/cpp/gemv_plan_test.cu); the kernels it plans are kbit_gemv.cuh's.
#pragma once
#include "core/layout.cuh"
#include "dispatch/launchers.h"

namespace kbit {
namespace gemv {

constexpr int kWarps = 8;                 // warps per CTA (two CTAs per SM at M <= 8)
// CTA sizes at M <= 8 (kbit_gemv.cu picks one from the grid, always 16 warps per SM; at M > 8
// kWideWarps or kNarrowWarps with x through shared memory, kWarps with x in registers):
//   kWideWarps where the grid has at most one CTA per SM anyway (64-column slabs x splits
//   <= SMs, e.g. 4096x14336 and 4096x4096 at S = 2): twice the warps per SM to hide the DRAM
//   latency;
//   kNarrowWarps (four CTAs per SM) where the slabs fit four per SM but not two: one wave
//   instead of 1.7 on 28672x4096 (448 slabs, 264 two-per-SM slots).
constexpr int kWideWarps = 16;
constexpr int kNarrowWarps = 4;
constexpr int kMaxSplits = 8;             // portable cluster size

// Clusters of s CTAs, one CTA per SM, that the device runs at once (n[s], s = 1..kMaxSplits;
// kbit_gemv.cu asks it, cudaOccupancyMaxActiveClusters). A cluster sits in one GPC, so n[s] is
// below SMs / s where s does not divide a GPC's SMs: the H200 holds 132, 66, 39, 30, 22, 17,
// 15, 15, so 32 clusters of four (128 CTAs on 132 SMs) run in two waves. The one-per-SM plans
// count clusters against these, never CTAs against SMs.
struct Clusters {
  int n[kMaxSplits + 1];
};

// x resident (8 < M <= 16, sm_90): the per-warp x ring (kbit_gemv.cuh, kXRowBytes) makes x's
// L2 -> SM bytes equal the weights' DRAM bytes (a CTA owns one 64-column slab, so each unit's
// 16 x 64 x tile serves 64 columns),
// and both streams share the L2 -> SM bandwidth: the 8B step at M = 16 took 1.45x its time at
// M = 1, where Marlin and Machete (x tiles shared by a CTA's 128-256 columns) take 1.0-1.1x.
// So a 16-warp CTA instead owns G slabs (kXrSlabs: 2, 4 or 16; 16 / G warps per slab) and
// loads the x rows of its whole K range into shared memory once, before its main loop, in the
// ring's row layout: x bytes per weight / G, no per-unit copies or waits, and no x traffic in
// the loop. Up to xr_max_units(MT) units of K per CTA (the split takes the rest). At M <= 8
// (one n8 tile, 1152 B of x a unit) the same, with the register kernels' stage count.
constexpr int kXrSlabs[] = {2, 4, 16};
// Clusters of four one-warp-per-slab CTAs (S = 4 below) may instead hold 15 slabs in 15 warps,
// where that puts more of them to work in one wave: Llama-3-8B's gate_up (448 slabs) runs 30
// clusters (120 SMs) instead of 28 (112); the H200 holds 30 at once (Clusters), so 14 slabs
// (32 clusters) ran two waves, 1.7-2.2x the time. Against 16 slabs (H200, alternated
// twice in one call, bench_decode_gemv_g15_5c74794.json), gate_up at M = 6..16 K = 3 / 4 / 5
// (K=5 from M = 12): 0-1.1% / 0-3.1% / 2.0-2.5% faster; the 8B step 0.3-1.0%, about the
// run-to-run spread (K=5 at M = 6, 8, whose plan did not change: -0.5, -0.6%).
constexpr int kXrFillSlabs = 15;
// warps of an x-resident CTA of g slabs: 16, or one a slab for the 15-slab CTAs
__host__ __device__ constexpr int xr_warps(int g) { return g == kXrFillSlabs ? kXrFillSlabs : kWideWarps; }
// the slab counts an x-resident CTA is built for (kbit_gemv.cuh, launch_xr), and whether its
// warps have a slab each (no cross-warp sum; the S = 4 clusters of four)
constexpr bool xr_slabs_built(int g) {
  return g == kXrSlabs[0] || g == kXrSlabs[1] || g == kXrSlabs[2] || g == kXrFillSlabs;
}
constexpr bool one_warp_a_slab(int g) { return xr_warps(g) == g; }
// M > 8: (227 KB - the 64 KB reduction scratch) / 2304 B of x a unit, rounded down; M <= 8:
// the same 162 KB of x rows (144 x 1152 B), enough for K = 9216 at S = 1
__host__ __device__ constexpr int xr_max_units(int mt) { return mt == 2 ? 72 : 144; }

// Split-K factor S (cluster size) and CTA size from the shape alone. Measured on the H200 (in
// a CUDA graph of an 8B decode step, benchmarks/bench_decode.py --kbit-paths gemv:1,...;
// before that with bench_gemm.py --sweep-splits): a CTA has a fixed cost of a few microseconds
// (pipeline fill, table, cluster reduction), and a second wave of CTAs costs a whole CTA
// time, so every rule below aims at one wave of 16 warps per SM:
//   * NU <= SMs (every slab gets an SM): one CTA per SM, the largest S whose NU clusters of S
//     the device runs at once (Clusters; about NU * S <= SMs);
//     at M <= 8 those CTAs have 16 warps (kWideWarps). 6144x4096 (NU = 96): 8.3 us at S = 1
//     against 9.1 at S = 2 with 8-warp CTAs; 4096x14336 (NU = 64): 13.1 us at S = 2 against
//     15.0 with 8-warp CTAs, 18.6 at S = 1.
//   * M > 8 (two n8 tiles of x, 128 registers with x staged in shared memory): 16-warp CTAs,
//     one per SM, at NU <= SMs and beyond 4 SMs; four 4-warp CTAs per SM between, as below.
//   * SMs < NU <= 4 SMs: four 4-warp CTAs per SM (kNarrowWarps), the largest S with
//     NU * S <= 4 SMs while each warp still streams >= kNarrowMinUnits units (28672x4096: 448
//     CTAs in one wave, where 8-warp CTAs took 1.7 waves of two per SM; at M = 9..16, K = 2..5,
//     in the decode graph: 0.88-1.05x the wgmma kernel's time, same call, gemv_narrow_m9_16_wip.json;
//     the whole step at M = 9..16 0.92-1.00x, so the GEMV now serves it, kbit_ops.h).
//   * else, at M <= 8: two 8-warp CTAs per SM when every warp still streams >= 8 units, one
//     per SM otherwise; S = 1 once NU alone covers that (57344x8192).
// KBIT_GEMV_WARPS = 4 | 8 | 16 forces the CTA size (tuning; read once); at M > 8 every size
// but 4 runs 16 warps where x goes through shared memory, and every size runs 8 where it does
// not (KBIT_GEMV_XSMEM=0, sm_86 / sm_89: kbit_gemv.cuh, launch_dt). Known gap: the plan does
// not know which, so where x stays in registers a layer of SMs < NU <= 4 SMs keeps the 4-warp
// split (up to 4 SMs / NU), more waves of 8-warp CTAs than its own plan would take. Slower,
// not wrong; the fix is to decide x's route before the plan and pass it in.
// Units a warp of the four-per-SM CTAs streams at least (SMs < NU <= 4 SMs). With 8, short-K
// layers costed S = 1 here, which lost to x resident in two-slab CTAs, itself slower than S = 3:
// Phi-3-mini's qkv (9216x3072, 144 slabs, 48 units) took 15.9 / 18.7 us at M = 1 / 16 with the
// plan (G = 2, S = 1) against 14.3 / 15.7 in 4-warp CTAs at S = 3, 4 units a warp (L2 flushed,
// H200, be87f50, bench_gemm.py --sweep-splits, KBIT_GEMV_WARPS=4 for the forced ones). Where x
// may be resident (sm_90, KBIT_GEMV_XRES unset) no other layer of that sweep (16384x3072,
// 17920x1536, 22016x2048, 14336x4096, 18944x3584, 12288x5120) changes plan, nor any of
// Llama-3-8B / 70B, Qwen2.5-7B or Gemma-2-9B; with KBIT_GEMV_XRES=0, 16384x3072 at K=2 goes
// from S = 1 to S = 2 too (not measured).
constexpr int kNarrowMinUnits = 4;

struct Plan {
  int splits, warps, slabs = 0;  // slabs > 0: x resident, that many slabs per CTA of xr_warps(slabs)
};

// Estimated time of a plan, in units of one warp's unit time: the busiest warp's units, each
// costing 1 + (M / 32) / G (x's share of the L2 -> SM bytes, which grows with M: at M = 16 the
// x ring, G = 1, took the 8B step to 1.45x its M = 1 time), plus a fixed 2 (table, pipeline
// fill, reduction; 1.5 with one warp per slab, whose partial sums need no cross-warp pass) and
// 1.5 for a cluster reduction, times the waves of `per_sm` CTAs per SM. `s4_unit`: one warp per
// slab in clusters of four streams its units 10% faster than the resident plans of several
// warps per slab (measured, not explained; choose_xr ranks with it at K=4, choose_plan does not).
constexpr double kS4Unit = 0.9;
inline double plan_cost(int m, int nu, int ku, int num_sms, int s, int g, int warps, int per_sm,
                        bool s4_unit = false) {
  const int chunk = div_up(ku, s);
  const long long waves = div_up((long long)div_up(nu, g) * s, (long long)num_sms * per_sm);
  const double fixed = warps == g ? 1.5 : 2.0, unit = s4_unit && warps == g && s == 4 ? kS4Unit : 1.0;
  return waves * (div_up(chunk, warps / g) * (1.0 + m / 32.0 / g) * unit + fixed + (s > 1 ? 1.5 : 0.0));
}

// x resident (kbit_gemv.cuh, kXrSlabs): slabs per CTA G and split S for 16-warp CTAs, one per
// SM, by plan_cost; ties go to the larger G (less x), then the smaller S. S <= 2, but for
// S = 4 at G = 16 in one wave with >= 8 units a warp (kS4Min), K >= 3 (kS4MinBits). x resident
// with S = 4 and several warps per slab took twice the time of the ring on 4096x4096 and
// 4096x14336 (G = 2: 15.3 / 31.6 against 9.1 / 17.8 us in the 8B decode step at M = 12, H200;
// G = 4 on qkv / o at M = 1..16 1.1-1.4x); one warp per slab (G = 16), each streaming its slab's K range of a
// cluster of four, is what won: 28672x4096 at M = 12 / 16 28.5 / 28.8 us against the plan's
// G = 4, S = 1 31.5 / 31.9 (M = 4 / 8: 23.1 / 23.3 against 25.1 / 26.8, which the model does
// not see; bench_decode_gemv_xr_g16s4_dfc970f.json), and in two or more waves it lost
// (128256x4096 at M = 16 140 against 99 us). K=2 loses with it (28672x4096 at M = 11 / 12 / 16:
// 29.0 / 29.1 / 29.1 against 27.7 / 27.9 / 28.7 us; K=5 -1-2%). K=3 lost too (31.7 / 31.8 / 31.7
// against 30.8 / 30.8 / 31.4) until the x-resident kernels read the wide-row table (0af1424);
// since then it wins (kS4MinBits): 27648x5120 at M = 9..16 38.2-38.8 against 43.5-45.9 us,
// 28672x4096 and 22016x4096 at M = 11..16 -2..-3.5%, the 8B step at M = 11 / 12 / 16 -0.8 /
// -1.7 / -2.5% (bench_gemv_k3_s4_d372645.json, against a build with KBIT_GEMV_DEV_NO_K3S4,
// same call). At K=4 the ranking gives G = 16, S = 4 a 0.9 unit cost (kS4Unit), which takes it
// from M = 6 on 28672x4096 and layers like it: gate_up 23.3 / 23.4 / 28.5 us at M = 6 / 8 / 10
// against G = 4's 26.6 / 26.8 / 30.8 (bench_decode_gemv_s4_rank_f0b76b0.json). K=3 too since its
// layout stores nibble words (eighteenth session): 8B step at M = 6 / 8 / 12 / 16 1700 / 1756 /
// 2117 / 2133 against 1805 / 1880 / 2137 / 2142 us; at K=5 the discount was 0.4% faster to 1.4%
// slower (bench_decode_gemv_s4_rank_k3_k5_cbea5e3.json, both plans alternated twice in one call).
// `forced_s` > 0 fixes S, `forced_g` > 0 G (kXrFillSlabs only when forced). G = 0 where no K
// range fits. Where G = 16, S = 4 wins, G = 15 replaces it if it makes more clusters that still
// fit one wave (kXrFillSlabs, above). The wave check counts clusters (Clusters): by SMs / 4,
// 481..528 slabs (32768 columns, say) would take S = 4 in two waves.
constexpr int kS4Min = 8;
// the smallest bit width that takes S = 4 (above)
constexpr int kS4MinBits = 3;
struct XrPlan {
  int splits, slabs;
  double cost, rank;  // the model's lowest cost over the candidates; this one's rank (kS4Unit)
};
inline XrPlan choose_xr(int m, int nu, int ku, int bits, int num_sms, const Clusters& cl, int forced_s,
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
          (se != 4 || bits < kS4MinBits || chunk < kS4Min || div_up(nu, g) > cl.n[4]))
        continue;
      const double cost = plan_cost(m, nu, ku, num_sms, se, g, warps, 1);
      const double rank = plan_cost(m, nu, ku, num_sms, se, g, warps, 1, bits == 3 || bits == 4);
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

// The plan without x resident (x in registers at M <= 8, the per-warp ring above).
inline Plan choose_plan_classic(int m, int nu, int ku, int num_sms, const Clusters& cl) {
  const int s_max = ku < kMaxSplits ? ku : kMaxSplits;
  // four CTAs per SM: the largest S with NU * S <= 4 SMs and >= kNarrowMinUnits units per warp
  const auto largest_narrow = [&]() {
    int s = 1;
    while (s < s_max && (long long)nu * (s + 1) <= 4LL * num_sms &&
           div_up(div_up(ku, s + 1), kNarrowWarps) >= kNarrowMinUnits)
      ++s;
    return s;
  };
  // one CTA per SM: the largest S whose NU clusters run at once (Clusters). Counting NU * S
  // against SMs instead ran Llama-3.2-1B's 2048-column layers (32 slabs) at S = 4, 32 clusters
  // of four in two waves on the H200: 2048x8192 K=4 M = 16 took 18.1 us against S = 3's 13.3,
  // Qwen2.5-1.5B's 1536x8960 (S = 5 before, 22 clusters of five fit) 17.5 against S = 4's 12.6
  // (bench_gemm_gemv_small_models_dce4584.json)
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

// x resident where the model says it beats the classic plan: at 8 < M <= 16 28672x4096 (G = 4; from
// M = 11 G = 16 in clusters of four at K = 5, from M = 6 at K = 4, and below M = 6 at K = 3, 4 by
// the rule at the end) and the larger layers (G = 16), not the 8B model's
// three others (sm_90: clusters and 227 KB CTAs); at M <= 8, where x is half the bytes or less,
// only by a 10% margin, which the model's missing term (the copy before the loop) needed (H200, 8B
// decode step, same call, K=4, x resident / classic, us: 28672x4096 at M = 1, model 0.98: 29.6 /
// 27.6 in bench_gemm.py and the step 1710 / 1637; M = 4, 0.93: step 1809 / 1783; M = 8, 0.86: 1964
// / 2053; 128256x4096 at M = 1, 0.80: 88.0 / 99.7; 57344x8192 at M = 1, 0.91: 82.1 / 82.5, M = 4,
// 0.85: 82.7 / 85.3).
// `resident_ok`: the device has clusters and gives a CTA the resident layout's shared memory
// (sm_90, launch_gemv asks), and KBIT_GEMV_XRES=0 is not set.
inline Plan choose_plan(int m, int nu, int ku, int bits, int num_sms, const Clusters& cl, bool resident_ok) {
  const Plan classic = choose_plan_classic(m, nu, ku, num_sms, cl);
  if (!resident_ok) return classic;
  const XrPlan xr = choose_xr(m, nu, ku, bits, num_sms, cl, 0);
  const int s = div_up(ku, div_up(ku, classic.splits));
  const int per_sm = classic.warps == kNarrowWarps ? 4 : classic.warps == kWarps ? 2 : 1;
  const double margin = m > kGemvOneTileM ? 1.0 : 0.9;
  if (xr.slabs > 0 && xr.cost < margin * plan_cost(m, nu, ku, num_sms, s, 1, classic.warps, per_sm))
    return {xr.splits, xr_warps(xr.slabs), xr.slabs};
  // K=3 where the classic plan is four 4-warp CTAs per SM: the x-resident clusters of four win
  // at every M, not only from M = 6 where the model takes them, if they put >= 80% of the SMs
  // to work. Those 4-warp CTAs read the packed pair table (three instructions a pair against
  // the resident kernels' two) and K=3's fourth nibble word costs five more, so they are bound
  // by instructions, not bytes: 28672x4096 at M = 1..5 took 23.6-25.3 us at K=3, as many as at
  // K=4 (23.4-26.4), against 20.6-21.2 in 15-slab clusters of four (8B step at M = 1 / 5: 1585 /
  // 1772 -> 1487 / 1648 us). L2 flushed, at M = 1 / 4: 28672x4096 (120 CTAs) 27.3 / 28.2 ->
  // 24.4 / 25.0 us, 27648x5120 (116) 32.0 / 33.1 -> 27.8 / 28.4; but 22016x4096 (92 CTAs) 22.5 /
  // 23.2 -> 23.8 / 24.3 and 18944x3584 (80) 20.4 / 21.3 -> 21.6 / 22.0, whence the 80%
  // (bench_decode_gemv_k3_resident_ea330db.json). K=4 too since its one-warp-a-slab CTAs scale
  // the decoded weights at M <= 8 (kbit_gemv.cuh, scale_weights): 8B gate_up at M = 1 / 2 / 4
  // 21.2 / 21.6 / 21.6 us in them against the 4-warp CTAs' 23.0 / 23.3 / 24.7 (with fp32 scales
  // they lost 3-5% at M <= 3; H200, bench_decode_gemv_k4_xr_scalew_25dd9fc.json); as a plan, the
  // 8B step at M = 1 / 5 1563 / 1687 against 1627 / 1840 us (bench_decode_gemv_k4_plan_verify_4eb4c51.json).
  if ((bits == 3 || bits == 4) && classic.warps == kNarrowWarps && xr.splits == 4 && one_warp_a_slab(xr.slabs) &&
      10LL * 4 * div_up(nu, xr.slabs) >= 8LL * num_sms)
    return {xr.splits, xr_warps(xr.slabs), xr.slabs};
  return classic;
}

}  // namespace gemv
}  // namespace kbit
