// Launches of the dequantize kernel (repack/dequant_kernel.cuh): the large-M path (dequantize
// + cuBLAS, in N-chunks so the scratch stays bounded), a test hook, and stacked MoE experts
// whole (launch_dequantize_experts: one launch). Each checks its arguments, names the kernel by
// its key and launches the entry the generated selector (dequant_kernels.h) returns.
#include <cuda_runtime.h>

#include <cmath>

#include "core/kernel_keys.h"
#include "core/layout.cuh"
#include "dispatch/launchers.h"
#include "moe/moe_launchers.h"
#include "repack/dequant_kernels.h"

namespace kbit {
namespace {

DequantKey dequant_key(int bits, DType dtype, bool stacked) {
  DequantKey key;
  key.bits = bits;
  key.dtype = dtype;
  key.stacked = stacked;
  return key;
}

cudaError_t launch(const DequantKey& key, const repack::DequantParams& p, cudaStream_t stream) {
  const repack::DequantKernel* kernel = repack::select_kernel(key);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  return kernel->launch(p, stream);
}

}  // namespace

cudaError_t launch_dequantize(DType dtype, const uint32_t* packed, const uint8_t* absmax, const float* codebook,
                              void* w, int n_begin, int n_end, int k, int bits, cudaStream_t stream) {
  if (n_begin < 0 || n_end <= n_begin || k <= 0 || k % kBlock != 0) return cudaErrorInvalidValue;
  if (dtype == DType::kE4m3) return cudaErrorInvalidValue;  // launch_decode_fp8's
  const repack::DequantParams p = {packed, absmax, codebook, 0, w, n_begin, n_end, k, 1, 1.f};
  return launch(dequant_key(bits, dtype, false), p, stream);
}

cudaError_t launch_decode_fp8(const uint32_t* packed, const uint8_t* absmax, const float* codebook, int w_exp,
                              uint8_t* w, int n, int k, int bits, cudaStream_t stream) {
  if (n < 1 || k <= 0 || k % kBlock != 0) return cudaErrorInvalidValue;  // w_exp: the binding's check_weight
  const float scale = ldexpf(1.f, w_exp + 4);
  const repack::DequantParams p = {packed, absmax, codebook, 0, w, 0, n, k, 1, scale};
  return launch(dequant_key(bits, DType::kE4m3, false), p, stream);
}

cudaError_t launch_dequantize_experts(DType dtype, const uint32_t* packed, const uint8_t* absmax,
                                      const float* codebook, int codebook_stride, void* w, int num_experts, int n,
                                      int k, int bits, cudaStream_t stream) {
  if (num_experts < 1 || num_experts > 65535 || n < 1 || k <= 0 || k % kBlock != 0) return cudaErrorInvalidValue;
  if (codebook_stride != 0 && codebook_stride != (1 << bits)) return cudaErrorInvalidValue;
  if (dtype == DType::kE4m3) return cudaErrorInvalidValue;
  const repack::DequantParams p = {packed, absmax, codebook, codebook_stride, w, 0, n, k, num_experts, 1.f};
  return launch(dequant_key(bits, dtype, true), p, stream);
}

}  // namespace kbit
