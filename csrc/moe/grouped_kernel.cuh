// Grouped tensor-core kbit GEMM over MoE experts (kbit::moe_gemm_grouped; Hopper, sm_90a): the
// large-batch path of a kbit MoE layer. Torch-free; instantiated per bit width in
// moe/instantiations/moe_grouped_k<BITS>.cu, launched by moe/grouped_launch.cu.
//
// Work. vLLM's moe_align_block_size groups the (token, expert) pairs by expert into blocks of
// block_m = MT sorted ids, each block one expert. A CTA takes one block and one group of
// columns: exactly the dense wgmma kernel's CTA of MT tokens (wgmma/config.cuh Cfg<BITS, MT, CN,
// 2, CPS>: two consumer warpgroups that split each unit's row tiles; 256 columns at 64 and 128
// tokens, the tall CTA's 128 at 256; built for one CTA per SM, with a producer warpgroup and the
// wide pair table at K = 3, 4, or at 64 tokens for two, whose consumers issue the copies), whose
// main loop (wgmma/mainloop.cuh consume: decode + wgmma with x^T as the shared-memory B operand)
// runs unchanged on the block's expert: W's units at
// packed + e * expert_words, its absmax at absmax + e * expert_bytes, its codebook at codebook +
// e * codebook_stride (one table fill per CTA either way).
//
// What differs from the dense kernel is where x comes from and where y goes:
//   * x rows are gathered: token row r of the tile is x[sorted_ids[m0 + r] / top_k]. A TMA box
//     cannot gather rows, so the issuers (the producer warpgroup's 128 threads, or all 256
//     consumers) copy them with cp.async, 16 B a thread and row, into the 128 B swizzle the
//     descriptor reads (chunk c of row r at chunk c ^ (r % 8)), zero-filled for padding ids and
//     past K; each issuer's cp.async.mbarrier.arrive.noinc completes the stage's mbarrier with
//     its copies, beside the W units' bulk copies (one thread). The consumers fence the proxies
//     before their wgmmas read the tile (consume's kGatheredX). The rows' sources are looked
//     up once per CTA into the bytes stages 0 and 1 leave unused after their W units.
//   * the epilogue stages the fp32 accumulators in shared memory, then writes y row by row:
//     16 B stores to y[sorted_ids[m0 + r]] (the scatter), after the activation (fused: the gate
//     and up columns of one output sit in the same CTA, below) and times the pair's router
//     weight, both in fp32, rounded once. Padding rows are not written.
//   * gated activations: the first half of a CTA's S slabs multiplies gate units (S / 2) z ..,
//     the second half the up units of the same columns, n_units / 2 + (S / 2) z .., so column
//     group z writes the CN / 2 columns act(gate) * up from (CN / 2) z (n / 2 a multiple of 64:
//     the launcher checks it).
// Blocks past num_tokens_post_padded and of expert -1 (not on this rank) exit before reading
// anything else; the grid depends on the shapes only (CUDA-graph safe). No split-K: a layer's
// blocks x column groups fill the GPU at the batch sizes this kernel serves.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moe/grouped_config.h"
#include "wgmma/mainloop.cuh"

namespace kbit {
namespace moe {

// The CTA: the dense wgmma kernel's two-warpgroup CTA of 256 columns (64 or 128 tokens) or its
// tall CTA of 128 columns (256 tokens), built for CPS CTAs per SM: one (a producer warpgroup,
// the wide pair table at K = 3, 4) or two (64 tokens: the consumers issue the copies).
template <int BITS, int MT, int CPS> struct GroupedCfg {
  static constexpr int kColumns = grouped_columns(MT);
  using C = wg::Cfg<BITS, MT, kColumns, 2, CPS>;
  static_assert(C::kSlabsCta * kUnitN == kColumns && C::kProducer == (CPS == 1), "the CTA of two warpgroups");
  // the threads that copy x rows: the producer warpgroup, or every consumer
  static constexpr int kIssuers = C::kProducer ? 128 : C::kConsumers;
  static_assert(MT * 8 % kIssuers == 0, "each issuer copies whole rows' chunks");
  // stage s's "full" mbarrier: every issuer's cp.async arrival and the W issuer's expect_tx
  static constexpr int kFullCount = kIssuers + 1;
  static constexpr int kWBytes = C::kSlabsCta * C::kUnitBytes;
  // the rows' source tokens (int32, -1 for padding) after the W units of stage 0 (rows 0..127)
  // and stage 1 (rows 128..255)
  static constexpr int kRowTableOff = C::kXBytes + kWBytes;
  static_assert(C::kStageBytes - kRowTableOff >= (MT < 128 ? MT : 128) * 4, "the row table fits a stage's tail");
  // the epilogue's fp32 tile [MT][columns + 4] (the pad: the 8 g x 4 t4 lanes of one
  // accumulator register hit 32 banks), over the drained pipeline, below the mbarriers
  static constexpr int kTileStride = kColumns + 4;
  static constexpr int kTileBytes = MT * kTileStride * 4;
  static_assert(kTileBytes <= (C::kWideLut ? C::kWideUsable : C::kBarOff), "the epilogue tile fits");
  static_assert(C::kThreads == C::kConsumers + (C::kProducer ? 128 : 0), "one producer warpgroup, if any");
};

#if KBIT_WGMMA_DEVICE
// Completes one arrival of the mbarrier (counted in its init count: .noinc) once every cp.async
// this thread issued before it has landed.
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void sts_s32(uint32_t addr, int v) {
  asm volatile("st.shared.s32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// act(v) of the non-gated activations, and of the gate of the gated ones; vLLM's formulas.
__device__ __forceinline__ float activate(int activation, float v) {
  switch (activation) {
    case int(Activation::kSiluAndMul):
    case int(Activation::kSilu):
      return v / (1.f + expf(-v));
    case int(Activation::kGeluAndMul):
    case int(Activation::kGelu):
      return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
    case int(Activation::kGeluTanhAndMul):
    case int(Activation::kGeluTanh):
      return 0.5f * v * (1.f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    case int(Activation::kRelu2): {
      const float r = fmaxf(v, 0.f);
      return r * r;
    }
    default:
      return v;
  }
}

// The expert's layout unit column of slab `sl` of the S slabs of column group `cg`; *ok false
// past the weight (then unit column 0 is read and never used). Gated: the first S / 2 slabs are
// gate units, the others the up units of the same columns.
template <int S>
__device__ __forceinline__ int slab_unit(const GroupedParams& p, int cg, int sl, bool* ok) {
  const int units = n_units(p.n);
  int nu;
  if (is_gated(p.activation)) {
    const int half = units / 2, j = (S / 2) * cg + sl % (S / 2);
    nu = (sl < S / 2 ? 0 : half) + j;
    *ok = j < half;
  } else {
    nu = cg * S + sl;
    *ok = nu < units;
  }
  return *ok ? nu : 0;
}

// The row table's entry of tile row r (GroupedCfg::kRowTableOff).
__device__ __forceinline__ uint32_t row_entry(uint32_t rows_lo, uint32_t rows_hi, int r) {
  return r < 128 ? rows_lo + 4 * r : rows_hi + 4 * (r - 128);
}

// K-tile i into the stage at `st` with its mbarrier `bar`: issuer 0 the four W units (bulk
// copies, their bytes announced on the mbarrier), every issuer its 16 B chunk c = itid % 8 of
// rows itid / 8 + j kIssuers / 8 (cp.async, zeros for padding rows and past K), then its arrival.
// The W issuer is the producer warpgroup's thread 0, or without one consumer thread 0.
template <int BITS, int MT, int CPS, typename T>
__device__ __forceinline__ void issue_tile(const GroupedParams& p, const uint32_t* packed, const uint8_t* absmax,
                                           int cg, int itid, int i, uint32_t st, uint32_t bar, uint32_t rows_lo,
                                           uint32_t rows_hi) {
  using G = GroupedCfg<BITS, MT, CPS>;
  using C = typename G::C;
  // the consumers' reads of the stage (LDS of W, wgmma of x) before the copies that refill it
  wg::fence_proxy_async();
  if (itid == 0) {
    wg::mbar_arrive_expect_tx(bar, G::kWBytes);
#pragma unroll
    for (int sl = 0; sl < C::kSlabsCta; ++sl) {
      bool ok;
      const long long unit = (long long)slab_unit<C::kSlabsCta>(p, cg, sl, &ok) * p.ku_count + i;
      const uint32_t wd = st + C::kXBytes + sl * C::kUnitBytes;
      wg::bulk_load(wd, packed + unit * unit_words(BITS), BITS * 512, bar);
      wg::bulk_load(wd + BITS * 512, absmax + unit * kUnitAbsmaxBytes, kUnitAbsmaxBytes, bar);
    }
  }
  const T* x = static_cast<const T*>(p.x);
  const int c = itid & 7, kk = i * kUnitK + 8 * c;
  constexpr int kRowStep = G::kIssuers / 8;
#pragma unroll
  for (int j = 0; j < MT / kRowStep; ++j) {
    const int r = (itid >> 3) + kRowStep * j;
    const int tok = int(lds_u32(row_entry(rows_lo, rows_hi, r)));
    const bool ok = tok >= 0 && kk < p.k;
    const T* src = ok ? x + (long long)tok * p.k + kk : x;
    cp_async16(st + r * 128 + ((c ^ (r & 7)) << 4), src, ok);
  }
  cp_async_arrive_noinc(bar);
}

// The producer warpgroup (one CTA per SM): gives its registers to the consumers, then streams
// K-tile i into stage i % kStages once the consumers have handed the stage back.
template <int BITS, int MT, int CPS, typename T, typename StageAddr>
__device__ __forceinline__ void produce_gathered(const GroupedParams& p, const uint32_t* packed, const uint8_t* absmax,
                                                 int cg, int ptid, uint32_t bar0, uint32_t empty0, uint32_t rows_lo,
                                                 uint32_t rows_hi, const StageAddr& stage_addr) {
  using C = typename GroupedCfg<BITS, MT, CPS>::C;
  asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
  for (int i = 0; i < p.ku_count; ++i) {
    const int sg = i % C::kStages;
    if (i >= C::kStages) mbar_wait(empty0 + 8 * sg, ((i / C::kStages) - 1) & 1);
    issue_tile<BITS, MT, CPS, T>(p, packed, absmax, cg, ptid, i, stage_addr(sg), bar0 + 8 * sg, rows_lo, rows_hi);
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its thread
}
#endif  // KBIT_WGMMA_DEVICE

// Grid (1, blocks of sorted ids, column groups): the blocks of one column group, consecutive
// in the sorted order and mostly of one expert, run next to each other and share its W in L2.
template <int BITS, int MT, int CPS, typename T>
__global__ void __launch_bounds__(GroupedCfg<BITS, MT, CPS>::C::kThreads, CPS)
    moe_grouped_kernel(const GroupedParams p) {
#if KBIT_WGMMA_DEVICE
  using G = GroupedCfg<BITS, MT, CPS>;
  using C = typename G::C;
  constexpr int kThreads = C::kConsumers, kSets = C::kSets;
  const int block = blockIdx.y, cg = blockIdx.z, m0 = block * MT;
  // sorted ids and expert ids past num_tokens_post_padded may be uninitialized: read neither
  if (m0 >= __ldg(p.num_tokens_post_padded)) return;
  const int e = __ldg(p.expert_ids + block);
  if (e < 0 || e >= p.num_experts) return;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw_addr = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw_addr + 1023u) & ~1023u;  // swizzle atoms need 1 KB alignment
  uint8_t* smem = smem_raw + (base - raw_addr);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // row split R = 2, as wgmma/kernel.cuh places the warps: warpgroup wgi takes row tiles 2 wgi
  // (+ 1) of each unit; in the tall CTA warp w multiplies row tile 2 wgi + qp of slab w & 1
  const int slab = C::kTall ? (warp & 1) : (warp & 3), wgi = warp >> 2;
  const int qp = C::kTall ? (warp >> 1) & 1 : 0, pr0 = 2 * wgi + qp;
  const int g = lane >> 2, t4 = lane & 3;
  const bool producer = tid >= kThreads;

  uint32_t lut_base = base + C::kLutOff;
  int n_low = C::kStages;
  if constexpr (C::kWideLut) {
    lut_base = (base + 0xFFFFu) & ~0xFFFFu;
    n_low = int(lut_base - base) / C::kStageBytes;
  }
  const auto stage_addr = [&](int sg) -> uint32_t {
    if constexpr (C::kWideLut)
      return sg < n_low ? base + sg * C::kStageBytes
                        : lut_base + PairTable<BITS>::kWideLutBytes + (sg - n_low) * C::kStageBytes;
    return base + C::kStageOff + sg * C::kStageBytes;
  };
  const uint32_t bar0 = base + (C::kWideLut ? C::kWideUsable : C::kBarOff);
  const uint32_t empty0 = bar0 + 8 * C::kStages;
  const uint32_t rows_lo = stage_addr(0) + G::kRowTableOff, rows_hi = stage_addr(1) + G::kRowTableOff;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(bar0 + 8 * s, G::kFullCount);
      if constexpr (C::kProducer) mbar_init(empty0 + 8 * s, kThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  for (int r = tid; r < MT; r += C::kThreads) {
    int tok = -1;
    if (m0 + r < p.num_sorted) {
      const int id = __ldg(p.sorted_ids + m0 + r);
      if (unsigned(id) < unsigned(p.num_pairs)) tok = id / p.top_k;
    }
    sts_s32(row_entry(rows_lo, rows_hi, r), tok);
  }
  const uint32_t* packed = p.packed + (long long)e * p.expert_words;
  const uint8_t* absmax = p.absmax + (long long)e * p.expert_bytes;
  __syncthreads();  // barriers initialised, row table written
  if constexpr (C::kProducer) {
    if (producer) {
      produce_gathered<BITS, MT, CPS, T>(p, packed, absmax, cg, tid - kThreads, bar0, empty0, rows_lo, rows_hi,
                                         stage_addr);
      return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  }

  float acc[kSets][MT / 2];
#pragma unroll
  for (int r = 0; r < kSets; ++r)
#pragma unroll
    for (int i = 0; i < MT / 2; ++i) acc[r][i] = 0.f;
  StreamParams q = {};
  q.codebook = p.codebook + (long long)e * p.codebook_stride;  // what consume reads of its params
  constexpr int CN = G::kColumns;
  const wg::CtaTile<BITS, MT, CN, 2, CPS> tl{
      smem, base, lut_base, n_low, bar0, empty0, tid, lane, warp, slab, wgi, qp, pr0, g, t4, 0, 1, 0, true, m0, 0,
      p.ku_count, false};
  // without a producer, consume issues K-tile i (i < nt) itself, from every consumer thread
  const auto issue = [&](int i) {
    if constexpr (!C::kProducer) {
      if (i < p.ku_count)
        issue_tile<BITS, MT, CPS, T>(p, packed, absmax, cg, tid, i, stage_addr(i % C::kStages),
                                     bar0 + 8 * (i % C::kStages), rows_lo, rows_hi);
    }
  };
  wg::consume<BITS, MT, CN, 2, CPS, T, true>(tl, q, stage_addr, issue, acc);

  // ---- epilogue: accumulators -> the fp32 tile [token row][CTA column] -> y rows
  wg::named_sync(1, kThreads);  // every consumer is done with the pipeline's shared memory
  float* tile = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int r = 0; r < kSets; ++r)
#pragma unroll
    for (int i = 0; i < MT / 2; ++i) {
      const int ei = i & 3, j = i >> 2;
      const int col = slab * kUnitN + 16 * (pr0 + r) + 8 * (ei >> 1) + g, row = 8 * j + 2 * t4 + (ei & 1);
      tile[row * G::kTileStride + col] = acc[r][i];
    }
  wg::named_sync(1, kThreads);
  const bool gated = is_gated(p.activation);
  const int out_cols = gated ? CN / 2 : CN;  // columns of y this CTA writes
  const int chunks = out_cols / 8, col_base = cg * out_cols;
  const bool vec = p.n_out % 8 == 0;
  T* y = static_cast<T*>(p.y);
  for (int idx = tid; idx < MT * chunks; idx += kThreads) {
    const int rr = idx / chunks, cc = idx - rr * chunks, col0 = col_base + 8 * cc;
    if (col0 >= p.n_out || m0 + rr >= p.num_sorted) continue;
    const int pair = __ldg(p.sorted_ids + m0 + rr);
    if (unsigned(pair) >= unsigned(p.num_pairs)) continue;  // padding
    const float w = p.topk_weights != nullptr ? __ldg(p.topk_weights + pair) : 1.f;
    const float* src = tile + rr * G::kTileStride + 8 * cc;
    float v[8];
    const float4 a0 = *reinterpret_cast<const float4*>(src), a1 = *reinterpret_cast<const float4*>(src + 4);
    v[0] = a0.x, v[1] = a0.y, v[2] = a0.z, v[3] = a0.w, v[4] = a1.x, v[5] = a1.y, v[6] = a1.z, v[7] = a1.w;
    if (gated) {
      const float4 b0 = *reinterpret_cast<const float4*>(src + CN / 2);
      const float4 b1 = *reinterpret_cast<const float4*>(src + CN / 2 + 4);
      const float u[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int c = 0; c < 8; ++c) v[c] = activate(p.activation, v[c]) * u[c];
    } else if (p.activation != int(Activation::kNone)) {
#pragma unroll
      for (int c = 0; c < 8; ++c) v[c] = activate(p.activation, v[c]);
    }
    T* dst = y + (long long)pair * p.n_out + col0;
    if (vec && col0 + 8 <= p.n_out) {
      uint4 o;
      o.x = pack2<T>(v[0] * w, v[1] * w);
      o.y = pack2<T>(v[2] * w, v[3] * w);
      o.z = pack2<T>(v[4] * w, v[5] * w);
      o.w = pack2<T>(v[6] * w, v[7] * w);
      *reinterpret_cast<uint4*>(dst) = o;
    } else {
#pragma unroll
      for (int c = 0; c < 8; ++c)
        if (col0 + c < p.n_out) dst[c] = from_float<T>(v[c] * w);
    }
  }
#else
  __trap();  // not sm_90a code: the host never launches this (moe_grouped_supported)
#endif
}

// Launch of one instantiation: `blocks` blocks of sorted ids x `column_groups` CTAs (the first
// call opts the kernel into its shared memory).
template <int BITS, int MT, int CPS, typename T>
cudaError_t launch_grouped(const GroupedParams& p, int blocks, int column_groups, cudaStream_t stream) {
  using C = typename GroupedCfg<BITS, MT, CPS>::C;
  const auto kernel = moe_grouped_kernel<BITS, MT, CPS, T>;
  static const cudaError_t opt_in = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kBytes);
  if (opt_in != cudaSuccess) return opt_in;
  kernel<<<dim3(1, blocks, column_groups), C::kThreads, C::kBytes, stream>>>(p);
  return cudaGetLastError();
}

// The selector's entry of one instantiation (moe_grouped_kernels.h, generated).
template <int BITS, int MT, int CPS, typename T>
constexpr MoeGroupedKernel kernel_entry() {
  return {&launch_grouped<BITS, MT, CPS, T>, MT};
}

}  // namespace moe
}  // namespace kbit
