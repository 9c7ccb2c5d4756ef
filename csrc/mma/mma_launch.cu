// Host entry points of the mma.sync kbit GEMM (declared in dispatch/launchers.h): argument
// checks, the plan (dispatch/mma_plan.h), and the dispatch on bits to the per-bit-width
// instantiations (mma/instantiations/mma_k<BITS>.cu).
#include <cstdint>

#include "dispatch/launchers.h"
#include "mma/mma_kernel.cuh"

namespace kbit {
namespace mma {
extern template cudaError_t launch_bits<2>(const Plan&, const GemmOperands&, void*, cudaStream_t);
extern template cudaError_t launch_bits<3>(const Plan&, const GemmOperands&, void*, cudaStream_t);
extern template cudaError_t launch_bits<4>(const Plan&, const GemmOperands&, void*, cudaStream_t);
extern template cudaError_t launch_bits<5>(const Plan&, const GemmOperands&, void*, cudaStream_t);
}  // namespace mma

bool has_mma() { return true; }

MmaPlan plan_mma(int m, int n, int k, int bits, int num_sms, const MmaOverrides& o) {
  return mma::plan_for_overrides(m, n, k, bits, num_sms, o);
}

cudaError_t launch_mma(const MmaPlan& plan, const GemmOperands& a, void* workspace, cudaStream_t stream) {
  if (a.bits < 2 || a.bits > 5 || a.n <= 0 || a.k <= 0 || a.k % kBlock != 0 || a.m < 0) return cudaErrorInvalidValue;
  if (a.dtype != DType::kHalf && a.dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  if (a.m == 0) return cudaSuccess;
  // cp.async moves 16 B: x rows (K % 32 == 0) and the layout units are 16 B multiples, so
  // only the base pointers need checking; y takes 4 B pair stores.
  const auto misaligned = [](const void* p, uintptr_t align) {
    return (reinterpret_cast<uintptr_t>(p) & (align - 1)) != 0;
  };
  if (misaligned(a.x, 16) || misaligned(a.packed, 16) || misaligned(a.absmax, 16) || misaligned(a.y, 4) ||
      misaligned(workspace, 16))
    return cudaErrorInvalidValue;
  switch (a.bits) {
    case 2: return mma::launch_bits<2>(plan, a, workspace, stream);
    case 3: return mma::launch_bits<3>(plan, a, workspace, stream);
    case 4: return mma::launch_bits<4>(plan, a, workspace, stream);
    default: return mma::launch_bits<5>(plan, a, workspace, stream);
  }
}

}  // namespace kbit
