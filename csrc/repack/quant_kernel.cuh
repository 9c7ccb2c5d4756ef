// The quantize kernel: W[N, K] to the checkpoint layout, bit-exact with
// vllm_kbit/format.py:quantize; the launch is repack/quantize.cu's.
// One warp per 32-weight block (lane i = element i): warp absmax, E4M4 encode (nearest code,
// ties to the larger code), IEEE division by the decoded scale, nearest codebook entry (first
// index on ties, as torch.argmin), and __ballot_sync to build the bit-planes.
// The build uses --use_fast_math, so the arithmetic that must match the reference bit for bit
// goes through the explicit round-to-nearest intrinsics (__fdiv_rn, __fsub_rn).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/layout.cuh"
#include "core/common.cuh"
#include "repack/repack_config.h"

namespace kbit {
namespace repack {

constexpr float kE4M4Max = 31.0f;

// format.encode_e4m4 for one value, computed by the whole warp (every lane gets the code):
// hi = searchsorted(table, v) = number of codes whose value is < v (table strictly
// increasing), counted 8 codes per lane; then the nearest of hi-1 / hi, ties to hi.
__device__ __forceinline__ int encode_e4m4_warp(float amax, int lane) {
  const float v = fminf(fmaxf(amax, 0.0f), kE4M4Max);
  int below = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) below += decode_e4m4_exact(lane * 8 + i) < v ? 1 : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) below += __shfl_xor_sync(0xffffffffu, below, o);
  const int hi = below > 255 ? 255 : below;
  const int lo = hi > 0 ? hi - 1 : 0;
  const bool take_lo = __fsub_rn(v, decode_e4m4_exact(lo)) < __fsub_rn(decode_e4m4_exact(hi), v);
  return take_lo ? lo : hi;
}

template <typename T, int BITS>
__global__ void __launch_bounds__(256) quantize_kernel(const T* __restrict__ w, const float* __restrict__ codebook,
                                                       uint32_t* __restrict__ qweight, uint8_t* __restrict__ absmax,
                                                       long long total_blocks, int blocks_per_row) {
  const int lane = threadIdx.x & 31;
  // lane i < 2^BITS keeps codebook entry i; entries are broadcast with shuffles below
  const float cb_lane = lane < (1 << BITS) ? codebook[lane] : 0.0f;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  for (long long blk = blockIdx.x * (long long)(blockDim.x / 32) + threadIdx.x / 32; blk < total_blocks;
       blk += warps) {
    const float v = to_float(w[blk * kBlock + lane]);
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const int code = encode_e4m4_warp(amax, lane);
    const float scale = decode_e4m4_exact(code);
    const float q = scale > 0.0f ? __fdiv_rn(v, scale) : 0.0f;
    int best = 0;
    float best_d = fabsf(__fsub_rn(q, __shfl_sync(0xffffffffu, cb_lane, 0)));
#pragma unroll
    for (int i = 1; i < (1 << BITS); ++i) {
      const float d = fabsf(__fsub_rn(q, __shfl_sync(0xffffffffu, cb_lane, i)));
      if (d < best_d) { best_d = d; best = i; }  // strict: the first index wins ties
    }
    uint32_t plane_word = 0;
#pragma unroll
    for (int b = 0; b < BITS; ++b) {
      const uint32_t word = __ballot_sync(0xffffffffu, (best >> b) & 1);
      if (lane == b) plane_word = word;
    }
    const long long row = blk / blocks_per_row, jb = blk % blocks_per_row;
    if (lane < BITS) qweight[(row * blocks_per_row + jb) * BITS + lane] = plane_word;
    if (lane == 0) absmax[blk] = uint8_t(code);
  }
}

// Launch of one instantiation: one warp a block, grid-stride beyond 2^20 CTAs.
template <typename T, int BITS>
cudaError_t launch_quantize_kernel(const QuantParams& p, cudaStream_t stream) {
  const long long total = (long long)p.n * (p.k / kBlock);
  constexpr int kThreads = 256, kWarps = kThreads / 32;
  long long grid = (total + kWarps - 1) / kWarps;
  if (grid > (1 << 20)) grid = 1 << 20;
  if (grid < 1) grid = 1;
  quantize_kernel<T, BITS><<<int(grid), kThreads, 0, stream>>>(static_cast<const T*>(p.w), p.codebook, p.qweight,
                                                                p.absmax, total, p.k / kBlock);
  return cudaGetLastError();
}

// The selector's entry of one instantiation (quant_kernels.h, generated).
template <int BITS, typename T>
constexpr QuantKernel kernel_entry() {
  constexpr cudaError_t (*launch)(const QuantParams&, cudaStream_t) = &launch_quantize_kernel<T, BITS>;
  return {launch};
}

}  // namespace repack
}  // namespace kbit
