// C entry points (ctypes) over the torch-free MMA and repack launchers, for
// scripts/mma_dev.py: lets the tensor-core kernel be built and checked in ~20 s with nvcc
// alone, without the torch extension. Not part of the extension build (not under csrc/).
#include <cuda_runtime.h>

#include "kbit_mma.cuh"
#include "kbit_ops.h"

extern "C" {
int kbit_mma_c(int dtype, const void* x, const void* packed, const void* absmax, const float* codebook,
               const void* bias, void* y, void* ws, int m, int n, int k, int bits, int num_sms,
               void* stream) {
  return (int)kbit::launch_mma(dtype == 0 ? kbit::DType::kHalf : kbit::DType::kBFloat16, x,
                               static_cast<const uint32_t*>(packed), static_cast<const uint8_t*>(absmax),
                               codebook, bias, y, ws, m, n, k, bits, num_sms,
                               static_cast<cudaStream_t>(stream));
}
size_t kbit_mma_ws_c(int m, int n, int k, int bits, int num_sms) {
  return kbit::mma_workspace_bytes(m, n, k, bits, num_sms);
}
namespace kbit { namespace mma {
extern template cudaError_t launch_mma_bits<2>(DType, const Plan&, const void*, const uint32_t*, const uint8_t*,
                                               const float*, const void*, void*, void*, int, int, int, cudaStream_t);
extern template cudaError_t launch_mma_bits<3>(DType, const Plan&, const void*, const uint32_t*, const uint8_t*,
                                               const float*, const void*, void*, void*, int, int, int, cudaStream_t);
extern template cudaError_t launch_mma_bits<4>(DType, const Plan&, const void*, const uint32_t*, const uint8_t*,
                                               const float*, const void*, void*, void*, int, int, int, cudaStream_t);
extern template cudaError_t launch_mma_bits<5>(DType, const Plan&, const void*, const uint32_t*, const uint8_t*,
                                               const float*, const void*, void*, void*, int, int, int, cudaStream_t);
}}
// Forced tile config / split (dev sweeps); workspace: kbit_mma_forced_ws_c bytes.
size_t kbit_mma_forced_ws_c(int m, int n, int k, int num_sms, int cfg, int splits) {
  return kbit::mma::workspace_bytes(kbit::mma::plan_for(cfg, splits, m, n, k, num_sms));
}
int kbit_mma_forced_c(int dtype, const void* x, const void* packed, const void* absmax, const float* codebook,
                      const void* bias, void* y, void* ws, int m, int n, int k, int bits, int num_sms, int cfg,
                      int splits, void* stream) {
  const kbit::mma::Plan pl = kbit::mma::plan_for(cfg, splits, m, n, k, num_sms);
  const kbit::DType dt = dtype == 0 ? kbit::DType::kHalf : kbit::DType::kBFloat16;
  const auto* pk = static_cast<const uint32_t*>(packed);
  const auto* am = static_cast<const uint8_t*>(absmax);
  const auto st = static_cast<cudaStream_t>(stream);
  switch (bits) {
    case 2: return (int)kbit::mma::launch_mma_bits<2>(dt, pl, x, pk, am, codebook, bias, y, ws, m, n, k, st);
    case 3: return (int)kbit::mma::launch_mma_bits<3>(dt, pl, x, pk, am, codebook, bias, y, ws, m, n, k, st);
    case 4: return (int)kbit::mma::launch_mma_bits<4>(dt, pl, x, pk, am, codebook, bias, y, ws, m, n, k, st);
    default: return (int)kbit::mma::launch_mma_bits<5>(dt, pl, x, pk, am, codebook, bias, y, ws, m, n, k, st);
  }
}
// The launch plan for a shape: cfg, splits, K-tiles per split, work items, grid.
void kbit_mma_plan_c(int m, int n, int k, int bits, int num_sms, int* out) {
  const kbit::mma::Plan p = kbit::mma::make_plan(m, n, k, bits, num_sms);
  out[0] = p.cfg; out[1] = p.splits; out[2] = p.kt_per_split; out[3] = p.items; out[4] = p.grid;
}
int kbit_repack_c(const void* qweight, const void* absmax, void* packed, void* absmax_packed, int n, int k,
                  int bits, void* stream) {
  return (int)kbit::launch_repack(static_cast<const uint32_t*>(qweight), static_cast<const uint8_t*>(absmax),
                                  static_cast<uint32_t*>(packed), static_cast<uint8_t*>(absmax_packed), n, k,
                                  bits, static_cast<cudaStream_t>(stream));
}
}
