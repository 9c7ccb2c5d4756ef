// Which kernel kbit::gemm runs for a shape: the path rule, from M and the bit width, and
// between wgmma_short_max_m and wgmma_max_m from the wgmma plan's tile. Host code only,
// torch-free. docs/DESIGN.md explains the rule; docs/PERFORMANCE.md has the measurements
// behind each threshold.
#pragma once
#include "dispatch/heuristics.h"

namespace kbit {

enum Path : int { kAutoPath = 0, kGemvPath = 1, kMmaPath = 2, kDequantPath = 3, kWgmmaPath = 4 };

// Largest M the GEMV path serves (its tensor-core kernel takes up to two n8 tiles of x rows).
constexpr int kGemvMaxM = 16;
// Above it x takes two n8 tiles in the GEMV kernels.
constexpr int kGemvOneTileM = 8;
// The dequantize + cuBLAS path's scratch budget: every layer of an 8B model in one chunk.
constexpr long long kDequantChunkMib = 256;

inline int gemv_max_m(int /*bits*/) { return kGemvMaxM; }
// From here dequantize + cuBLAS beats the mma.sync kernel (GPUs without the wgmma kernel).
inline int dequant_min_m(const Heuristics& h, int /*bits*/) { return h.dequant_min_m; }
// The wgmma kernel serves M up to here (on Hopper builds with sm_90a code) ...
inline int wgmma_max_m(const Heuristics& h, int bits) { return h.wgmma_max_m[bits - 2]; }
// ... on every layer up to here, and above it only where its plan takes 256-token tiles
// (its 128-token tiles lose to dequantize + cuBLAS there).
inline int wgmma_short_max_m(const Heuristics& h, int bits) { return h.wgmma_short_max_m[bits - 2]; }

// The path for M rows at `bits` on a GPU of table `h`: `wgmma` says whether the wgmma kernel can run (build and
// device), `mma` whether the build has the mma.sync kernel, and `wgmma_takes_tall()` (asked only
// between wgmma_short_max_m and wgmma_max_m) whether the wgmma plan takes 256-token tiles.
template <typename TallFn>
inline Path choose_path(const Heuristics& h, long long m, int bits, bool wgmma, bool mma, TallFn&& wgmma_takes_tall) {
  if (m <= gemv_max_m(bits)) return kGemvPath;
  if (m <= wgmma_max_m(h, bits) && wgmma) {
    if (m <= wgmma_short_max_m(h, bits)) return kWgmmaPath;
    return wgmma_takes_tall() ? kWgmmaPath : kDequantPath;
  }
  return mma && m < dequant_min_m(h, bits) ? kMmaPath : kDequantPath;
}

}  // namespace kbit
