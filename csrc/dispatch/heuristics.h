// The tuned numbers of the launch plans and the path rule, one table per GPU, chosen from the
// device's properties. The path rule and the GEMV, mma.sync, wgmma and FP8 GEMM plans
// (path_rule.h, gemv_plan.h, mma_plan.h, wgmma_plan.h, fp8_plan.h) read every tuned threshold
// and cost from a Heuristics; the rules themselves stay in the planners.
// A new GPU is a new table here (and a line in choose_heuristics), not a code change.
// Host code only, torch-free, no CUDA headers: the CPU replays in tests/cpp use the tables as
// they are, and the Python tests read this file (tests/heuristics_tables.py).
//
// Where the numbers come from (docs/DESIGN.md, "Heuristics as data"): the GEMV, mma.sync and
// wgmma cost models and the path thresholds were fitted to forced sweeps on the H200 and then
// checked on the H100 (docs/PERFORMANCE.md has both GPUs' figures); the H100 and H200 tables
// hold the same values, so either GPU plans as before. The generic table serves GPUs without
// the wgmma kernel (sm_80, sm_86, sm_89), whose GEMV and mma.sync plans adapt through the device
// facts they read (SM count, cluster capacity, shared memory per CTA); it keeps the same values.
#pragma once
#include <cstring>

namespace kbit {

struct Heuristics {
  const char* name;  // which table: printed by vllm_kbit.check and the benchmarks
  // ---- path rule (path_rule.h), indexed by bits - 2
  int wgmma_max_m[4];        // the wgmma kernel serves M up to here ...
  int wgmma_short_max_m[4];  // ... every layer up to here, above only with 256-token tiles
  int dequant_min_m;         // from here dequantize + cuBLAS beats the mma.sync kernel
  // ---- GEMV plan (gemv_plan.h)
  int gemv_narrow_min_units;     // units a warp of the four-per-SM CTAs streams at least
  double gemv_s4_unit;           // a one-warp-a-slab unit in clusters of four, against 1.0
  int gemv_s4_min_units;         // units a warp needs for the resident split S = 4
  int gemv_s4_min_bits;          // the resident split S = 4 from this K
  double gemv_resident_margin;   // M <= 8: x resident must beat the classic plan by this factor
  int gemv_fill_percent;         // K = 3, 4: clusters of four win if they use this % of the SMs
  // ---- wgmma plan (wgmma_plan.h), in choose_splits' units unless said otherwise
  int wgmma_big_cluster_chunk;   // clusters of 9..16 CTAs need this many K-tiles a CTA
  int wgmma_split_cost128;       // a split CTA's reduction at 128-token tiles
  int wgmma_group_slice_cost;    // a cluster group's slice of the workspace, per 128 KB
  int wgmma_tall_min_m;          // no 256-token tiles below this M
  int wgmma_tall_k;              // a tall CTA's K-tile, in tenths of the units
  int wgmma_tall_split_cost;     // a tall CTA's split overhead (plus the split cost)
  int wgmma_tall_max_splits;     // the largest split of the tall CTAs
  int wgmma_tall_split_gain;     // a tall split must beat the unsplit plan by this / 10
  int wgmma_short_chunk;         // 32-token tiles: row split 2 up to this many K-tiles a CTA
  // ---- mma.sync plan (mma_plan.h), in K-tiles of the 128 x 256 config
  double mma_eff[3];             // tensor-pipe efficiency of configs 0, 1, 2 (rows per B fragment)
  double mma_alone;              // a two-CTA config's K-tile where the grid has <= 1 CTA per SM
  double mma_split_write;        // a split item's partial write
  double mma_fill;               // the grid's pipeline fill
  double mma_split_read;         // the last chunk's read-back, per chunk
  double mma_split_margin;       // a split must beat whole-K tiles by this factor
  int mma_small_max_m;           // 32-row tiles up to this M, 128-row tiles above
  int mma_mid_max_m;             // 64-row tiles up to this M
  // ---- FP8-activation GEMM plan (fp8_plan.h): a tile is taken where its CTAs fill this % of the SMs
  int fp8_wide_fill_percent;     // 128 x 256 (the wide CTA, one per SM)
  int fp8_tile128_fill_percent;  // else 128 x 128 (two per SM), else 64 x 128
  // ---- kbit::gemm_fp8's path (fp8_plan.h): below both, the 16-bit kbit::gemm (faster there)
  int fp8_decode_min_m;          // decode the weights to e4m3 once, then a scaled_mm, from here
  int fp8_fused_min_m;           // the fused kernel from here where no scaled_mm serves (2^30: never)
};

// The H100 and H200 tables: the values the sweeps chose (docs/PERFORMANCE.md).
constexpr Heuristics kH100Heuristics = {"h100", {4096, 4096, 3072, 1024}, {1023, 1023, 1023, 512}, 512,
                                        4, 0.9, 8, 3, 0.9, 80,
                                        16, 40, 40, 192, 88, 30, 3, 9, 48,
                                        {0.4, 0.6, 1.0}, 0.7, 0.5, 2.0, 2.0, 1.1, 64, 256, 100, 100, 1024, 1073741824};
constexpr Heuristics kH200Heuristics = {"h200", {4096, 4096, 3072, 1024}, {1023, 1023, 1023, 512}, 512,
                                        4, 0.9, 8, 3, 0.9, 80,
                                        16, 40, 40, 192, 88, 30, 3, 9, 48,
                                        {0.4, 0.6, 1.0}, 0.7, 0.5, 2.0, 2.0, 1.1, 64, 256, 100, 100, 1024, 1073741824};
constexpr Heuristics kGenericHeuristics = {"generic", {4096, 4096, 3072, 1024}, {1023, 1023, 1023, 512}, 512,
                                           4, 0.9, 8, 3, 0.9, 80,
                                           16, 40, 40, 192, 88, 30, 3, 9, 48,
                                        {0.4, 0.6, 1.0}, 0.7, 0.5, 2.0, 2.0, 1.1, 64, 256, 100, 100, 1024, 1073741824};

// What the choice reads of a device (cudaDeviceProp's fields of the same meaning).
struct DeviceFacts {
  const char* name = "";
  int major = 0, minor = 0;
  int num_sms = 0;
  long long l2_bytes = 0;
  long long global_mem_bytes = 0;
};

// The table of a device: the H200 (141 GB of HBM3e) and the H100 by compute capability 9.0 and
// memory size (the name as a tie-breaker for renamed boards), every other GPU the generic one.
inline const Heuristics& choose_heuristics(const DeviceFacts& d) {
  if (d.major == 9 && d.minor == 0) {
    const bool h200 = std::strstr(d.name, "H200") != nullptr || d.global_mem_bytes > (100LL << 30);
    return h200 ? kH200Heuristics : kH100Heuristics;
  }
  return kGenericHeuristics;
}

// The current device's table, chosen once per device (dispatch/device_heuristics.cu).
const Heuristics& device_heuristics();

}  // namespace kbit
