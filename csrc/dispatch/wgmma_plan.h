// The wgmma kernel's launch plan: tokens per CTA (the tile), columns per CTA, row split, how many
// CTAs per SM the instantiation is built for, the split along K (one thread-block cluster, and
// optionally several clusters reduced through a global workspace), and whether the grid is
// launched "spread" (one CTA per SM). Host code only, torch-free: the plan depends on the shape,
// the SM count and the occupancy of each kernel instantiation, which the caller supplies
// (wgmma/wgmma_launch.cu asks the CUDA occupancy API; tests/cpp/wgmma_splits_test.cu replays the
// H200's). The cost models are fitted to forced sweeps on the H200 (docs/PERFORMANCE.md);
// tests/test_wgmma_plan.py replays them against the measured times.
#pragma once
#include <cstddef>

#include "core/kernel_keys.h"
#include "core/layout.cuh"
#include "dispatch/heuristics.h"
#include "dispatch/overrides.h"
#include "dispatch/path_rule.h"
#include "wgmma/wgmma_config.h"

namespace kbit {
namespace wg {

// A grid of `ctas` that can launch spread: an SM could hold more than one, and the grid fits one
// per SM. Spreading keeps the cluster scheduler from packing two CTAs on an SM while others idle.
inline bool fits_spread(const Occupancy& occ, long long ctas, int num_sms) { return occ.per_sm > 1 && ctas <= num_sms; }
// Waves of `clusters` clusters of s CTAs: as many at once as the occupancy API counted resident,
// else the SMs' CTA slots (per_sm each, one when spread) over s. Clusters that cannot all be
// resident run in a second wave, which costs a whole CTA time.
inline long long cluster_waves(long long clusters, const Occupancy& occ, int s, bool spread, int num_sms) {
  const int counted = occ.clusters[s][spread];
  const long long resident = counted > 0 ? counted : (long long)num_sms * (spread ? 1 : occ.per_sm) / s;
  return div_up(clusters, resident > 0 ? resident : 1LL);
}
// CTAs on the busiest SM of a one-wave grid of `ctas`: one when launched spread, else as many as
// the grid puts on an SM, at most what fits.
inline long long busiest_ctas(const Occupancy& occ, long long ctas, int num_sms, bool spread) {
  const long long per_sm = div_up(ctas, (long long)num_sms);
  return spread ? 1 : per_sm < occ.per_sm ? per_sm : occ.per_sm;
}

// Tuned numbers (heuristics.h, Heuristics::wgmma_*): clusters of 9..16 CTAs pay only where each
// CTA keeps at least wgmma_big_cluster_chunk K-tiles; a split CTA's reduction at 128-token tiles
// (128 KB of partials a CTA) costs wgmma_split_cost128 of choose_splits' units. Smaller tiles use
// 0, the cost their sweeps were fitted with.

// Split-K factor from the shape and the occupancy: the fewest waves x CTA time, a CTA's time
// being its K-tiles at a rate set by how many CTAs share its SM (kAlone / kShared tenths of a
// lone CTA's K-tile), plus a fixed cost (pipeline fill, table: kFixed) and `split_cost` when split.
inline int choose_splits(const Heuristics& h, long long tiles, int ku, int num_sms, const Occupancy& occ, int split_cost,
                         const WgmmaOverrides& o, long long* cost_out = nullptr) {
  constexpr int kAlone = 10, kShared = 17, kFixed = 3 * kAlone;
  const int cap = o.max_splits > 0 ? o.max_splits : kMaxSplits;
  const int max_s = cap < 1 ? 1 : cap > occ.max_splits ? occ.max_splits : cap;
  int best = 1;
  long long best_cost = -1;
  for (int s = 1; s <= max_s && s <= ku; ++s) {
    if (s > 1 && div_up(ku, s) < 2) break;  // at least two K-tiles per CTA
    if (s > kPortableSplits && div_up(ku, s) < h.wgmma_big_cluster_chunk) break;
    const long long ctas = tiles * s;
    const bool spread = fits_spread(occ, ctas, num_sms);
    const long long waves = cluster_waves(tiles, occ, s, spread, num_sms);
    const long long busiest = busiest_ctas(occ, ctas, num_sms, spread);
    const long long per_cta = div_up(ku, s) * (busiest >= 2 ? kShared : kAlone) + kFixed + (s > 1 ? split_cost : 0);
    const long long cost = waves * per_cta;
    if (best_cost < 0 || cost < best_cost) best = s, best_cost = cost;
  }
  if (cost_out != nullptr) *cost_out = best_cost;
  return best;
}

// The split of a plan: `forced` (> 0) or choose_splits' pick, clamped to the device's largest
// cluster and the K-tiles, then the fewest CTAs that keep its K-tiles per CTA (`*chunk`), so no
// CTA is empty.
inline int plan_split(const Heuristics& h, long long tiles, int ku, int num_sms, const Occupancy& occ, int split_cost, int forced,
                      const WgmmaOverrides& o, int* chunk, long long* cost_out = nullptr) {
  int s = forced > 0 ? forced : choose_splits(h, tiles, ku, num_sms, occ, split_cost, o, cost_out);
  s = s < 1 ? 1 : s > occ.max_splits ? occ.max_splits : s > ku ? ku : s;
  *chunk = div_up(ku, s);
  return div_up(ku, *chunk);
}

// Split-K over G > 1 clusters of c CTAs each, their sums added through a global workspace, for
// layers whose few tiles leave SMs idle at one CTA per SM because the clusters that would fill
// them do not all fit (a device holds fewer clusters of s than SMs / s). Each CTA writes its
// slice of the cluster sum and the last of the G reads G of them: Heuristics::
// wgmma_group_slice_cost per 128 KB in choose_splits' units. Returns G and the cluster size in
// *c_out (s, the unsplit-group plan's cluster, where G = 1).
inline int choose_groups(const Heuristics& h, long long tiles, int ku, int num_sms, const Occupancy& occ, int split_cost, int s,
                         int* c_out, long long* cost_out = nullptr) {
  constexpr int kAlone = 10, kFixed = 3 * kAlone;  // choose_splits' units, one CTA per SM
  const auto cost = [&](int c, int g) -> long long {
    const long long waves = cluster_waves(tiles * g, occ, c, false, num_sms);
    return waves * (div_up(ku, c * g) * kAlone + kFixed + (c * g > 1 ? split_cost : 0) +
                    (g > 1 ? h.wgmma_group_slice_cost * (g + 1) / c : 0));
  };
  long long best = cost(s, 1);
  int best_g = 1;
  *c_out = s;
  for (int c = 1; c <= kPortableSplits; ++c)
    for (int g = 2; c * g <= kMaxSplits && tiles * c * g <= num_sms; ++g) {
      const int chunk = div_up(ku, c * g);
      if (chunk < 2 || (long long)(c * g - 1) * chunk >= ku) break;  // no CTA without K-tiles
      const long long v = cost(c, g);
      if (v < best) best = v, best_g = g, *c_out = c;
    }
  if (cost_out != nullptr) *cost_out = best;
  return best_g;
}

// 256-token tiles (128 columns, each decoded weight feeding twice the tokens) against the
// 128-token plan, in choose_splits' units: a tall CTA's K-tile costs wgmma_tall_k / 10 of them
// (Heuristics::wgmma_tall_*). Never below wgmma_tall_min_m rows or where the last token tile holds
// 64 rows or fewer (the TMA zero fill of the rows past M makes those tiles far slower). Where the
// unsplit tall grid leaves SMs idle (under two waves), tall CTAs may split along K in clusters of
// up to wgmma_tall_max_splits, at wgmma_tall_split_cost + split_cost a CTA, if that beats the
// unsplit tall plan by wgmma_tall_split_gain / 10.
// Returns 0 for the 128-token plan, else the tall plan's split (1: unsplit). `allow_split`: the
// tall CTAs may split (the plan passes m <= wgmma_short_max_m: above it the tile picks
// kbit::gemm's path, whose rule was measured with unsplit tall tiles).
inline int choose_tall(const Heuristics& h, int m, int n, int ku, int num_sms, const Occupancy& occ128, const Occupancy& occ_tall,
                       int split_cost, const WgmmaOverrides& o, bool allow_split = true) {
  if (m < h.wgmma_tall_min_m || m - 256 * (div_up(m, 256) - 1) <= 64) return 0;
  const long long tiles128 = (long long)div_up(n_units(n), 256 / kUnitN) * div_up(m, 128);
  const long long tiles_tall = (long long)div_up(n_units(n), 128 / kUnitN) * div_up(m, 256);
  // the 128-token plan: its split, or cluster groups where the plan would take them
  long long cost128 = 0;
  int chunk = 0;
  const int s128 = plan_split(h, tiles128, ku, num_sms, occ128, split_cost, 0, o, &chunk, &cost128);
  if (o.groups == 0) {
    long long cost_g = cost128;
    int c = s128;
    choose_groups(h, tiles128, ku, num_sms, occ128, split_cost, s128, &c, &cost_g);
    cost128 = cost_g < cost128 ? cost_g : cost128;
  }
  const long long unsplit = div_up(tiles_tall, (long long)num_sms) * ku * h.wgmma_tall_k;  // tenths of units
  long long best = unsplit;
  int best_s = 1;
  if (allow_split && tiles_tall < 2 * num_sms && o.tall_split) {
    const int over = h.wgmma_tall_split_cost + split_cost;
    for (int s = 2; s <= h.wgmma_tall_max_splits && div_up(ku, s) >= 2; ++s) {
      const long long waves = cluster_waves(tiles_tall, occ_tall, s, false, num_sms);
      const long long cost = waves * (div_up(ku, s) * h.wgmma_tall_k + 10LL * over);
      if (cost < best && cost * 10 < unsplit * h.wgmma_tall_split_gain) best = cost, best_s = s;
    }
  }
  return best < cost128 * 10 ? best_s : 0;
}

// Tokens per CTA before the tall-tile choice: the smallest wgmma N that holds M, up to 128.
inline int tile_m(int m, const WgmmaOverrides& o) {
  if (o.tile_m != 0) return o.tile_m;
  return m <= 16 ? 16 : m <= 32 ? 32 : m <= 64 ? 64 : 128;
}

// One CTA per SM at MT = 64 (the producer warpgroup, the wide table at K = 3, 4, eight stages)
// instead of two: only where it is `deeper` (more pipeline stages than two CTAs per SM have),
// runs in one wave, and gives no SM more K-tiles than the two-per-SM plan's busiest SM. Given
// the two-per-SM plan (occ2, split *s, *chunk K-tiles a CTA, launched spread or not), returns
// whether to take one per SM, and then its own split in *s and *chunk (a forced split stays).
inline bool one_per_sm(const Heuristics& h, long long tiles, int ku, int num_sms, const Occupancy& occ2, const Occupancy& occ1, int forced,
                       bool deeper, bool spread, const WgmmaOverrides& o, int* s, int* chunk) {
  const int force = o.one_per_sm;
  if (force == 0 || (force != 1 && !deeper)) return false;
  int chunk1 = 0;
  const int s1 = plan_split(h, tiles, ku, num_sms, occ1, 0, forced, o, &chunk1);
  const int resident = occ1.clusters[s1][0];  // clusters of s1 that fit at once
  const bool take = force == 1 || (tiles * s1 <= num_sms && resident >= tiles &&
                                   chunk1 <= busiest_ctas(occ2, tiles * *s, num_sms, spread) * *chunk);
  if (take) *s = s1, *chunk = chunk1;
  return take;
}

// Row split R = 2 at 32-token tiles only where a CTA runs at most Heuristics::wgmma_short_chunk
// K-tiles (two warpgroups share the decode; with long K ranges one warpgroup per CTA is faster).

// The wgmma launch of one call: the kernel (key: tile_m, columns, row split, CTAs per SM it is
// built for, the tall CTA's split build) and its launch.
struct WgmmaPlan {
  WgmmaKey key;
  int splits = 1;         // CTAs per cluster along K
  int groups = 1;         // clusters along K whose sums meet in the workspace (1: none)
  int token_tiles = 0;    // grid y
  int column_groups = 0;  // grid z
  int launch_per_sm = 1;  // CTAs per SM the launch allows (1: spread, or built for one)
  int chunk = 0;          // K-tiles per CTA
  bool spread = false;    // launched with the shared memory of half an SM
  bool y_tma = false;     // the unsplit epilogue stores y through TMA
  bool pdl = false;       // programmatic dependent launch
  int grid_x() const { return splits * groups; }
  int tile_m() const { return key.tile_m; }
  int columns() const { return key.columns; }
};

// What the plan needs of the device and the instantiations: the bit width and dtype (the keys'),
// the SM count, the tuned numbers, whether the 64-token tile built for one CTA per SM has more
// stages than the one built for two (a property of the bit width's kernel config), and the
// occupancy of instantiation (MT, CN, R, CPS) as occ(...).
struct WgmmaTarget {
  int bits = 4;
  DType dtype = DType::kHalf;
  int num_sms = 1;
  const Heuristics* heuristics = &kGenericHeuristics;
  bool one_per_sm_deeper = false;
  bool pdl = false;
};

// The plan of one call. `splits` > 0 forces the split (clamped to 1..min(the device's largest
// cluster, K-tiles)). y leaves through TMA where the call is unsplit and N % 8 == 0 (the y
// tensor map's row stride must be a 16 B multiple; the launcher checks y's alignment) unless
// wgmma.y_tma=0.
template <typename OccupancyFn>
WgmmaPlan plan_on(int m, int n, int k, int splits, const WgmmaTarget& t, const WgmmaOverrides& o, OccupancyFn&& occ) {
  const Heuristics& h = *t.heuristics;
  const int num_sms = t.num_sms > 0 ? t.num_sms : 1, ku = k_units(k);
  WgmmaPlan pl;
  int mt = tile_m(m, o);
  const int cost128 = o.split_cost >= 0 ? o.split_cost : h.wgmma_split_cost128;
  // the tall CTA splits K in one cluster only: forced cluster groups keep 128 tokens
  const bool forced_split = splits > 1 || o.groups >= 2;
  if (mt == 256 && o.groups >= 2) mt = 128;
  int tall_split = 1;  // forced 256-token tiles: unsplit unless the split is forced too
  if (mt == 128 && splits == 0 && !forced_split && o.tile_m == 0) {
    const int tall = choose_tall(h, m, n, ku, num_sms, occ(128, 256, 2, 1), occ(256, 128, 2, 1), cost128, o,
                                 m <= wgmma_short_max_m(h, t.bits));
    if (tall > 0) mt = 256, tall_split = tall;
  }
  const int gz = div_up(m, mt);
  const int columns = mt == 256 ? 128 : mt <= 64 && o.wide ? 512 : 256;
  const int gy = div_up(n_units(n), columns / kUnitN);
  const long long tiles = (long long)gy * gz;
  // the split from R = 1's occupancy at MT <= 32 (the same two CTAs per SM as R = 2)
  const int split_row_split = columns == 512 || mt <= 32 ? 1 : 2;
  const Occupancy& occ_split = occ(mt, columns, split_row_split, default_ctas_per_sm(mt, columns, split_row_split));
  const int split_cost = mt == 128 ? cost128 : 0;
  int chunk = 0;
  int s = plan_split(h, tiles, ku, num_sms, occ_split, split_cost, mt == 256 && splits == 0 ? tall_split : splits, o,
                     &chunk);
  int row_split = columns == 512 || mt == 16 ? 1 : mt >= 64 || chunk <= h.wgmma_short_chunk ? 2 : 1;
  if (columns == 256 && mt == 32 && (o.row_split == 1 || o.row_split == 2)) row_split = o.row_split;
  int built_per_sm = default_ctas_per_sm(mt, columns, row_split);
  const Occupancy& occ_plan = occ(mt, columns, row_split, built_per_sm);
  bool spread = fits_spread(occ_plan, tiles * s, num_sms) && o.spread;
  if (mt == 64 && columns == 256 &&
      one_per_sm(h, tiles, ku, num_sms, occ_plan, occ(64, 256, 2, 1), splits, t.one_per_sm_deeper, spread, o, &s, &chunk))
    built_per_sm = 1, spread = false;
  // cluster groups: s becomes the cluster size, the grid s x groups along K
  int groups = 1;
  if (o.groups >= 2) {
    groups = o.groups;
  } else if (o.groups == 0 && splits == 0 && mt == 128) {  // one CTA per SM
    groups = choose_groups(h, tiles, ku, num_sms, occ_split, split_cost, s, &s);
  }
  // (a forced G: at most what leaves every CTA a K-tile)
  while (groups > 1 && (long long)(s * groups - 1) * div_up(ku, s * groups) >= ku) --groups;
  if (groups > 1) {
    chunk = div_up(ku, s * groups);
    spread = false;
  }
  pl.key.bits = t.bits;
  pl.key.dtype = t.dtype;
  pl.key.tile_m = mt;
  pl.key.columns = columns;
  pl.key.row_split = row_split;
  pl.key.built_per_sm = built_per_sm;
  pl.key.split_tall = mt == 256 && s * groups > 1;  // the tall CTAs split along K: their own build
  pl.splits = s;
  pl.groups = groups;
  pl.token_tiles = gz;
  pl.column_groups = gy;
  pl.launch_per_sm = spread || built_per_sm == 1 ? 1 : occ_plan.per_sm;
  pl.chunk = chunk;
  // (the tall CTAs' split build launches packed: one per SM as built)
  pl.spread = !pl.key.split_tall && pl.launch_per_sm == 1 && occ(mt, columns, row_split, built_per_sm).per_sm > 1;
  pl.y_tma = o.y_tma && pl.grid_x() == 1 && n % 8 == 0;
  pl.pdl = t.pdl;
  return pl;
}

// Workspace of a plan: none without cluster groups; else a counter per tile and cluster rank
// (256 B steps), then each group's fp32 sum of every tile.
inline size_t group_counters(const WgmmaPlan& p) {
  return p.groups > 1 ? size_t(p.token_tiles) * p.column_groups * p.splits : 0;
}
inline size_t group_counter_bytes(const WgmmaPlan& p) { return (group_counters(p) * sizeof(int) + 255) / 256 * 256; }
inline size_t workspace_bytes(const WgmmaPlan& p) {
  return p.groups > 1 ? group_counter_bytes(p) +
                            size_t(p.token_tiles) * p.column_groups * p.groups * p.key.columns * p.key.tile_m * sizeof(float)
                      : 0;
}

}  // namespace wg

using WgmmaPlan = wg::WgmmaPlan;

}  // namespace kbit
