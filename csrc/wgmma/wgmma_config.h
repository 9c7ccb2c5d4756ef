// The wgmma kernels' build-time facts the planner weighs (dispatch/wgmma_plan.h) and the
// selector's entry type (wgmma_kernels.h, generated): the largest clusters, the CTAs per SM an
// instantiation is built for, and its occupancy. Host code, torch-free, no kernel code.
#pragma once
#include <cuda_runtime.h>

namespace kbit {
struct StreamParams;  // core/common.cuh
namespace wg {

// Split-K clusters of up to 16 CTAs: sizes 9..16 are "non-portable" (sm_90 allows them with
// cudaFuncAttributeNonPortableClusterSizeAllowed); the plan takes them only for long K ranges.
constexpr int kMaxSplits = 16;
constexpr int kPortableSplits = 8;      // the largest cluster every sm_90 launch allows

// CTAs per SM an (MT tokens, CN columns, row split R) CTA is built for unless the plan asks for
// one per SM: two wherever a thread's accumulators fit 128 registers (64 fp32 with the row split
// at MT <= 64, 128 without it at 256 columns), else one.
constexpr int default_ctas_per_sm(int mt, int columns, int row_split) { return (row_split == 1 && columns == 256) || (row_split == 2 && mt <= 64) ? 2 : 1; }

// Occupancy of one kernel instantiation: CTAs one SM holds, the dynamic shared memory that leaves
// room for only one CTA per SM ("spread" launches), the largest cluster the device allows, and
// how many clusters of s CTAs can be resident at once, packed or spread.
struct Occupancy {
  int per_sm = 1;
  int spread_bytes = 0;
  int max_splits = kPortableSplits;      // kMaxSplits where the device allows non-portable sizes
  int clusters[kMaxSplits + 1][2] = {};  // [s][spread]; 0 = the API gave no answer
};

// A compiled kernel as the generated selector lists it: its launch with `grid_x` CTAs along K
// (p.groups clusters; `spread`: with spread_bytes of shared memory), its occupancy on the current
// device (the first call also opts it into its shared memory), and its pipeline stages.
struct WgmmaKernel {
  cudaError_t (*launch)(const StreamParams& p, int grid_x, bool spread, cudaStream_t stream);
  const Occupancy& (*occupancy)();
  int stages;
};

}  // namespace wg
}  // namespace kbit
