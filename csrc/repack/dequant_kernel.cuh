// The dequantize kernel: the tiled layout to row-major W rows [n_begin, n_end) (the large-M
// path, a test hook) or stacked MoE experts whole (the experts on the grid's y dimension); the
// launches are repack/dequantize.cu's.
// Values are float(codebook[idx]) * decode(absmax) rounded once: bit-exact with
// format.dequantize. The e4m3 output (kbit::decode_fp8) is the weight the FP8 GEMM decodes in
// registers (vllm_kbit/fp8.py, step 3): the shared table holds that GEMM's fp16 entries
// fp16(cb * 2^(r + 4)), and each product times 1/16 is rounded to fp16, then to e4m3.
//
// Design. One warp per 64x64 unit, as the GEMV reads it: each lane loads its own 16 bytes per
// bit-plane (a warp reads 512 contiguous bytes per plane) and its 16 absmax codes, the next
// unit's loads in flight while this one decodes. A lane's plane words hold, per (column,
// block), 8 elements at k = 2t + {0, 1, 8, 9, 16, 17, 24, 25} (core/layout.cuh): their indices
// come out of the IndexWords nibble / byte fields (~1 op each), their values from a
// 32-replica fp32 codebook in shared memory (lane l reads replica l: conflict-free). The
// rounded pairs (k, k + 1) go to a per-warp staging block of 64 rows (one per column), and the
// warp writes it back as 16-byte stores, 8 rows x 64 contiguous bytes per instruction (full
// sectors). Gathering each index bit by bit, or 16-byte stores 64 bytes apart across a warp
// (half-written sectors), was slower; this one runs at about the DRAM's rate for a stream of
// 80% writes (docs/PERFORMANCE.md).
#pragma once
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "core/common.cuh"
#include "core/decode.cuh"
#include "core/device.h"
#include "core/layout.cuh"
#include "repack/repack_config.h"

namespace kbit {
namespace repack {

constexpr int kDqWarps = 4;  // warps per CTA (units are per warp; small CTAs pack the SMs)

// One warp's staging block: 64 rows (the unit's columns) of one 32-block, each padded by 16
// bytes. For 2-byte outputs (rows of 80 B) that keeps both directions conflict-free: a 4-byte
// store instruction covers rows g = 0..7 of one n8 group at word t of one 16-byte chunk (banks
// 20 g + t + a constant: 32 distinct), and each quarter-warp of a 16-byte read takes chunk c of
// 8 rows r (banks 20 r + 4 c + 0..3). fp32 output (a test hook) takes some 2-way conflicts.
template <typename T> struct DqStaging {
  static constexpr int kRowBytes = kBlock * int(sizeof(T)) + 16;
  static constexpr int kBytes = kUnitN * kRowBytes;
  static constexpr int kChunks = kBlock * int(sizeof(T)) / 16;  // 16-byte chunks per row
  static constexpr int kRowsPerStore = 32 / kChunks;            // rows one warp store covers
  static_assert(kRowBytes % 16 == 0, "16-byte aligned rows");
};

// Two rounded values (k, k + 1) as one store.
template <typename T> struct DqPair { using type = uint32_t; };
template <> struct DqPair<float> { using type = float2; };
template <typename T> __device__ __forceinline__ typename DqPair<T>::type dq_pair(float a, float b) { return pack2<T>(a, b); }
template <> __device__ __forceinline__ float2 dq_pair<float>(float a, float b) { return make_float2(a, b); }
template <> struct DqPair<__nv_fp8_e4m3> { using type = uint16_t; };
template <> __device__ __forceinline__ uint16_t dq_pair<__nv_fp8_e4m3>(float a, float b) {
  // a, b = table entry * E4M4 (exact in fp32); / 16 is exact too, so the fp16 rounding here is
  // the GEMM's one HMUL2 rounding, and cvt.rn.satfinite its e4m3 rounding.
  const __half2_raw h = __floats2half2_rn(a * 0.0625f, b * 0.0625f);
  return __nv_cvt_halfraw2_to_fp8x2(h, __NV_SATFINITE, __NV_E4M3);
}

// kStacked: stacked MoE experts (launch_dequantize_experts), expert blockIdx.y's layout, output
// and codebook at the given strides (codebook_stride 0: one shared); its own instantiation, so
// the single-weight kernel keeps its code
// and registers (the offsets cost it up to 14 registers, sm_90a).
template <typename T, int BITS, bool kStacked>
__global__ void __launch_bounds__(kDqWarps * 32) dequant_kernel(const uint32_t* __restrict__ packed,
                                                                const uint8_t* __restrict__ absmax,
                                                                const float* __restrict__ codebook, T* __restrict__ w,
                                                                int n_begin, int n_end, int k, long long expert_words,
                                                                long long expert_bytes, long long expert_elems,
                                                                int codebook_stride, float codebook_scale) {
  if constexpr (kStacked) {
    packed += blockIdx.y * expert_words;
    absmax += blockIdx.y * expert_bytes;
    w += blockIdx.y * expert_elems;
    codebook += blockIdx.y * codebook_stride;
  }
  using S = DqStaging<T>;
  using Pair = typename DqPair<T>::type;
  constexpr int kEntries = 1 << BITS;
  __shared__ float lut[kEntries * 32];  // entry v of replica r at word 32 v + r (bank r)
  __shared__ __align__(16) uint8_t staging[kDqWarps][S::kBytes];
  for (int i = threadIdx.x; i < kEntries * 32; i += blockDim.x) {
    const float c = __ldg(codebook + (i >> 5));
    if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) lut[i] = __half2float(__float2half_rn(c * codebook_scale));
    else lut[i] = c;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3, g = lane >> 2;
  const float* my_lut = lut + lane;
  uint8_t* st = staging[warp];
  const int ku_count = k_units(k), nb = k / kBlock;
  const int nu0 = n_begin / kUnitN;
  const long long units = (long long)(n_units(n_end) - nu0) * ku_count;
  const long long unit0 = (long long)nu0 * ku_count;  // layout unit nu * ku_count + ku: item u is unit0 + u
  const long long stride = (long long)gridDim.x * kDqWarps;
  long long u = (long long)blockIdx.x * kDqWarps + warp;
  LaneUnit<BITS> cur, nxt;  // the unit in decode, the next one in flight
  if (u < units) cur.load(packed, absmax, unit0 + u, lane);
  for (; u < units; u += stride) {
    const int nu = nu0 + int(u / ku_count), ku = int(u % ku_count);
    const long long un = u + stride;
    if (un < units) nxt.load(packed, absmax, unit0 + un, lane);
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) {
      __syncwarp();  // the previous block's staging reads are done
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int wi = 2 * kb + h;
        uint32_t planes[BITS];
#pragma unroll
        for (int b = 0; b < BITS; ++b) planes[b] = comp(cur.w[b], wi);
        IndexWords<BITS> iw;
        iw.build(planes);
        const uint32_t codes = comp(cur.a, wi);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float scale = decode_e4m4_exact((codes >> (8 * q)) & 0xFFu);
          float v[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = my_lut[(iw.lane_of(q, e >> 2, e & 3) & (kEntries - 1)) * 32] * scale;
          // row: column 8 (4h + q) + g of the unit; element e sits at k = 16 (e >> 2) + 8 ((e >> 1) & 1) + 2t + (e & 1)
          uint8_t* row = st + (8 * (4 * h + q) + g) * S::kRowBytes;
#pragma unroll
          for (int e = 0; e < 8; e += 2) {
            const int k0 = 16 * (e >> 2) + 8 * ((e >> 1) & 1) + 2 * t;
            *reinterpret_cast<Pair*>(row + k0 * int(sizeof(T))) = dq_pair<T>(v[e], v[e + 1]);
          }
        }
      }
      __syncwarp();  // every lane's pairs are in the staging block
      const int jb = 2 * ku + kb;
      if (jb < nb) {
#pragma unroll
        for (int it = 0; it < kUnitN / S::kRowsPerStore; ++it) {
          const int r = (lane % S::kRowsPerStore) + S::kRowsPerStore * it, ch = lane / S::kRowsPerStore;
          const int c = nu * kUnitN + r;
          const uint4 val = *reinterpret_cast<const uint4*>(st + r * S::kRowBytes + 16 * ch);
          if (c >= n_begin && c < n_end)
            *reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(w + (long long)(c - n_begin) * k + jb * kBlock) + 16 * ch) = val;
        }
      }
    }
    cur = nxt;
  }
}

// Launch of one instantiation: a grid-stride loop over units with as many CTAs as are resident
// at once (asked once per instantiation), so that every warp runs a few units and its next loads
// overlap its decode.
template <typename T, int BITS, bool kStacked>
cudaError_t launch_kernel(const DequantParams& p, cudaStream_t stream) {
  const auto kernel = dequant_kernel<T, BITS, kStacked>;
  static const int per_sm = [&] {
    int b = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, kDqWarps * 32, 0) == cudaSuccess && b > 0 ? b : 1;
  }();
  const int sms = device_attribute<cudaDevAttrMultiProcessorCount>();
  const int n_begin = p.n_begin, n_end = p.n_end, k = p.k, experts = p.experts;
  const long long units = (long long)(n_units(n_end) - n_begin / kUnitN) * k_units(k);
  // (stacked experts: the resident CTAs shared out over them, at least one each)
  const long long cap = (long long)per_sm * (sms > 0 ? sms : 1) / experts;
  const long long need = (units + kDqWarps - 1) / kDqWarps;
  const int grid = int(need < cap ? (need > 0 ? need : 1) : (cap > 0 ? cap : 1));
  // one expert's tiled layout and output (stacked: (n_begin, n_end) = (0, n))
  const long long layout_units = (long long)n_units(n_end) * k_units(k);
  const long long words = layout_units * unit_words(BITS), bytes = layout_units * kUnitAbsmaxBytes;
  const long long elems = (long long)n_end * k;
  kernel<<<dim3(grid, experts, 1), kDqWarps * 32, 0, stream>>>(p.packed, p.absmax, p.codebook, static_cast<T*>(p.w),
                                                               n_begin, n_end, k, words, bytes, elems,
                                                               p.codebook_stride, p.codebook_scale);
  return cudaGetLastError();
}

// The selector's entry of one instantiation (dequant_kernels.h, generated).
template <int BITS, typename T, bool kStacked>
constexpr DequantKernel kernel_entry() {
  constexpr cudaError_t (*launch)(const DequantParams&, cudaStream_t) = &launch_kernel<T, BITS, kStacked>;
  return {launch};
}

}  // namespace repack
}  // namespace kbit
