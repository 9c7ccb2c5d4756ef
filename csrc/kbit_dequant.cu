// Dequantize the tiled layout to row-major W rows [n_begin, n_end): the large-M fallback
// (dequant + cuBLAS, in N-chunks so the scratch stays bounded) and a test hook.
// One thread per (column, 32-block); consecutive threads take consecutive blocks of one
// column, so each warp writes 32 x 64 contiguous bytes (fp16). Values are
// float(codebook[idx]) * decode(absmax) rounded once: bit-exact with format.dequantize.
#include <cstdint>

#include "kbit_common.cuh"
#include "kbit_layout.cuh"
#include "kbit_ops.h"

namespace kbit {
namespace {

template <typename T, int BITS>
__global__ void __launch_bounds__(256) dequant_kernel(const uint32_t* __restrict__ packed,
                                                      const uint8_t* __restrict__ absmax,
                                                      const float* __restrict__ codebook, T* __restrict__ w,
                                                      int n_begin, int n_end, int k) {
  __shared__ float cb[1 << BITS];
  if (threadIdx.x < (1 << BITS)) cb[threadIdx.x] = codebook[threadIdx.x];
  __syncthreads();
  const int nb = k / kBlock, ku_count = k_units(k);
  const long long total = (long long)(n_end - n_begin) * nb;
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
       idx += (long long)gridDim.x * blockDim.x) {
    const int c = n_begin + int(idx / nb), jb = int(idx % nb);
    const long long unit = (long long)(c / kUnitN) * ku_count + jb / 2;
    const int j = (c % kUnitN) / 8, g = c % 8;
    const int wsel = 2 * (jb & 1) + (j >> 2), q = j & 3;
    uint32_t index[kBlock];
#pragma unroll
    for (int i = 0; i < kBlock; ++i) index[i] = 0;
#pragma unroll
    for (int b = 0; b < BITS; ++b) {
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const uint32_t word = __ldg(packed + (unit * BITS + b) * 128 + (4 * g + t) * 4 + wsel);
        const uint32_t byte = (word >> (8 * q)) & 0xFF;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int i = 16 * (e >> 2) + 8 * ((e >> 1) & 1) + 2 * t + (e & 1);  // kbit_layout.cuh
          index[i] |= ((byte >> e) & 1u) << b;
        }
      }
    }
    const float scale = decode_e4m4_exact(__ldg(absmax + unit * kUnitAbsmaxBytes + g * 16 + wsel * 4 + q));
    T* out = w + (long long)(c - n_begin) * k + (long long)jb * kBlock;
#pragma unroll
    for (int v = 0; v < kBlock * (int)sizeof(T) / 16; ++v) {  // 16-byte stores
      constexpr int kPer = 16 / sizeof(T);
      T vals[kPer];
#pragma unroll
      for (int i = 0; i < kPer; ++i) vals[i] = from_float<T>(cb[index[v * kPer + i]] * scale);
      reinterpret_cast<uint4*>(out)[v] = *reinterpret_cast<const uint4*>(vals);
    }
  }
}

template <typename T>
cudaError_t launch_dequant_t(const uint32_t* packed, const uint8_t* absmax, const float* codebook, T* w, int n_begin,
                             int n_end, int k, int bits, cudaStream_t stream) {
  const long long total = (long long)(n_end - n_begin) * (k / kBlock);
  constexpr int kThreads = 256;
  long long grid = (total + kThreads - 1) / kThreads;
  if (grid > (1 << 20)) grid = 1 << 20;
  if (grid < 1) grid = 1;
#define KBIT_DQ(B) dequant_kernel<T, B><<<int(grid), kThreads, 0, stream>>>(packed, absmax, codebook, w, n_begin, n_end, k)
  switch (bits) {
    case 2: KBIT_DQ(2); break;
    case 3: KBIT_DQ(3); break;
    case 4: KBIT_DQ(4); break;
    case 5: KBIT_DQ(5); break;
    default: return cudaErrorInvalidValue;
  }
#undef KBIT_DQ
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_dequantize(DType dtype, const uint32_t* packed, const uint8_t* absmax, const float* codebook,
                              void* w, int n_begin, int n_end, int k, int bits, cudaStream_t stream) {
  if (n_begin < 0 || n_end <= n_begin || k <= 0 || k % kBlock != 0) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kHalf:
      return launch_dequant_t(packed, absmax, codebook, static_cast<__half*>(w), n_begin, n_end, k, bits, stream);
    case DType::kBFloat16:
      return launch_dequant_t(packed, absmax, codebook, static_cast<__nv_bfloat16*>(w), n_begin, n_end, k, bits,
                              stream);
    case DType::kFloat32:
      return launch_dequant_t(packed, absmax, codebook, static_cast<float*>(w), n_begin, n_end, k, bits, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kbit
