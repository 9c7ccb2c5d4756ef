// C entry point (ctypes) over the torch-free wgmma launcher, for scripts/wgmma_dev.py: builds
// probe variants of the kernel with nvcc alone. Not part of the extension build.
#include <cuda_runtime.h>

#include "kbit_ops.h"

// The workspace of plans that split K over cluster groups: grown (synchronously) when a call needs
// more, so the first call of a shape should be a warm-up; counters zeroed on-stream every call.
extern "C" int kbit_wgmma_c(int dtype, const void* x, const void* packed, const void* absmax, const float* codebook,
                            void* y, int m, int n, int k, int bits, int num_sms, void* stream, int splits) {
  static void* ws = nullptr;
  static size_t ws_cap = 0;
  const kbit::DType dt = dtype == 0 ? kbit::DType::kHalf : kbit::DType::kBFloat16;
  const size_t bytes = kbit::wgmma_workspace_bytes(dt, m, n, k, bits, num_sms, splits);
  if (bytes > ws_cap) {
    if (ws != nullptr) cudaFree(ws);
    if (cudaMalloc(&ws, bytes) != cudaSuccess) return (int)cudaErrorMemoryAllocation;
    ws_cap = bytes;
  }
  return (int)kbit::launch_wgmma(dt, x, static_cast<const uint32_t*>(packed), static_cast<const uint8_t*>(absmax),
                                 codebook, nullptr, y, m, n, k, bits, num_sms, static_cast<cudaStream_t>(stream), splits,
                                 bytes ? ws : nullptr);
}
