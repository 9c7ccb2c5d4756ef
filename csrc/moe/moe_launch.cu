// Launch of the grouped MoE GEMV (moe_gemv_kernel.cuh) for bits 2..5 x fp16 / bf16: the kernel
// its key names (moe_kernels.h, generated). The stacked
// dequantize (launch_dequantize_experts) lives beside the dense one in repack/dequantize.cu.
#include <cuda_runtime.h>

#include "core/kernel_keys.h"
#include "core/layout.cuh"
#include "moe/moe_gemv_kernel.cuh"  // MoeParams
#include "moe/moe_kernels.h"
#include "moe/moe_launchers.h"

namespace kbit {
MoeKey moe_key(int bits, DType dtype) {
  MoeKey key;
  key.bits = bits;
  key.dtype = dtype;
  return key;
}

cudaError_t launch_moe_gemm(DType dtype, const void* x, const uint32_t* packed, const uint8_t* absmax,
                            const float* codebook, int codebook_stride, const int32_t* sorted_ids,
                            const int32_t* expert_ids, const int32_t* num_tokens_post_padded,
                            const float* topk_weights, void* y, int num_experts, int num_pairs, int num_sorted,
                            int block_m, int top_k, int n, int k, int bits, cudaStream_t stream) {
  if (dtype != DType::kHalf && dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  if (n < 1 || k < kBlock || k % kBlock != 0 || n_units(n) > 65535) return cudaErrorInvalidValue;
  if (block_m < 1 || block_m > kMoeMaxBlockM || top_k < 1 || num_pairs < 0 || num_sorted < 0 || num_experts < 1)
    return cudaErrorInvalidValue;
  if (codebook_stride != 0 && codebook_stride != (1 << bits)) return cudaErrorInvalidValue;
  if (num_pairs == 0) return cudaSuccess;
  // rows that no block covers (pairs of experts not on this rank, or not in sorted_ids) are 0
  const cudaError_t err = cudaMemsetAsync(y, 0, size_t(num_pairs) * size_t(n) * 2, stream);
  if (err != cudaSuccess || num_sorted == 0) return err;
  moe::MoeParams p;
  p.x = x; p.packed = packed; p.absmax = absmax; p.codebook = codebook; p.codebook_stride = codebook_stride;
  p.sorted_ids = sorted_ids; p.expert_ids = expert_ids; p.num_tokens_post_padded = num_tokens_post_padded;
  p.topk_weights = topk_weights; p.y = y;
  const long long units = (long long)n_units(n) * k_units(k);
  p.expert_words = units * unit_words(bits);
  p.expert_bytes = units * kUnitAbsmaxBytes;
  p.n = n; p.k = k; p.ku_count = k_units(k);
  p.num_experts = num_experts; p.num_pairs = num_pairs; p.num_sorted = num_sorted;
  p.block_m = block_m; p.top_k = top_k;
  const moe::MoeKernel* kernel = moe::select_kernel(moe_key(bits, dtype));
  if (kernel == nullptr) return cudaErrorInvalidValue;
  return kernel->launch(p, div_up(num_sorted, block_m), stream);
}

}  // namespace kbit
