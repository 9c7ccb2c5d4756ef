// Host entry points of the tensor-core kbit GEMM (declared in kbit_ops.h): argument checks,
// the shape-only launch plan, and the dispatch on bits to csrc/generated/mma_k*.cu.
#include <cstdint>
#include <cstdlib>

#include "mma/mma_kernel.cuh"
#include "dispatch/launchers.h"

namespace kbit {
namespace mma {
// Instantiated in csrc/generated/mma_k{2,3,4,5}.cu, not here (keeps this file light).
extern template cudaError_t launch_mma_bits<2>(DType, const Plan&, const void*, const uint32_t*,
                                               const uint8_t*, const float*, const void*, void*,
                                               void*, int, int, int, cudaStream_t);
extern template cudaError_t launch_mma_bits<3>(DType, const Plan&, const void*, const uint32_t*,
                                               const uint8_t*, const float*, const void*, void*,
                                               void*, int, int, int, cudaStream_t);
extern template cudaError_t launch_mma_bits<4>(DType, const Plan&, const void*, const uint32_t*,
                                               const uint8_t*, const float*, const void*, void*,
                                               void*, int, int, int, cudaStream_t);
extern template cudaError_t launch_mma_bits<5>(DType, const Plan&, const void*, const uint32_t*,
                                               const uint8_t*, const float*, const void*, void*,
                                               void*, int, int, int, cudaStream_t);
}  // namespace mma

namespace {
// The plan for a shape. Debug override for tests and tuning: KBIT_MMA_FORCE="cfg" or
// "cfg,splits" (cfg 0..2, splits >= 1) replaces the heuristic's choice; read on every call
// (launch and workspace size agree), unset in production, where the plan is shapes-only.
mma::Plan choose_plan(int m, int n, int k, int bits, int num_sms) {
  if (const char* f = std::getenv("KBIT_MMA_FORCE")) {
    char* end = nullptr;
    const long cfg = std::strtol(f, &end, 10);
    long splits = 1;
    if (end != f && *end == ',') splits = std::strtol(end + 1, nullptr, 10);
    if (end != f && cfg >= 0 && cfg < mma::kNumCfgs && splits >= 1 && splits <= 64)
      return mma::plan_for(int(cfg), int(splits), m, n, k, num_sms);
  }
  return mma::make_plan(m, n, k, bits, num_sms);
}
}  // namespace

size_t mma_workspace_bytes(int m, int n, int k, int bits, int num_sms) {
  if (m <= 0 || n <= 0 || k <= 0) return 0;
  return mma::workspace_bytes(choose_plan(m, n, k, bits, num_sms));
}

cudaError_t launch_mma(DType dtype, const void* x, const uint32_t* packed, const uint8_t* absmax,
                       const float* codebook, const void* bias, void* y, void* workspace, int m,
                       int n, int k, int bits, int num_sms, cudaStream_t stream) {
  if (bits < 2 || bits > 5 || n <= 0 || k <= 0 || k % kBlock != 0 || m < 0) return cudaErrorInvalidValue;
  if (dtype != DType::kHalf && dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  if (m == 0) return cudaSuccess;
  // cp.async moves 16 B: x rows (K % 32 == 0) and the layout units are 16 B multiples, so
  // only the base pointers need checking; y takes 4 B pair stores.
  const auto misaligned = [](const void* p, uintptr_t a) {
    return (reinterpret_cast<uintptr_t>(p) & (a - 1)) != 0;
  };
  if (misaligned(x, 16) || misaligned(packed, 16) || misaligned(absmax, 16) || misaligned(y, 4) ||
      misaligned(workspace, 16))
    return cudaErrorInvalidValue;
  const mma::Plan pl = choose_plan(m, n, k, bits, num_sms);
  switch (bits) {
    case 2: return mma::launch_mma_bits<2>(dtype, pl, x, packed, absmax, codebook, bias, y, workspace, m, n, k, stream);
    case 3: return mma::launch_mma_bits<3>(dtype, pl, x, packed, absmax, codebook, bias, y, workspace, m, n, k, stream);
    case 4: return mma::launch_mma_bits<4>(dtype, pl, x, packed, absmax, codebook, bias, y, workspace, m, n, k, stream);
    default: return mma::launch_mma_bits<5>(dtype, pl, x, packed, absmax, codebook, bias, y, workspace, m, n, k, stream);
  }
}

}  // namespace kbit

namespace kbit {
// For the kbit::mma_plan test hook in binding.cpp (declared there):
// [cfg, tile_m, tile_n, splits, k_tiles_per_split, items, grid, workspace_bytes].
void mma_plan_info(int m, int n, int k, int bits, int num_sms, int64_t* out) {
  const mma::Plan p = choose_plan(m, n, k, bits, num_sms);
  const mma::CfgDesc d = mma::cfg_desc(p.cfg);
  out[0] = p.cfg; out[1] = d.tile_m; out[2] = d.tile_n; out[3] = p.splits; out[4] = p.kt_per_split;
  out[5] = p.items; out[6] = p.grid; out[7] = (int64_t)mma::workspace_bytes(p);
}
}  // namespace kbit
