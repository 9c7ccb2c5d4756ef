// The GEMV kernels' build-time shapes, shared by the kernels (gemv_kernel.cuh) and their planner
// (dispatch/gemv_plan.h): CTA sizes, the largest cluster, the x-resident CTAs' slab counts and
// K ranges, and what a compiled kernel tells the planner about itself (GemvKernelFacts). Host
// and device code, torch-free, no kernel code: the planner includes it without the kernels.
#pragma once
#include <cuda_runtime.h>

namespace kbit {
struct StreamParams;  // core/common.cuh
namespace gemv {

// CTA sizes, always aiming at 16 warps per SM: kWideWarps where the grid has at most one CTA per
// SM anyway (more warps to hide DRAM latency), kNarrowWarps (four CTAs per SM) where the slabs fit
// four per SM but not two (one wave instead of nearly two), kWarps (two per SM) beyond.
constexpr int kWarps = 8;
constexpr int kWideWarps = 16;
constexpr int kNarrowWarps = 4;
constexpr int kMaxSplits = 8;             // portable cluster size

// x resident: a CTA owns G slabs (kXrSlabs; 16 / G warps per slab) and loads the x rows of its
// whole K range into shared memory once, before its main loop, so x's L2 -> SM bytes per weight
// fall by G and the loop has no x traffic. Up to xr_max_units(MT) units of K per CTA (the split
// takes the rest).
constexpr int kXrSlabs[] = {2, 4, 16};
// Clusters of four one-warp-per-slab CTAs may hold 15 slabs in 15 warps instead of 16 where
// that puts more of them to work in one wave (the device holds a limited number of clusters).
constexpr int kXrFillSlabs = 15;
// warps of an x-resident CTA of g slabs: 16, or one a slab for the 15-slab CTAs
__host__ __device__ constexpr int xr_warps(int g) { return g == kXrFillSlabs ? kXrFillSlabs : kWideWarps; }
// the slab counts an x-resident CTA is built for, and whether its warps have a slab each (no
// cross-warp sum)
constexpr bool xr_slabs_built(int g) {
  return g == kXrSlabs[0] || g == kXrSlabs[1] || g == kXrSlabs[2] || g == kXrFillSlabs;
}
constexpr bool one_warp_a_slab(int g) { return xr_warps(g) == g; }
// M > 8: (227 KB - the 64 KB reduction scratch) / 2304 B of x a unit, rounded down; M <= 8:
// the same 162 KB of x rows (144 x 1152 B)
__host__ __device__ constexpr int xr_max_units(int mt) { return mt == 2 ? 72 : 144; }

// What one compiled kernel tells the planner: the dynamic shared memory it needs at most (the
// device must allow a CTA that much), and the longest K range (units) an x-resident CTA holds.
struct GemvKernelFacts {
  int smem_bytes = 0;
  int xr_units = 0;
};

// A compiled kernel as the generated selector (gemv_kernels.h) lists it: its launch with `splits`
// CTAs per cluster along K, and its facts.
struct GemvKernel {
  cudaError_t (*launch)(const StreamParams& p, int splits, cudaStream_t stream);
  GemvKernelFacts facts;
};

}  // namespace gemv
}  // namespace kbit
