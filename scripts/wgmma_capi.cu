// C entry point (ctypes) over the torch-free wgmma launcher, for scripts/wgmma_dev.py: builds
// probe variants of the kernel with nvcc alone. Not part of the extension build.
#include <cuda_runtime.h>

#include "kbit_ops.h"

extern "C" int kbit_wgmma_c(int dtype, const void* x, const void* packed, const void* absmax, const float* codebook,
                            void* y, int m, int n, int k, int bits, int num_sms, void* stream, int splits) {
  return (int)kbit::launch_wgmma(dtype == 0 ? kbit::DType::kHalf : kbit::DType::kBFloat16, x,
                                 static_cast<const uint32_t*>(packed), static_cast<const uint8_t*>(absmax), codebook,
                                 nullptr, y, m, n, k, bits, num_sms, static_cast<cudaStream_t>(stream), splits);
}
