// Launch of the grouped wgmma MoE GEMM (moe/grouped_kernel.cuh) for bits 2..5 x fp16 / bf16 x
// block_m 64 / 128 / 256: argument checks, the choice of the 64-token build (moe_grouped_key), then the
// kernel its key names (moe_grouped_kernels.h, generated).
#include <cuda_runtime.h>

#include <cstdint>

#include "core/kernel_keys.h"
#include "core/layout.cuh"
#include "dispatch/launchers.h"  // wgmma_supported
#include "moe/grouped_config.h"
#include "moe/moe_grouped_kernels.h"
#include "moe/moe_launchers.h"

namespace kbit {

bool moe_grouped_supported() { return wgmma_supported(); }

namespace {
MoeGroupedKey key_of(int bits, DType dtype, int block_m, int built_per_sm) {
  MoeGroupedKey key;
  key.bits = bits;
  key.dtype = dtype;
  key.tile_m = block_m;
  key.built_per_sm = built_per_sm;
  return key;
}

// CTAs along the columns: S slabs of W each (moe::grouped_columns); gated, the gate and up
// units of S / 2 slabs' columns
int column_groups(int n, int activation, int block_m) {
  const int slabs = moe::grouped_columns(block_m) / kUnitN;
  return moe::is_gated(activation) ? div_up(n_units(n) / 2, slabs / 2) : div_up(n_units(n), slabs);
}
}  // namespace

bool moe_grouped_block_m_ok(int block_m) { return moe::select_kernel(key_of(4, DType::kHalf, block_m, 1)) != nullptr; }

MoeGroupedKey moe_grouped_key(int bits, DType dtype, int block_m, int num_sorted, int n, int activation,
                              int one_per_sm) {
  if (block_m != 64) return key_of(bits, dtype, block_m, 1);
  if (one_per_sm >= 0) return key_of(bits, dtype, block_m, one_per_sm ? 1 : 2);
  const long long ctas = (long long)div_up(num_sorted, block_m) * column_groups(n, activation, block_m);
  const bool two = ctas > device_attribute<cudaDevAttrMultiProcessorCount>() &&
                   moe::select_kernel(key_of(bits, dtype, block_m, 2)) != nullptr;
  return key_of(bits, dtype, block_m, two ? 2 : 1);
}

cudaError_t launch_moe_grouped(DType dtype, const void* x, const uint32_t* packed, const uint8_t* absmax,
                               const float* codebook, int codebook_stride, const int32_t* sorted_ids,
                               const int32_t* expert_ids, const int32_t* num_tokens_post_padded,
                               const float* topk_weights, void* y, int num_experts, int num_pairs, int num_sorted,
                               int block_m, int top_k, int n, int k, int bits, int activation, bool zero_uncovered,
                               int one_per_sm, cudaStream_t stream) {
  if (dtype != DType::kHalf && dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  if (bits < 2 || bits > 5 || n < 1 || k < kBlock || k % kBlock != 0) return cudaErrorInvalidValue;
  if (top_k < 1 || num_pairs < 0 || num_sorted < 0 || num_experts < 1) return cudaErrorInvalidValue;
  if (codebook_stride != 0 && codebook_stride != (1 << bits)) return cudaErrorInvalidValue;
  if (activation < 0 || activation >= moe::kActivations) return cudaErrorInvalidValue;
  const bool gated = moe::is_gated(activation);
  if (gated && n % (2 * kUnitN) != 0) return cudaErrorInvalidValue;  // gate and up units pair up
  const auto misaligned = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) != 0; };
  if (misaligned(x) || misaligned(packed) || misaligned(absmax) || misaligned(y)) return cudaErrorInvalidValue;
  if (!moe_grouped_supported()) return cudaErrorNotSupported;
  const moe::MoeGroupedKernel* kernel =
      moe::select_kernel(moe_grouped_key(bits, dtype, block_m, num_sorted, n, activation, one_per_sm));
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const int n_out = gated ? n / 2 : n;
  const int blocks = div_up(num_sorted, block_m), groups = column_groups(n, activation, block_m);
  if (blocks > 65535 || groups > 65535) return cudaErrorInvalidValue;
  if (num_pairs == 0) return cudaSuccess;
  if (zero_uncovered) {
    const cudaError_t err = cudaMemsetAsync(y, 0, size_t(num_pairs) * size_t(n_out) * 2, stream);
    if (err != cudaSuccess) return err;
  }
  if (num_sorted == 0) return cudaSuccess;
  moe::GroupedParams p;
  p.x = x; p.packed = packed; p.absmax = absmax; p.codebook = codebook; p.codebook_stride = codebook_stride;
  p.sorted_ids = sorted_ids; p.expert_ids = expert_ids; p.num_tokens_post_padded = num_tokens_post_padded;
  p.topk_weights = topk_weights; p.y = y;
  const long long units = (long long)n_units(n) * k_units(k);
  p.expert_words = units * unit_words(bits);
  p.expert_bytes = units * kUnitAbsmaxBytes;
  p.n = n; p.k = k; p.ku_count = k_units(k); p.n_out = n_out;
  p.num_experts = num_experts; p.num_pairs = num_pairs; p.num_sorted = num_sorted; p.top_k = top_k;
  p.activation = activation;
  return kernel->launch(p, blocks, groups, stream);
}

}  // namespace kbit
