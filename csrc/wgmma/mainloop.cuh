// The wgmma kernel's main loop: the CTA's place and shared-memory regions (CtaTile), the
// producer warpgroup's copies (produce) and the consumer warpgroups' decode + wgmma loop
// (consume).
#pragma once
#include "wgmma/decode.cuh"

namespace kbit {
namespace wg {

#if KBIT_WGMMA_DEVICE
// The kernel's stages. wgmma_kernel (below) sets up the CTA (its addresses, mbarriers and the
// load lambdas stage_addr / load_unit / issue, which the stages share), then dispatches by role:
//   produce       the producer warpgroup's loop (Cfg::kProducer): TMA of x and W tiles;
//   consume       the consumer warpgroups' main loop: decode + wgmma into the accumulators
//                 (without a producer it also issues the loads, through `issue`);
//   store_tile_scalar / the TMA store in the kernel body: the unsplit epilogue;
//   reduce_split  the split-K epilogue (cluster reduction, cluster groups).
// Each stage is __forceinline__ and takes what it reads as parameters, so the compiled kernel is
// the one a single function body gives. The unsplit TMA store stays in the kernel body and the
// load lambdas are the kernel's own: as functions they change the generated code.

// One CTA's place in the grid and one thread's role in it, and the addresses of the CTA's
// shared-memory regions: what the stages read, the kernel's values as it computes them at its
// top (the fields carry the names of the kernel's locals).
template <int BITS, int MT, int CN, int R, int CPS> struct CtaTile {
  using C = Cfg<BITS, MT, CN, R, CPS>;
  uint8_t* smem;      // the 1 KB-aligned start of dynamic shared memory
  uint32_t base;      // its shared-state-space address
  uint32_t lut_base;  // the pair table
  int n_low;          // with the wide table: the stages below it
  uint32_t bar0;      // stage s's "full" mbarrier at bar0 + 8 s
  uint32_t empty0;    // kProducer: stage s's "empty" mbarrier at empty0 + 8 s
  int tid, lane, warp, slab, wg, qp, pr0, g, t4;
  int split, splits, nu;
  bool slab_ok;
  int m0, ku_begin, nt;
  bool producer;
};

// The producer warpgroup (Cfg::kProducer: one CTA per SM). It gives its registers to the
// consumers, then one thread streams every K-tile into stage i % kStages once the consumers have
// handed that stage back: the x box and each slab's unit, one mbarrier arrival announcing all
// their bytes. Split-K: it joins the consumers' epilogue barriers (reduce_split), then leaves.
template <int BITS, int MT, int CN, int R, int CPS, typename StageAddr, typename LoadUnit>
__device__ __forceinline__ void produce(const CtaTile<BITS, MT, CN, R, CPS>& tl, const CUtensorMap& xmap,
                                        const StageAddr& stage_addr, const LoadUnit& load_unit) {
  using C = Cfg<BITS, MT, CN, R, CPS>;
  constexpr int kThreads = C::kConsumers;
  asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
  if (tl.tid == kThreads) {
    for (int i = 0; i < tl.nt; ++i) {
      const int sg = i % C::kStages, ku = tl.ku_begin + i;
      if (i >= C::kStages) mbar_wait(tl.empty0 + 8 * sg, ((i / C::kStages) - 1) & 1);
      const uint32_t st = stage_addr(sg), bar = tl.bar0 + 8 * sg;
      fence_proxy_async();
      mbar_arrive_expect_tx(bar, C::kXBytes + C::kSlabsCta * C::kUnitBytes);
      tma_load_2d(st, &xmap, ku * kUnitK, tl.m0, bar);
#pragma unroll
      for (int sl = 0; sl < C::kSlabsCta; ++sl) load_unit(st, sl, ku, bar);
    }
  }
  if (tl.splits > 1) {  // the consumers' epilogue barriers (reduce_split)
    __syncthreads();
    cooperative_groups::this_cluster().sync();
    cooperative_groups::this_cluster().sync();
  }
}

// The consumer warpgroups' main loop over the CTA's K range: per K-tile, wait for its stage
// (and, without a producer, refill the stage two tiles back), read this lane's plane words and
// absmax codes, then per 32-block decode into one of two A buffers and issue its wgmma while the
// other buffer's group is still in flight. Returns with every wgmma retired into acc.
// kGatheredX: x reaches the stages through cp.async (the MoE kernel's gathered rows,
// moe/grouped_kernel.cuh), writes of the generic proxy, which the wgmmas read through the
// async proxy: each thread fences between the stage's completion and its wgmmas.
template <int BITS, int MT, int CN, int R, int CPS, typename T, bool kGatheredX = false, typename StageAddr,
          typename Issue>
__device__ __forceinline__ void consume(const CtaTile<BITS, MT, CN, R, CPS>& tl, const Params& p,
                                        const StageAddr& stage_addr, const Issue& issue,
                                        float (&acc)[Cfg<BITS, MT, CN, R, CPS>::kSets][MT / 2]) {
  using C = Cfg<BITS, MT, CN, R, CPS>;
  constexpr int kThreads = C::kConsumers, kSets = C::kSets;
  const int lane = tl.lane, g = tl.g, wg = tl.wg, slab = tl.slab, nt = tl.nt;
  if constexpr (!C::kProducer) {
#pragma unroll
    for (int i = 0; i < C::kLead; ++i) issue(i);
  }
  // (published by the first iteration's __syncthreads; with a producer, by a barrier of the
  // consumers alone, so that the producer's first copies need not wait for the table)
  const uint32_t table = init_codebook<BITS, T, C::kWideLut>(
      p.codebook, codebook_mult<T>(), reinterpret_cast<uint32_t*>(tl.smem + (tl.lut_base - tl.base)), tl.tid, kThreads);
  if constexpr (C::kProducer) named_sync(1, kThreads);
  // the lane's replica, or with wide rows the PRMT key (Decoder::pair)
  const uint32_t lut_addr = opaque(C::kWideLut ? (tl.lut_base & 0xFFFF0000u) | (4u * lane)
                                               : tl.lut_base + 4u * (lane % kLutReplicas));

  // two A buffers: block b+1 decodes while block b multiplies (no spills: <= 255 registers, or
  // <= 128 for two 256-thread CTAs per SM, where K=5 at MT = 64 uses all 128 under CUDA 13)
  uint32_t A[2][kSets][2][4];
  for (int t = 0; t < nt; ++t) {
    stage_wait(tl.bar0 + 8 * (t % C::kStages), (t / C::kStages) & 1);  // x and W of tile t have landed
    if constexpr (kGatheredX) fence_proxy_async();
    if constexpr (!C::kProducer) {
      // every warp is past iteration t - 1, whose wgmma.wait retired tile t - 2's reads: its
      // stage may be refilled
      __syncthreads();
      issue(t + C::kLead);  // into tile t - 2's stage
    }
    // this lane's plane words and absmax codes of the unit: words w = 2 kb + h
    const uint32_t xt = stage_addr(t % C::kStages);
    const uint32_t wst = xt + C::kXBytes + slab * C::kUnitBytes;
    uint32_t pw[2][C::kHalves][BITS], codes[2][C::kHalves];
    if constexpr (R == 1) {
      uint4 w[BITS];
#pragma unroll
      for (int b = 0; b < BITS; ++b) w[b] = lds_v4(wst + b * 512 + lane * 16);
      const uint4 a = lds_v4(wst + BITS * 512 + g * 16);
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
#pragma unroll
        for (int b = 0; b < BITS; ++b) pw[wi >> 1][wi & 1][b] = comp(w[b], wi);
        codes[wi >> 1][wi & 1] = comp(a, wi);
      }
    } else {  // warpgroup wg reads only its words h = wg
      const int h = wg;
#pragma unroll
      for (int kb = 0; kb < 2; ++kb) {
#pragma unroll
        for (int b = 0; b < BITS; ++b) pw[kb][0][b] = lds_u32(wst + b * 512 + lane * 16 + (2 * kb + h) * 4);
        codes[kb][0] = lds_u32(wst + BITS * 512 + g * 16 + (2 * kb + h) * 4);
      }
    }
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) {
      uint32_t(&Ab)[kSets][2][4] = A[kb];
      if constexpr (C::kTall) {
        decode_word<BITS, T, C::kWideLut, true>(pw[kb][0], codes[kb][0], Ab, lut_addr, table, tl.qp);
      } else {
#pragma unroll
        for (int hh = 0; hh < C::kHalves; ++hh)
          decode_word<BITS, T, C::kWideLut>(pw[kb][hh], codes[kb][hh],
                                            *reinterpret_cast<uint32_t(*)[2][2][4]>(&Ab[2 * hh]), lut_addr, table);
      }
#pragma unroll
      for (int r = 0; r < kSets; ++r) fence_regs(acc[r]);
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int r = 0; r < kSets; ++r) {
          wgmma_rs<MT, T>(acc[r], Ab[r][s], smem_desc(xt + (2 * kb + s) * 32));
        }
      wgmma_commit();
#pragma unroll
      for (int r = 0; r < kSets; ++r) fence_regs(acc[r]);
      wgmma_wait<1>();  // the other buffer's group is done: it may be overwritten next
#pragma unroll
      for (int r = 0; r < kSets; ++r)
#pragma unroll
        for (int s = 0; s < 2; ++s) fence_regs(Ab[r][s]);
      if constexpr (C::kProducer) {
        // that group was tile t - 1's last: this thread is done with its stage. Every thread
        // arrives, since an arrive releases only its own thread's reads (LDS of W); one lane per
        // warp after a __syncwarp was 2-3% slower and racecheck reported the hand-off (WAR
        // against the next bulk copy into the stage)
        if (kb == 0 && t > 0) mbar_arrive(tl.empty0 + 8 * ((t - 1) % C::kStages));
      }
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int r = 0; r < kSets; ++r) fence_regs(acc[r]);
}
#endif  // KBIT_WGMMA_DEVICE

}  // namespace wg
}  // namespace kbit
