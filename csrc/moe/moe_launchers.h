// Torch-free host launchers of the kbit MoE expert kernels (the binding, csrc/binding.cpp, is the
// only caller). The op contract (shapes, padding ids, expert -1, num_tokens_post_padded) is the
// one of vLLM's fused_moe with moe_align_block_size; vllm_kbit/ops.py holds the schemas and the
// PyTorch reference. Conventions as dispatch/launchers.h: a launcher returns the first CUDA error it saw,
// cudaErrorInvalidValue for arguments it does not support, never throws, and is CUDA-graph safe.
//
// Stacked expert weights: expert e's tiled layout (kbit::repack of its checkpoint tensors) is
// row e of packed [E, expert_words] / absmax [E, expert_bytes], expert_words =
// units * bits * 128, expert_bytes = units * 128, units = n_units(n) * k_units(k).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "core/device.h"
#include "core/kernel_keys.h"
#include "moe/moe_config.h"  // kMoeMaxBlockM

namespace kbit {


// The MoE GEMV kernel launch_moe_gemm runs for a bit width and dtype (moe_kernels.h).
MoeKey moe_key(int bits, DType dtype);

// y[num_pairs, n] (zeroed on the stream first, so rows no block covers are 0) with row p =
// x[p / top_k] @ W_e^T (times topk_weights[p] where given) for every pair p of a block of
// sorted_ids whose expert e = expert_ids[block] is >= 0 and whose start is below
// *num_tokens_post_padded; ids >= num_pairs are padding. x [num_pairs / top_k, k] and y in
// `dtype` (fp16 / bf16); topk_weights float32 [num_pairs] or nullptr. The grid is sized from
// num_sorted (shapes only); nothing is read on the host.
//
// Codebooks: expert e decodes with codebook[e * codebook_stride .. + 2^bits): codebook_stride =
// 2^bits for one codebook per expert ([E, 2^bits], convert --fit-codebook), 0 for one shared by
// all ([2^bits]). (The same holds for launch_dequantize_experts.)
cudaError_t launch_moe_gemm(DType dtype, const void* x, const uint32_t* packed, const uint8_t* absmax,
                            const float* codebook, int codebook_stride, const int32_t* sorted_ids,
                            const int32_t* expert_ids, const int32_t* num_tokens_post_padded,
                            const float* topk_weights, void* y, int num_experts, int num_pairs, int num_sorted,
                            int block_m, int top_k, int n, int k, int bits, cudaStream_t stream);

// Whether this build and device run the grouped wgmma MoE GEMM (sm_90a code on a compute
// capability 9.0 device, as the dense wgmma kernel).
bool moe_grouped_supported();

// Whether a grouped kernel serves this block_m (64, 128 or 256: the kernels' CTA tokens).
bool moe_grouped_block_m_ok(int block_m);

// The grouped MoE kernel launch_moe_grouped runs (describe() names it): the one of block_m's
// tokens per CTA, at 64 built for two CTAs per SM where its grid (blocks of num_sorted ids x
// column groups) exceeds one CTA per SM and that build exists, as the dense wgmma plan picks
// its 64-token tile; `one_per_sm` (the moe.one_per_sm override): 1 / 0 force one / two, -1 the
// rule. A key no kernel matches where the forced build does not exist.
MoeGroupedKey moe_grouped_key(int bits, DType dtype, int block_m, int num_sorted, int n, int activation,
                              int one_per_sm);

// The grouped tensor-core form of launch_moe_gemm (moe/grouped_kernel.cuh), for blocks of
// block_m = 64, 128 or 256 sorted ids: y[num_pairs, n_out] with row p = act(x[p / top_k] @ W_e^T)
// (times topk_weights[p] where given) for every pair p of a block as launch_moe_gemm reads
// them. `activation`: moe::Activation (0: none, n_out = n; the gated ones, 1..3, need n % 128
// == 0 and give n_out = n / 2). Rows no block covers are zeroed on the stream first where
// `zero_uncovered`, else left as they were (a caller that reads only covered rows, as the down
// projection reads the gate/up output, skips the memset). x, packed, absmax and y 16 B aligned.
// `one_per_sm`: moe_grouped_key's.
// cudaErrorNotSupported where moe_grouped_supported() is false.
cudaError_t launch_moe_grouped(DType dtype, const void* x, const uint32_t* packed, const uint8_t* absmax,
                               const float* codebook, int codebook_stride, const int32_t* sorted_ids,
                               const int32_t* expert_ids, const int32_t* num_tokens_post_padded,
                               const float* topk_weights, void* y, int num_experts, int num_pairs, int num_sorted,
                               int block_m, int top_k, int n, int k, int bits, int activation, bool zero_uncovered,
                               int one_per_sm, cudaStream_t stream);

// Stacked tiled experts [E, expert_words] / [E, expert_bytes] -> w [E, n, k] (fp16 / bf16 / fp32),
// each expert bit-exact with launch_dequantize (format.dequantize); one launch, experts on the
// grid's y dimension (repack/dequantize.cu).
cudaError_t launch_dequantize_experts(DType dtype, const uint32_t* packed, const uint8_t* absmax,
                                      const float* codebook, int codebook_stride, void* w, int num_experts, int n,
                                      int k, int bits, cudaStream_t stream);

}  // namespace kbit
