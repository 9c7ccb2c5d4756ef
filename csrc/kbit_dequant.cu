// Dequantize the tiled layout to row-major W rows [n_begin, n_end): the large-M fallback
// (dequant + cuBLAS, in N-chunks so the scratch stays bounded) and a test hook.
// Values are float(codebook[idx]) * decode(absmax) rounded once: bit-exact with
// format.dequantize.
#include <cstdint>

#include "kbit_common.cuh"
#include "kbit_decode.cuh"
#include "kbit_layout.cuh"
#include "kbit_ops.h"

namespace kbit {
namespace {

// Tile of one CTA: the 64 columns of one n-unit x kTileUnits consecutive k-units. The tile's
// packed words and absmax bytes are read once, coalesced (16-byte loads, a warp reads 512
// contiguous bytes), into shared memory; then each thread builds the 32 indices of one
// (column, block) from there. (The first version read the planes straight from global memory
// per (column, block): 4-byte loads at a 16-byte stride, the same word fetched by the 4
// columns that share it from different CTAs; it moved ~1.3 TB/s on the H200.)
constexpr int kDqThreads = 256;
constexpr int kTileUnits = 4;
constexpr int kTileTasks = kUnitN * 2 * kTileUnits;  // (column, block) pairs of a tile
static_assert(kTileTasks % kDqThreads == 0, "whole tasks per thread");
// +4 words per unit: units sit 4 banks apart, so the lanes of a warp (8 blocks x 4 columns)
// hit each bank at most twice; 4 keeps every unit 16-byte aligned for the vector stores.
template <int BITS> __host__ __device__ constexpr int unit_stride_words() { return unit_words(BITS) + 4; }

template <typename T, int BITS>
__global__ void __launch_bounds__(kDqThreads) dequant_kernel(const uint32_t* __restrict__ packed,
                                                             const uint8_t* __restrict__ absmax,
                                                             const float* __restrict__ codebook, T* __restrict__ w,
                                                             int n_begin, int n_end, int k) {
  constexpr int kStride = unit_stride_words<BITS>();
  __shared__ __align__(16) uint32_t sp[kTileUnits * kStride];
  __shared__ __align__(16) uint32_t sa[kTileUnits * kUnitAbsmaxBytes / 4];
  __shared__ float cb[1 << BITS];
  if (threadIdx.x < (1 << BITS)) cb[threadIdx.x] = codebook[threadIdx.x];
  const int nb = k / kBlock, ku_count = k_units(k);
  const int nu0 = n_begin / kUnitN, nu_count = n_units(n_end) - nu0;
  const int kt_count = div_up(ku_count, kTileUnits);
  const long long tiles = (long long)nu_count * kt_count;
  for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int nu = nu0 + int(tile / kt_count), ku0 = int(tile % kt_count) * kTileUnits;
    const int units = min(kTileUnits, ku_count - ku0);
    __syncthreads();  // the previous tile's readers are done with sp / sa (and cb is written)
    const uint4* src = reinterpret_cast<const uint4*>(packed + ((long long)nu * ku_count + ku0) * unit_words(BITS));
    for (int v = threadIdx.x; v < units * unit_words(BITS) / 4; v += kDqThreads) {
      const int u = v / (unit_words(BITS) / 4), r = v % (unit_words(BITS) / 4);
      *reinterpret_cast<uint4*>(sp + u * kStride + 4 * r) = ld_stream_v4(src + v);
    }
    const uint4* asrc = reinterpret_cast<const uint4*>(absmax + ((long long)nu * ku_count + ku0) * kUnitAbsmaxBytes);
    for (int v = threadIdx.x; v < units * kUnitAbsmaxBytes / 16; v += kDqThreads)
      reinterpret_cast<uint4*>(sa)[v] = ld_stream_v4(asrc + v);
    __syncthreads();
#pragma unroll 1
    for (int task = threadIdx.x; task < kTileTasks; task += kDqThreads) {
      // 8 consecutive blocks of a column per 8 lanes: each writes 64 contiguous bytes (fp16)
      const int jl = task % (2 * kTileUnits), cl = task / (2 * kTileUnits);
      const int c = nu * kUnitN + cl, jb = 2 * ku0 + jl;
      if (c < n_begin || c >= n_end || jb >= nb) continue;
      const int u = jl >> 1, j = cl / 8, g = cl % 8;
      const int wsel = 2 * (jl & 1) + (j >> 2), q = j & 3;
      // per t: the BITS plane words of lane (g, t) (for K=4 the layout's nibble words, transposed
      // back to planes: the transpose is its own inverse); column q's 8 elements of this block
      // sit at bits e = 0..7 of byte q, and their index bits are gathered plane by plane.
      // Measured: the lean form through IndexWords (nibble fields, ~1/3 of the integer ops) ran
      // 1.3x slower on the H200, 728 vs 550 us on 57344x8192 K=4, with the L2 at 78% of its
      // throughput (ncu) and DRAM at 38%.
      uint32_t index[kBlock];
#pragma unroll
      for (int i = 0; i < kBlock; ++i) index[i] = 0;
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        uint32_t pl[BITS];
#pragma unroll
        for (int b = 0; b < BITS; ++b) pl[b] = sp[u * kStride + b * 128 + (4 * g + t) * 4 + wsel];
        if constexpr (layout_stores_nibbles(BITS)) {
          uint32_t planes[BITS];
#pragma unroll
          for (int b = 0; b < BITS; ++b) planes[b] = transpose_nibbles<BITS>(pl, b);
#pragma unroll
          for (int b = 0; b < BITS; ++b) pl[b] = planes[b];
        }
#pragma unroll
        for (int b = 0; b < BITS; ++b) {
          const uint32_t byte = (pl[b] >> (8 * q)) & 0xFF;
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int i = 16 * (e >> 2) + 8 * ((e >> 1) & 1) + 2 * t + (e & 1);  // kbit_layout.cuh
            index[i] |= ((byte >> e) & 1u) << b;
          }
        }
      }
      const uint32_t code = (sa[u * (kUnitAbsmaxBytes / 4) + g * 4 + wsel] >> (8 * q)) & 0xFF;
      const float scale = decode_e4m4_exact(code);
      T* out = w + (long long)(c - n_begin) * k + (long long)jb * kBlock;
#pragma unroll
      for (int v = 0; v < kBlock * (int)sizeof(T) / 16; ++v) {  // 16-byte stores
        constexpr int kPer = 16 / sizeof(T);
        T vals[kPer];
#pragma unroll
        for (int ii = 0; ii < kPer; ++ii) vals[ii] = from_float<T>(cb[index[v * kPer + ii]] * scale);
        reinterpret_cast<uint4*>(out)[v] = *reinterpret_cast<const uint4*>(vals);
      }
    }
  }
}

template <typename T>
cudaError_t launch_dequant_t(const uint32_t* packed, const uint8_t* absmax, const float* codebook, T* w, int n_begin,
                             int n_end, int k, int bits, cudaStream_t stream) {
  const long long tiles = (long long)(n_units(n_end) - n_begin / kUnitN) * div_up(k_units(k), kTileUnits);
  // a grid-stride loop over tiles; 8 CTAs of 256 threads fit an SM (shared memory ~11 KB each)
  long long grid = tiles < (1 << 20) ? tiles : (1 << 20);
  if (grid < 1) grid = 1;
#define KBIT_DQ(B) dequant_kernel<T, B><<<int(grid), kDqThreads, 0, stream>>>(packed, absmax, codebook, w, n_begin, n_end, k)
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
