// The mma.sync kernel's tile configs and launch arguments, shared by the kernel (mma_kernel.cuh),
// its planner (dispatch/mma_plan.h) and its launcher (mma_launch.cu). Host and device code,
// torch-free, no kernel code: the planner includes it without the kernel.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace kbit {
namespace mma {

// The three tile configs (make_plan picks one; all 8 warps, warp tile 16*MB x 32):
//   0: 32 x 256 (M <= 32)   1: 64 x 256 (M <= 128)   2: 128 x 256 (large M)
constexpr int kNumCfgs = 3;
// (The cost model's efficiency of each config is the heuristics table's mma_eff.)
struct CfgDesc {
  int mb, ng, wm, wn, min_blocks, threads, tile_m, tile_n;
};
constexpr CfgDesc cfg_desc(int c) {
  return c == 0 ? CfgDesc{2, 4, 1, 8, 2, 256, 32, 256}
       : c == 1 ? CfgDesc{4, 4, 1, 8, 2, 256, 64, 256}
                : CfgDesc{8, 4, 1, 8, 1, 256, 128, 256};
}

// The kernel's arguments (the launcher fills them from the plan).
struct Params {
  const void* x;           // [m, k] row-major, fp16 / bf16
  const uint4* packed;     // tiled layout (core/layout.cuh), 16 B aligned
  const uint4* absmax;     // tiled E4M4 bytes
  const float* codebook;   // [2^bits] fp32
  const void* bias;        // [n] or nullptr
  void* y;                 // [m, n] row-major
  float4* partial;         // split-K partials [tile][split][tile elems] (fragment order)
  int* counters;           // split-K arrival counters [tile], zeroed on-stream before launch
  int m, n, k;
  int n_units, k_tiles;    // 64-column units, 64-k tiles (= layout KU)
  int m_tiles, n_tiles, splits, kt_per_split, items;
};

// A compiled kernel as the generated selector (mma_kernels.h) lists it: its launch on `grid` CTAs.
struct MmaKernel {
  cudaError_t (*launch)(const Params& p, int grid, cudaStream_t stream);
};

}  // namespace mma
}  // namespace kbit
