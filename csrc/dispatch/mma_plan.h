// The mma.sync kernel's launch plan: one of three tile configs and the split-K factor, from a
// cost model fitted on the H200 (docs/PERFORMANCE.md) whose constants are the device's table
// (dispatch/heuristics.h). A pure function of (m, n, k, num_sms, table):
// the grid and the workspace are the same on every call with these shapes (CUDA-graph safe, no
// host sync). Host code only, torch-free.
#pragma once
#include <cstddef>

#include "core/kernel_keys.h"
#include "core/layout.cuh"
#include "dispatch/heuristics.h"
#include "dispatch/overrides.h"
#include "mma/mma_config.h"

namespace kbit {
namespace mma {

constexpr int kMinKtPerSplit = 4;  // never split K finer than 4 K-tiles (256 k) per chunk
constexpr int kMaxSplits = 16;
constexpr size_t kMaxPartialBytes = size_t(64) << 20;  // split-K workspace cap (fp32 partials)

// The launch plan: a pure function of (m, n, k, bits, num_sms), so the grid and the workspace
// are the same on every call with these shapes (CUDA-graph safe, no host sync).
struct Plan {
  MmaKey key;  // the kernel: bit width, dtype and tile config (key.cfg)
  int m_tiles, n_tiles, k_tiles, n_units;
  int splits, kt_per_split, items, grid;
  size_t counter_bytes, partial_bytes;
};

// Cost model (a sweep of every config and split on six layer shapes at M = 64..4096 picks the
// measured best on all). One CTA K-tile of config c costs tile_m * tile_n / mma_eff[c] (the
// tensor-pipe efficiency of the warp tile: rows sharing each dequantized B fragment), times the
// CTAs sharing an SM (mma_alone of that when a 2-CTA config has at most one CTA per SM); items
// run in waves of num_sms * occ; each item pays its K-tiles, the grid a pipeline fill
// (mma_fill); split-K pays a partial write per item (mma_split_write) and, for the last chunk
// of a tile, reading all chunks back (mma_split_read each), and a hysteresis (mma_split_margin):
// a split has to buy a clear win over whole-K tiles.
inline double plan_cost(const Heuristics& h, int c, int m, int n_units, int k_tiles, int num_sms, int splits) {
  const CfgDesc d = cfg_desc(c);
  const int m_tiles = div_up(m, d.tile_m);
  const int n_tiles = div_up(n_units * kUnitN, d.tile_n);
  const int kps = div_up(k_tiles, splits);
  const int s_eff = div_up(k_tiles, kps);
  const long items = (long)m_tiles * n_tiles * s_eff;
  const long slots = (long)num_sms * d.min_blocks;
  const long waves = (items + slots - 1) / slots;
  double ktile = (double)d.tile_m * d.tile_n / h.mma_eff[c] * d.min_blocks / (128.0 * 256.0);
  if (d.min_blocks > 1 && items <= num_sms) ktile *= h.mma_alone;
  double t = waves * (kps + (s_eff > 1 ? h.mma_split_write : 0.0)) + h.mma_fill +
             (s_eff > 1 ? h.mma_split_read * s_eff : 0.0);
  t *= ktile;
  if (s_eff > 1) t *= h.mma_split_margin;
  return t;
}

// The plan for tile config c with K split into (at most) `splits` chunks.
inline Plan plan_for(int c, int splits, int m, int n, int k, int num_sms) {
  Plan pl{};
  const CfgDesc d = cfg_desc(c);
  pl.key.cfg = c;
  pl.n_units = n_units(n);
  pl.k_tiles = k_units(k);
  pl.m_tiles = div_up(m, d.tile_m);
  pl.n_tiles = div_up(pl.n_units * kUnitN, d.tile_n);
  pl.kt_per_split = div_up(pl.k_tiles, splits < 1 ? 1 : splits);
  pl.splits = div_up(pl.k_tiles, pl.kt_per_split);
  const long items = (long)pl.m_tiles * pl.n_tiles * pl.splits;
  const long slots = (long)(num_sms < 1 ? 1 : num_sms) * d.min_blocks;
  pl.items = (int)items;
  pl.grid = (int)(items < slots ? items : slots);
  const size_t tiles = (size_t)pl.m_tiles * pl.n_tiles;
  pl.counter_bytes = pl.splits > 1 ? (tiles * sizeof(int) + 255) / 256 * 256 : 0;
  pl.partial_bytes = pl.splits > 1 ? tiles * pl.splits * d.tile_m * d.tile_n * sizeof(float) : 0;
  return pl;
}

inline Plan make_plan(const Heuristics& h, int m, int n, int k, int bits, int num_sms) {
  (void)bits;
  const int nu = n_units(n), kt = k_units(k);
  if (num_sms < 1) num_sms = 1;
  double best = 1e300;
  int best_c = 1, best_s = 1;
  for (int c = 0; c < kNumCfgs; ++c) {
    if (c == 0 && m > h.mma_small_max_m) continue;   // 32-row tiles up to two m-tiles
    if (c == 1 && m > h.mma_mid_max_m) continue;     // 64-row tiles up to a few m-tiles
    if (c == 2 && m <= h.mma_small_max_m) continue;  // 128-row tiles only past them
    for (int s = 1; s <= kMaxSplits; ++s) {
      const int kps = div_up(kt, s);
      if (s > 1 && (kps < kMinKtPerSplit || div_up(kt, kps) != s)) continue;
      const CfgDesc d = cfg_desc(c);
      if (s > 1 && (size_t)div_up(m, d.tile_m) * div_up(nu * kUnitN, d.tile_n) * s * d.tile_m * d.tile_n *
                           sizeof(float) > kMaxPartialBytes)
        continue;
      const double t = plan_cost(h, c, m, nu, kt, num_sms, s);
      if (t < best * 0.999) {
        best = t;
        best_c = c;
        best_s = s;
      }
    }
  }
  return plan_for(best_c, best_s, m, n, k, num_sms);
}

inline size_t workspace_bytes(const Plan& pl) { return pl.counter_bytes + pl.partial_bytes; }

// The plan of one call: the cost model's, or a forced config (and split) for tests and tuning.
inline Plan plan_for_overrides(const Heuristics& h, int m, int n, int k, int bits, DType dtype, int num_sms,
                               const MmaOverrides& o) {
  Plan pl = o.config >= 0 && o.config < kNumCfgs ? plan_for(o.config, o.splits, m, n, k, num_sms)
                                                 : make_plan(h, m, n, k, bits, num_sms);
  pl.key.bits = bits;
  pl.key.dtype = dtype;
  return pl;
}

}  // namespace mma

using MmaPlan = mma::Plan;
inline size_t mma_workspace_bytes(const MmaPlan& plan) { return mma::workspace_bytes(plan); }

}  // namespace kbit
