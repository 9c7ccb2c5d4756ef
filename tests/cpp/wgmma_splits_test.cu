// CPU replay of the wgmma kernel's plan (dispatch/wgmma_plan.h: tile_m, choose_splits through
// plan_split, one_per_sm, then choose_groups, as wg::plan_on) for K=4, the sweeps' bit width; built
// and run by tests/test_wgmma_plan.py with nvcc as host code. Reads "n k m" lines on stdin and
// prints "n k m splits ctas_per_sm groups cluster tall" for each: the cluster split before groups,
// the CTAs per SM the kernel is built for (wgmma.one_per_sm forces one at MT = 64), the cluster
// groups and their CTAs per cluster, then where plan_wgmma takes 256-token tiles their split (1:
// unsplit; 0: 128-token tiles); with the H200's
// occupancy (cudaOccupancyMaxActiveClusters for
// s = 1..16, measured on the device for every instantiation): 128-token tiles and
// the 64-token tile built for one CTA per SM run one 227 KB CTA per SM; the 16..64-token tiles
// built for two, two ~110 KB CTAs per SM packed, or one per SM spread. Arguments: plan overrides
// (dispatch/overrides.h), e.g. wgmma.split_cost=0 (the split cost at 128-token tiles; smaller
// tiles keep 0, as plan_wgmma) or wgmma.tall_split=0.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "dispatch/overrides.h"
#include "dispatch/wgmma_plan.h"
#include "wgmma/config.cuh"  // Cfg::kStages: one_per_sm's "deeper" is a property of the kernel config

using namespace kbit;
using namespace kbit::wg;

int main(int argc, char** argv) {
  constexpr int kH200Sms = 132;
  constexpr bool kDeeper = Cfg<4, 64, 256, 2, 1>::kStages > Cfg<4, 64, 256, 2, 2>::kStages;
  // resident clusters of s CTAs, s = 1..16: one CTA per SM (227 KB, or spread), two per SM (~110 KB)
  const int one_sm[kMaxSplits + 1] = {0, 132, 66, 39, 30, 22, 17, 15, 15, 9, 7, 7, 7, 7, 7, 7, 7};
  const int two_sm[kMaxSplits + 1] = {0, 264, 132, 79, 62, 47, 39, 32, 30, 23, 21, 16, 16, 14, 14, 14, 14};
  Occupancy occ128, occ64;  // one CTA per SM (MT = 128, and MT = 64 built for one), two
  occ128.per_sm = 1;
  occ64.per_sm = 2;
  occ128.spread_bytes = 232448;
  occ64.spread_bytes = 116736;
  occ128.max_splits = occ64.max_splits = kMaxSplits;
  for (int s = 1; s <= kMaxSplits; ++s) {
    occ128.clusters[s][0] = occ128.clusters[s][1] = occ64.clusters[s][1] = one_sm[s];
    occ64.clusters[s][0] = two_sm[s];
  }
  std::string text;
  for (int i = 1; i < argc; ++i) text += std::string(i > 1 ? "," : "") + argv[i];
  PlanOverrides ov;
  const std::string err = parse_overrides(text, &ov);
  if (!err.empty()) {
    std::fprintf(stderr, "%s\n", err.c_str());
    return 2;
  }
  const WgmmaOverrides& o = ov.wgmma;
  const Heuristics& h = kH200Heuristics;
  const int cost = o.split_cost >= 0 ? o.split_cost : h.wgmma_split_cost128;
  int n, k, m;
  while (std::scanf("%d %d %d", &n, &k, &m) == 3) {
    const int mt = tile_m(m, o);
    const long long tiles = (long long)div_up(n_units(n), 256 / kUnitN) * div_up(m, mt);
    int chunk = 0;
    int s = plan_split(h, tiles, k_units(k), kH200Sms, mt == 128 ? occ128 : occ64, mt == 128 ? cost : 0, 0, o, &chunk);
    int built_per_sm = mt == 128 ? 1 : 2;
    if (mt == 64 && one_per_sm(h, tiles, k_units(k), kH200Sms, occ64, occ128, 0, kDeeper,
                               fits_spread(occ64, tiles * s, kH200Sms), o, &s, &chunk))
      built_per_sm = 1;
    // then, at 128-token tiles, the cluster groups plan_wgmma adds (groups, CTAs per cluster)
    int c = s, groups = 1;
    if (mt == 128) groups = choose_groups(h, tiles, k_units(k), kH200Sms, occ128, cost, s, &c);
    // and whether plan_wgmma takes 256-token tiles instead (choose_tall, against the 128-token plan):
    // 0, else the tall plan's split (its CTAs run one per SM, as occ128's)
    const int tall = mt == 128 ? choose_tall(h, m, n, k_units(k), kH200Sms, occ128, occ128, cost, o, m <= wgmma_short_max_m(h, 4)) : 0;
    std::printf("%d %d %d %d %d %d %d %d\n", n, k, m, s, built_per_sm, groups, c, tall);
  }
  return 0;
}
