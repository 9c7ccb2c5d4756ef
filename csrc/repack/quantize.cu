// Launch of the quantize kernel (repack/quant_kernel.cuh): W[N, K] -> checkpoint layout. Checks
// the shape, names the kernel by its key and launches the entry the generated selector
// (quant_kernels.h) returns.
#include <cuda_runtime.h>

#include "core/kernel_keys.h"
#include "core/layout.cuh"
#include "dispatch/launchers.h"
#include "repack/quant_kernels.h"

namespace kbit {

cudaError_t launch_quantize(DType dtype, const void* w, const float* codebook, uint32_t* qweight, uint8_t* absmax,
                            int n, int k, int bits, cudaStream_t stream) {
  if (n <= 0 || k <= 0 || k % kBlock != 0) return cudaErrorInvalidValue;
  QuantKey key;
  key.bits = bits;
  key.dtype = dtype;
  const repack::QuantKernel* kernel = repack::select_kernel(key);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const repack::QuantParams p = {w, codebook, qweight, absmax, n, k};
  return kernel->launch(p, stream);
}

}  // namespace kbit
