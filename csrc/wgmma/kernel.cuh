// kbit GEMM on Hopper's asynchronous tensor-core instruction (wgmma, sm_90a) for mid-size M:
// y[M, N] = x[M, K] @ dequant(W)^T, torch-free. Instantiated per bit width in
// wgmma/instantiations/wgmma_k<BITS>.cu; dispatch/wgmma_plan.h holds the plan, which this file
// feeds with each instantiation's occupancy. docs/DESIGN.md describes the design.
//
// Compute Y^T = W X^T with the dequantized W as wgmma's register-sourced A operand and x^T as
// the shared-memory B operand. Then the weights never round-trip through shared memory after
// decode, the tokens are the wgmma N dimension (16..256 per CTA), and the instruction is
// asynchronous: the tensor cores multiply one 32-block while the warps decode the next.
//   * a warpgroup (4 warps): warp w owns the 64-column slab w of the CTA's slabs, i.e.
//     exactly the lane-local fragments of core/layout.cuh (no data crosses lanes or warps).
//     A wgmma m64 tile takes rows 16w..16w+15 from warp w, so row tile `pr` of the four warps'
//     units forms one m64 (rows permuted across slabs; the epilogue maps them back): four
//     accumulator sets of 64 x MT per warpgroup, 256 columns x MT tokens, 2 MT fp32 / thread
//     (with a row split R = 2: two sets, MT fp32 / thread).
//     CTA = one warpgroup (256 columns); or two sharing one x tile (512 columns, half the x
//     traffic per weight; only when forced, plan_wgmma); or two that split each unit's row tiles
//     between them (row split R = 2: at MT = 128 so that the accumulators fit, at MT = 64 and
//     short-K MT = 32 for 16 warps per SM). At MT = 256 (the tall CTA, Cfg::kTall, where
//     choose_tall takes it) 128 columns: each warp multiplies one row tile of its plane words at
//     n = 256, so each weight is decoded once per 256 tokens.
//   * per 32-block: decode (core/decode.cuh: the GEMV's pair tables, codebook pre-multiplied
//     by the E4M4 constant, then one HMUL2 by the block's scale) -> 8 wgmma (4 row tiles x
//     2 k16 steps) into two alternating A buffers: block b+1 decodes while block b multiplies
//     (wgmma.wait_group 1).
//   * x is used as stored: the decoder's pairs come in a permuted k order (core/decode.cuh), and
//     one PRMT per A register regroups them into natural k, so x goes to shared memory as
//     stored, by TMA (a 2-D tensor map of x, box MT rows x 64 k) straight into the 128 B
//     swizzle wgmma's descriptor describes, in the same stage as W (bulk copies of the CTA's
//     units, one per slab's warp). The bytes and 1 + slabs arrivals complete the stage's
//     mbarrier. TMA, not cp.async by every thread: the SMs' L2 -> shared memory rate was what
//     bound the loads.
//   * each lane reads back only its own 16 B per plane of its warp's unit (conflict-free LDS.128).
//   * per K-tile: every thread waits for the stage's mbarrier, then one __syncthreads (every
//     warp is past the previous tile, so the stage two tiles back may be refilled). Where one
//     CTA holds the SM (MT = 128, and MT = 64 where one_per_sm takes it), a producer warpgroup
//     issues the copies instead and the consumers hand stages back through per-stage "empty"
//     mbarriers: no CTA barrier in the loop (Cfg::kProducer). K=3,4 use the wide-row pair
//     table wherever one CTA holds the SM (Cfg::kWideLut; also the forced 512-column CTAs).
//   * an unsplit call's y leaves through shared memory: stmatrix writes each slab's tile
//     transposed into the 128 B swizzle and one TMA store a slab writes whole lines (N % 8 == 0;
//     else element by element).
//   * split-K across a thread-block cluster (<= 16 CTAs along K), reduced through distributed
//     shared memory in a fixed order: deterministic, no workspace, one launch (graph safe); where
//     the clusters that would fill the SMs do not fit, over several clusters whose sums meet in
//     a global workspace, added in a fixed order too (choose_groups).
//
// Files, each including the one before: config.cuh (Cfg: shared memory, stages, threads), ptx.cuh
// (PTX wrappers), decode.cuh (A fragments), mainloop.cuh (produce / consume), epilogue.cuh
// (store_tile_scalar, reduce_split), this file (the kernel body), launch.cuh (occupancy, tensor
// maps, the launch of one instantiation).
#pragma once
#include "wgmma/epilogue.cuh"

namespace kbit {
namespace wg {

// kSplitTall: the tall CTA's split-K build (Cfg::kTall only). A separate instantiation, so the
// split epilogue's registers do not cost the unsplit tall kernel's main loop.
// Roles: with Cfg::kProducer the last warpgroup only loads (produce) and the others decode and
// multiply (consume); without it every warpgroup does both, issuing its own loads. The consumers
// then run one epilogue: the TMA store or store_tile_scalar (unsplit), or reduce_split (split-K).
template <int BITS, int MT, int CN, int R, int CPS, typename T, bool kSplitTall = false>
__global__ void __launch_bounds__(Cfg<BITS, MT, CN, R, CPS>::kThreads, CPS)
    wgmma_kernel(const Params p, const __grid_constant__ CUtensorMap xmap, const __grid_constant__ CUtensorMap ymap) {
#if KBIT_WGMMA_DEVICE
  using C = Cfg<BITS, MT, CN, R, CPS>;
  constexpr int kThreads = C::kConsumers, kSets = C::kSets;  // threads that hold accumulators
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw_addr = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw_addr + 1023u) & ~1023u;  // swizzle atoms need 1 KB alignment
  uint8_t* smem = smem_raw + (base - raw_addr);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // wgmma takes rows 16 (warp % 4) + ... from this warp; a row split's warpgroups share slabs
  const int slab = C::kTall ? (warp & 1) : R > 1 ? (warp & 3) : warp, wg = warp >> 2;
  const int qp = C::kTall ? (warp >> 1) & 1 : 0;  // the tall CTA: which row tile of its words h = wg
  const int pr0 = R > 1 ? 2 * wg + qp : 0;  // this warp's first row tile (of 4 per unit)
  const int g = lane >> 2, t4 = lane & 3;
  const int split = blockIdx.x, splits = gridDim.x;
  const int nu = col_group() * C::kSlabsCta + slab;
  const bool slab_ok = nu < n_units(p.n);
  const int m0 = token_tile() * MT;
  const int ku_begin = split * p.chunk;
  const int nt = max(0, min(p.ku_count, ku_begin + p.chunk) - ku_begin);
  const bool producer = C::kProducer && tid >= kThreads;  // the last warpgroup (kProducer)

  // stage s's address (x tile, then W); with the wide table, stages below and above it
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
  // one "full" mbarrier per stage: a phase completes with kBarCount arrivals (each announcing
  // its bytes) and those bytes landed; with a producer, one "empty" mbarrier per stage after
  // them (a phase: every consumer thread is done reading the stage)
  const uint32_t bar0 = base + (C::kWideLut ? C::kWideUsable : C::kBarOff);
  const uint32_t empty0 = bar0 + 8 * C::kStages;  // kProducer: stage s is free again
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < C::kStages; ++s) mbar_init(bar0 + 8 * s, C::kBarCount);
    if constexpr (C::kProducer)
      for (int s = 0; s < C::kStages; ++s) mbar_init(empty0 + 8 * s, kThreads);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&xmap)) : "memory");
    if (p.y_tma) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&ymap)) : "memory");
  }
  wait_prior_grids();  // programmatic dependent launch (core/common.cuh): x may be the previous kernel's output

  // Without a producer, K-tile i -> stage i % kStages: thread 0 loads x rows m0.. as stored,
  // zeros past M and K (TMA); lane 0 of each slab's warp its unit.
  // The warps that load W, one slab each: with warpgroups on shared slabs (R > 1) the last
  // one, so that the first (whose thread 0 issues x) does not also carry W's issue work.
  const bool w_loader = R == 1 || wg == R - 1;
  // slab sl's unit of K-tile ku into stage st (a slab past N copies unit 0: read, never used)
  const auto load_unit = [&](uint32_t st, int sl, int ku, uint32_t bar) {
    const int n_unit = col_group() * C::kSlabsCta + sl;
    const long long unit = (long long)(n_unit < n_units(p.n) ? n_unit : 0) * p.ku_count + ku;
    const uint32_t wd = st + C::kXBytes + sl * C::kUnitBytes;
    bulk_load(wd, p.packed + unit * unit_words(BITS), BITS * 512, bar);
    bulk_load(wd + BITS * 512, p.absmax + unit * kUnitAbsmaxBytes, kUnitAbsmaxBytes, bar);
  };
  const auto issue = [&](int i) {
    if (i >= nt) return;
    const int ku = ku_begin + i;
    const uint32_t st = stage_addr(i % C::kStages);
    const uint32_t bar = bar0 + 8 * (i % C::kStages);
    const bool w_issuer = w_loader && lane == 0;
    // the stage's previous generic-proxy reads (LDS of W) are ordered before the async writes
    if (tid == 0 || w_issuer) fence_proxy_async();
    if (tid == 0) {
      mbar_arrive_expect_tx(bar, C::kXBytes);
      tma_load_2d(st, &xmap, ku * kUnitK, m0, bar);
    }
    if (w_issuer) {
      mbar_arrive_expect_tx(bar, C::kUnitBytes);
      load_unit(st, slab, ku, bar);
    }
  };
  const CtaTile<BITS, MT, CN, R, CPS> tl{smem, base, lut_base, n_low, bar0, empty0, tid, lane, warp, slab, wg, qp, pr0, g,
                                         t4, split, splits, nu, slab_ok, m0, ku_begin, nt, producer};

  __syncthreads();  // the barriers are initialised before anyone arrives or waits on them
  if constexpr (C::kProducer) {
    if (producer) {
      produce(tl, xmap, stage_addr, load_unit);
      return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  }
  // (after the producer's branch: its 40 registers hold no accumulators)
  float acc[kSets][MT / 2];
#pragma unroll
  for (int r = 0; r < kSets; ++r)
#pragma unroll
    for (int i = 0; i < MT / 2; ++i) acc[r][i] = 0.f;
  consume<BITS, MT, CN, R, CPS, T>(tl, p, stage_addr, issue, acc);

  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  if (splits == 1) {
    if (p.y_tma) {
      // Through shared memory: each slab's [MT tokens][64 columns] tile in the 128 B swizzle
      // (16-byte chunk c of token row t at chunk c ^ (t % 8): the eight rows of one stmatrix
      // fragment hit eight different bank groups), then one TMA store per slab writes whole
      // lines, clipped at M and N by the tensor map. The scalar store below recomputes each
      // element's column and row and writes 2 bytes.
      constexpr int kBox = MT * 128;
      static_assert(C::kSlabsCta * kBox <= (C::kWideLut ? C::kWideUsable : C::kBarOff),
                    "the y tiles fit below the mbarriers");
      // this thread's columns nu * 64 + 16 pr + 8 h + g (h = 0, 1): their bias, loaded before the
      // barrier (after it, each stmatrix's memory clobber would serialise the loads)
      float bv[kSets][2];
#pragma unroll
      for (int r = 0; r < kSets; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = nu * kUnitN + 16 * (pr0 + r) + 8 * h + g;
          bv[r][h] = bias != nullptr && col < p.n ? to_float(bias[col]) : 0.f;
        }
      named_sync(1, kThreads);  // every consumer is done with the pipeline's shared memory
      const uint32_t box = base + slab * kBox;
      const int q = lane >> 3, i8 = lane & 7;  // this lane addresses row i8 of fragment q
#pragma unroll
      for (int r = 0; r < kSets; ++r) {
        const int pr = pr0 + r;
        // fragment q = (h = q & 1, token group j = 2 jj + (q >> 1)); chunk 2 pr + h of its rows
        const uint32_t row_addr = box + (8 * (q >> 1) + i8) * 128 + (((2 * pr + (q & 1)) ^ i8) << 4);
#pragma unroll
        for (int jj = 0; jj < MT / 16; ++jj) {
          uint32_t v[4];
#pragma unroll
          for (int f = 0; f < 4; ++f) {
            const int h = f & 1, i = 4 * (2 * jj + (f >> 1)) + 2 * h;
            v[f] = pack2<T>(acc[r][i] + bv[r][h], acc[r][i + 1] + bv[r][h]);
          }
          stmatrix_x4_trans(row_addr + jj * 16 * 128, v[0], v[1], v[2], v[3]);
        }
      }
      fence_proxy_async();  // the generic-proxy writes before the TMA unit reads them
      named_sync(1, kThreads);
      if (tid == 0) {
#pragma unroll
        for (int sl = 0; sl < C::kSlabsCta; ++sl) {
          const int c = (col_group() * C::kSlabsCta + sl) * kUnitN;
          if (c < p.n) tma_store_2d(&ymap, base + sl * kBox, c, m0);
        }
        tma_store_drain();
      }
      return;
    }
    store_tile_scalar<BITS, MT, CN, R, CPS, T>(tl, p, bias, y, acc);
    return;
  }
  // (the tall CTA splits K in one cluster only, in its kSplitTall build: plan_wgmma keeps 128-token
  // tiles under forced cluster groups)
  static_assert(!kSplitTall || C::kTall, "kSplitTall: the tall CTA's split build only");
  if constexpr (C::kTall && !kSplitTall) __trap();  // unreachable: a split tall plan names kSplitTall
  reduce_split<BITS, MT, CN, R, CPS, T>(tl, p, acc);
#else
  __trap();  // not sm_90a code: the host never launches this (wgmma_supported)
#endif
}

}  // namespace wg
}  // namespace kbit
