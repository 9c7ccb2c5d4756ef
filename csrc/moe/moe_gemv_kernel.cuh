// Grouped kbit GEMV over MoE experts (kbit::moe_gemm): the decode / small-batch path of a kbit
// MoE layer. Torch-free; instantiated per bit width and dtype in moe_launch.cu.
//
// Work. vLLM's moe_align_block_size groups the (token, expert) pairs by expert into blocks of
// block_m sorted ids, each block one expert. A CTA takes one block and one 64-column slab of W
// and streams that expert's units of the slab along K once, for every real row of the block
// together: its 4 warps interleave over the K units (ku = warp + it * kMoeWarps), each a ring
// of register stages as the dense GEMV's warps (gemv/gemv_kernel.cuh), then sum through shared memory
// in a fixed order (deterministic, no atomics). At batch 1 only the top_k routed experts' blocks
// do any work, so the bytes read are those of the routed experts alone.
//
// Codebooks. The block's expert e decodes with its own codebook (codebook + e * stride: one
// per expert where convert fitted them, stride 0 where the layer has one), loaded into the
// block's table where the dense GEMV loads its layer's.
//
// Reuse. The unit loads (LaneUnit), the decode and the MMAs (gemv::compute_stage: W as the A
// operand, x^T as the B operand of m16n8k16, the block scales on the weights or in fp32 as the
// dense plan picks them, gemv::scale_weights) are the dense GEMV's, unchanged. What differs is
// where x comes from: B column r of the block is x row sorted_ids[r] / top_k (a gathered row),
// and the epilogue scatters output row r to y row sorted_ids[r], times its routing weight.
//
// Padding. The block's ids are compacted first (a warp ballot: ids >= num_pairs are padding),
// so a block of R real rows runs one n8 tile of x (R <= 8) or two (R <= 16), and padding ids
// cost no x loads; the weights are read once per block whatever R is. Blocks past
// num_tokens_post_padded, of expert -1 (not on this rank), or without a real row exit before
// reading anything else. The grid is ceil(num_sorted / block_m) x slabs (shapes only).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/common.cuh"
#include "core/decode.cuh"
#include "gemv/gemv_kernel.cuh"
#include "core/layout.cuh"
#include "moe/moe_config.h"

namespace kbit {
namespace moe {

constexpr int kMoeWarps = 4;  // warps per CTA; four CTAs per SM at the 128-register bound
constexpr int kMoeThreads = kMoeWarps * 32;

struct MoeParams {
  const void* x;                 // [num_pairs / top_k, k]
  const uint32_t* packed;        // [E, expert_words]
  const uint8_t* absmax;         // [E, expert_bytes]
  const float* codebook;         // expert e's at codebook + e * codebook_stride
  const int32_t* sorted_ids;     // [num_sorted]
  const int32_t* expert_ids;     // [ceil(num_sorted / block_m)]
  const int32_t* num_tokens_post_padded;  // [1]
  const float* topk_weights;     // [num_pairs] or nullptr
  void* y;                       // [num_pairs, n]
  long long expert_words, expert_bytes;
  int codebook_stride;           // 2^bits: one codebook per expert; 0: one shared
  int n, k, ku_count, num_experts, num_pairs, num_sorted, block_m, top_k;
};

// Register stages a warp keeps: the dense kernels' depth for one n8 tile of x; two with two
// tiles, whose x registers would not fit a third in 128 registers.
template <int BITS, int MT> constexpr int stages() { return MT == 1 ? gemv::Traits<BITS>::kStages : 2; }

// Shared memory: the pair table (K=3,4), reused after the main loop as the cross-warp scratch.
template <int BITS> struct MoeSmem {
  static constexpr int kAccMax = gemv::kPairsPerLane * 2 * 4;  // floats per lane at two n8 tiles
  static constexpr int kRedBytes = kMoeWarps * kAccMax * 32 * 4;
  static constexpr int kLutBytes = gemv::Traits<BITS>::kLutBytes;
  static constexpr int kBytes = kLutBytes > kRedBytes ? kLutBytes : kRedBytes;
  static_assert(kBytes <= 48 * 1024, "static shared memory");
};

// The x operand registers of one unit from the gathered rows (gemv::load_stage reads rows
// 8 mt + g of a dense x instead): this lane's B fragments of n8 tile mt are row xrow[mt]
// (nullptr past the block's real rows: zeros, no load), k = 64 ku + 32 kb + 2t + 8i, never
// beyond k.
template <int BITS, int MT, typename T>
__device__ __forceinline__ void load_x_gathered(gemv::Stage<BITS, MT>& st, const T* const (&xrow)[MT], int k, int ku,
                                                int lane) {
  const int t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) {
      const int k0 = ku * kUnitK + kb * kBlock;
      if (xrow[mt] != nullptr && k0 < k) {
        const uint32_t* xr = reinterpret_cast<const uint32_t*>(xrow[mt] + k0 + 2 * t);
#pragma unroll
        for (int i = 0; i < 4; ++i) st.x[mt][kb][i] = __ldg(xr + 4 * i);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) st.x[mt][kb][i] = 0u;
      }
    }
  }
}

// One block (expert e, `nrows` real rows with pair ids ids[0..nrows)) x one slab nu.
template <int BITS, int MT, typename T>
__device__ __forceinline__ void moe_block(const MoeParams& p, uint32_t* smem, const int* ids, int nrows, int e,
                                          int nu) {
  constexpr bool kScaleW = gemv::scale_weights<BITS, MT>();
  constexpr int kStages = stages<BITS, MT>();
  constexpr int kAcc = gemv::kPairsPerLane * MT * 4;
  using Stage = gemv::Stage<BITS, MT>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // the block's expert's codebook: one table fill per block, as with a shared one
  const uint32_t table = init_codebook<BITS, T, false>(p.codebook + (long long)e * p.codebook_stride,
                                                       kScaleW ? codebook_mult<T>() : 1.0f, smem, threadIdx.x,
                                                       kMoeThreads);
  __syncthreads();  // the pair table (K=3,4) and the block's compacted ids
  const uint32_t lut_addr = opaque(uint32_t(__cvta_generic_to_shared(smem)) + 4u * (lane % kLutReplicas));

  const T* x = static_cast<const T*>(p.x);
  const T* xrow[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int row = 8 * mt + (lane >> 2);
    xrow[mt] = row < nrows ? x + (long long)(ids[row] / p.top_k) * p.k : nullptr;
  }
  const uint32_t* packed = p.packed + (long long)e * p.expert_words;
  const uint8_t* absmax = p.absmax + (long long)e * p.expert_bytes;
  const long long unit0 = (long long)nu * p.ku_count;

  float acc[gemv::kPairsPerLane][MT][4];
#pragma unroll
  for (int i = 0; i < gemv::kPairsPerLane; ++i)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][mt][j] = 0.f;

  // ---- this warp's units ku = warp + it * kMoeWarps: kStages - 1 in flight while one decodes
  const int n_iter = p.ku_count > warp ? (p.ku_count - warp + kMoeWarps - 1) / kMoeWarps : 0;
  Stage st[kStages];
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_iter) {
      const int ku = warp + s * kMoeWarps;
      st[s].load(packed, absmax, unit0 + ku, lane);
      load_x_gathered<BITS, MT, T>(st[s], xrow, p.k, ku, lane);
    }
  }
  for (int it0 = 0; it0 < n_iter; it0 += kStages) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      const int it = it0 + s;
      if (it < n_iter) {
        const int nxt = it + kStages - 1, sn = (s + kStages - 1) % kStages;
        if (nxt < n_iter) {
          const int ku = warp + nxt * kMoeWarps;
          st[sn].load(packed, absmax, unit0 + ku, lane);
          load_x_gathered<BITS, MT, T>(st[sn], xrow, p.k, ku, lane);
        }
        gemv::compute_stage<BITS, MT, T, false, false, kScaleW>(st[s], acc, lut_addr, table, 0u);
      }
    }
  }

  // ---- sum the warps (fixed order), scale, scatter rows to y
  __syncthreads();  // the pair table's region becomes the scratch
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < gemv::kPairsPerLane; ++i)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j) red[(warp * kAcc + (i * MT + mt) * 4 + j) * 32 + lane] = acc[i][mt][j];
  __syncthreads();
  T* y = static_cast<T*>(p.y);
  // element (row r, column c) of the block's 8 MT x 64 outputs, consecutive threads on
  // consecutive columns: the MMA's D fragment holds it in register j = 2 (c16 >> 3) + (r & 1)
  // of accumulator pair pr = c >> 4, n8 tile mt = r >> 3, lane 4 (c & 7) + ((r & 7) >> 1)
  for (int el = threadIdx.x; el < 8 * MT * kUnitN; el += kMoeThreads) {
    const int r = el / kUnitN, c = el % kUnitN;
    const int col = nu * kUnitN + c;
    if (r >= nrows || col >= p.n) continue;
    const int c16 = c & 15, pr = c >> 4, mt = r >> 3, r8 = r & 7;
    const int j = 2 * (c16 >> 3) + (r8 & 1), src = 4 * (c16 & 7) + (r8 >> 1);
    const int i = (pr * MT + mt) * 4 + j;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kMoeWarps; ++w) s += red[(w * kAcc + i) * 32 + src];
    if constexpr (!kScaleW) s *= 16.f;  // the fp32 scales were E4M4 / 16 (gemv/gemv_kernel.cuh)
    const int pair = ids[r];
    if (p.topk_weights != nullptr) s *= __ldg(p.topk_weights + pair);
    y[(long long)pair * p.n + col] = from_float<T>(s);
  }
}

template <int BITS, typename T>
__global__ void __launch_bounds__(kMoeThreads, 3) moe_gemv_kernel(const MoeParams p) {
  __shared__ __align__(16) uint32_t smem[MoeSmem<BITS>::kBytes / 4];
  __shared__ int ids[kMoeMaxBlockM];
  const int block = blockIdx.x, nu = blockIdx.y;
  const int start = block * p.block_m;
  // sorted ids and expert ids past num_tokens_post_padded may be uninitialized: read neither
  if (start >= __ldg(p.num_tokens_post_padded)) return;
  const int e = __ldg(p.expert_ids + block);
  if (e < 0 || e >= p.num_experts) return;
  const int lane = threadIdx.x & 31;
  int id = -1;
  if (lane < p.block_m && start + lane < p.num_sorted) id = __ldg(p.sorted_ids + start + lane);
  const bool real = unsigned(id) < unsigned(p.num_pairs);
  const unsigned mask = __ballot_sync(0xFFFFFFFFu, real);
  const int nrows = __popc(mask);
  if (nrows == 0) return;
  if (threadIdx.x < 32 && real) ids[__popc(mask & ((1u << lane) - 1u))] = id;  // visible after moe_block's sync
  if (nrows <= 8) {
    moe_block<BITS, 1, T>(p, smem, ids, nrows, e, nu);
  } else {
    moe_block<BITS, 2, T>(p, smem, ids, nrows, e, nu);
  }
}

// Launch of one instantiation: `blocks` blocks of sorted ids x the column units.
template <int BITS, typename T>
cudaError_t launch_kernel(const MoeParams& p, int blocks, cudaStream_t stream) {
  moe_gemv_kernel<BITS, T><<<dim3(blocks, n_units(p.n), 1), kMoeThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// The selector's entry of one instantiation (moe_kernels.h, generated).
template <int BITS, typename T>
constexpr MoeKernel kernel_entry() {
  constexpr cudaError_t (*launch)(const MoeParams&, int, cudaStream_t) = &launch_kernel<BITS, T>;
  return {launch};
}

}  // namespace moe
}  // namespace kbit
