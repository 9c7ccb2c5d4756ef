// Host entry points of the mma.sync kbit GEMM (declared in dispatch/launchers.h): argument
// checks, the plan (dispatch/mma_plan.h), and the launch of the kernel the plan's key names
// (mma_kernels.h, generated: the instantiations are mma/instantiations/mma_k<BITS>.cu).
#include <cstdint>

#include "dispatch/launchers.h"
#include "mma/mma_kernels.h"

namespace kbit {

bool has_mma() { return true; }

MmaPlan plan_mma(DType dtype, int m, int n, int k, int bits, int num_sms, const MmaOverrides& o) {
  return mma::plan_for_overrides(device_heuristics(), m, n, k, bits, dtype, num_sms, o);
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
  if (plan.key.bits != a.bits || plan.key.dtype != a.dtype) return cudaErrorInvalidValue;
  const mma::MmaKernel* kernel = mma::select_kernel(plan.key);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  mma::Params prm{};
  prm.x = a.x;
  prm.packed = reinterpret_cast<const uint4*>(a.packed);
  prm.absmax = reinterpret_cast<const uint4*>(a.absmax);
  prm.codebook = a.codebook;
  prm.bias = a.bias;
  prm.y = a.y;
  prm.m = a.m;
  prm.n = a.n;
  prm.k = a.k;
  prm.n_units = plan.n_units;
  prm.k_tiles = plan.k_tiles;
  prm.m_tiles = plan.m_tiles;
  prm.n_tiles = plan.n_tiles;
  prm.splits = plan.splits;
  prm.kt_per_split = plan.kt_per_split;
  prm.items = plan.items;
  if (plan.splits > 1) {  // `workspace`: workspace_bytes(plan) bytes, 16 B aligned
    if (workspace == nullptr) return cudaErrorInvalidValue;
    prm.counters = static_cast<int*>(workspace);
    prm.partial = reinterpret_cast<float4*>(static_cast<char*>(workspace) + plan.counter_bytes);
    // On-stream zeroing of the tiny counter array: graph-capturable, no host sync.
    const cudaError_t e = cudaMemsetAsync(workspace, 0, plan.counter_bytes, stream);
    if (e != cudaSuccess) return e;
  }
  return kernel->launch(prm, plan.grid, stream);
}

}  // namespace kbit
