// The wgmma kernel's build-time configuration (the FlashAttention-3 "kernel traits" layer): what
// each instantiation (bit width, tokens MT, columns CN, row split R, CTAs per SM CPS) lays out in
// shared memory, how deep its pipeline is, how many threads it runs; the grid's axes and the
// kernel's arguments. The kernel files above it (ptx, decode, mainloop, epilogue, kernel,
// launch) read it; kernel.cuh describes the design.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda.h>  // CUtensorMap and its enums (the encoder is fetched from the driver at run time)
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <type_traits>
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#include <cooperative_groups.h>
#endif

#include "core/common.cuh"
#include "core/decode.cuh"
#include "core/layout.cuh"
#include "wgmma/wgmma_config.h"

// wgmma exists only in arch-specific sm_90a code; every other target compiles a trap body and
// the host never launches it there (wgmma_supported in wgmma_launch.cu).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KBIT_WGMMA_DEVICE 1
#else
#define KBIT_WGMMA_DEVICE 0
#endif

namespace kbit {
namespace wg {

constexpr int kSlabs = 4;               // one 64-column layout slab per warp of a warpgroup
// Grid (splits, token tiles, column groups): the token tiles of one column group are launched
// next to each other, so the W they share is read from DRAM once and from L2 after.
__device__ __forceinline__ int token_tile() { return blockIdx.y; }
__device__ __forceinline__ int col_group() { return blockIdx.z; }

using Params = StreamParams;  // core/common.cuh

// Row split R of a 256-column CTA: R warpgroups share its four slabs; with R = 2 warpgroup wg
// takes row tiles 2 wg and 2 wg + 1 of every unit (the lane's plane words h = wg). Each weight
// is still decoded once per CTA; what changes is how many warps share the decode (16 per SM
// instead of 8 where two CTAs fit an SM) and how many accumulators a thread holds (4 / R sets
// of MT / 2). The plan (plan_wgmma) picks R; measurements there.
// MT tokens x CN columns per CTA, row split R, CPS CTAs per SM (the residency the CTA is built
// for: its registers, shared memory, and whether a producer warpgroup and the wide table come
// with it; one_per_sm picks between 2 and 1 at MT = 64).
template <int BITS, int MT, int CN, int R, int CPS> struct Cfg {
  static_assert(MT == 16 || MT == 32 || MT == 64 || MT == 128 || MT == 256,
                "wgmma N (tokens per CTA): 16, 32, 64, 128 or 256");
  static_assert(CN == 256 || (CN == 512 && MT <= 64) || (CN == 128 && MT == 256),
                "256 columns, 512 (two warpgroups) up to 64 tokens, or 128 at 256 tokens");
  static_assert(R == 1 || R == 2, "row split: 1 or 2 warpgroups per slab set");
  static_assert(R == 1 || CN == 256 || CN == 128, "a row split shares the slabs of a 256- or 128-column CTA");
  // The tall CTA (MT = 256): 128 columns x 256 tokens, two consumer warpgroups of one m64n256
  // accumulator set each (128 fp32 a thread, as at MT = 128): warp w of warpgroup wg multiplies
  // row tile 2 wg + (w >> 1) of slab w & 1, so each decoded weight feeds 256 tokens instead of
  // 128 (half the decode per MMA) for twice the x bytes per K-tile. Split-K in one cluster only
  // (no cluster groups, plan_wgmma).
  static constexpr bool kTall = MT == 256;
  static_assert(!kTall || (CN == 128 && R == 2 && CPS == 1), "the tall CTA: 128 columns, two warpgroups, one per SM");
  static_assert(!(R == 1 && MT == 128), "128 x 64 fp32 accumulators per thread do not fit the registers");
  static_assert(CPS == 1 || default_ctas_per_sm(MT, CN, R) == 2, "two CTAs per SM only where their accumulators fit");
  static_assert(CPS == 2 || !(R == 1 && CN == 256), "256 columns without a row split: two CTAs per SM");
  // CN = 512 (R = 1): two warpgroups of four slabs each share one x tile (half the x traffic
  // per weight).
  static constexpr int kSlabsCta = CN / kUnitN;             // slabs (64 columns) per CTA
  static constexpr int kWG = R > 1 ? R : kSlabsCta / kSlabs;
  static constexpr int kConsumers = 128 * kWG;              // the warpgroups that decode and multiply
  static constexpr int kSets = kTall ? 1 : 4 / R;           // accumulator sets (row tiles) per thread
  static constexpr int kHalves = R == 1 ? 2 : 1;            // plane words h a warp decodes per block
  // CTAs per SM the kernel is built for (__launch_bounds__): two where they fit (R = 2 at
  // MT <= 64: 64 accumulators in <= 128 registers, so 16 warps per SM), or one with the producer
  // and the wide table below (MT = 128, 512 columns, and MT = 64 where one_per_sm takes it)
  static constexpr int kCtasPerSm = CPS;
  // A producer warpgroup (one thread of it) issues every copy and the consumers hand stages
  // back through "empty" mbarriers, so no CTA-wide barrier sits in the loop. Registers are
  // allocated per warpgroup, so it is a whole one, which gives its registers to the consumers
  // (setmaxnreg: 128 x 40 + 256 x 232 <= 64 K; the launch takes 168 a thread, the consumers'
  // code after the raise uses up to 187); only where one CTA holds the SM, and not in 512-column
  // CTAs (forced only): the copies of eight slabs spill out of the producer's 40 registers.
  static constexpr bool kProducer = kCtasPerSm == 1 && CN <= 256;
  static constexpr int kThreads = kConsumers + (kProducer ? 128 : 0);
  static constexpr int kUnitBytes = BITS * 512 + kUnitAbsmaxBytes;  // one layout unit
  static constexpr int kXBytes = MT * 128;    // MT rows x 64 k x 2 B; a multiple of the 1 KB swizzle atom
  static constexpr int kWBytes = kSlabsCta * kUnitBytes;    // one K-tile of W (the slabs' units)
  static constexpr int kStageBytes = kXBytes + (kWBytes + 1023) / 1024 * 1024;  // x tile, then W (1 KB steps)
  static constexpr int kLutOff = 0;
  // Wide-row pair table (K=3,4, one CTA per SM; core/decode.cuh PairTable::kWideLutBytes): at
  // the first 64 KB-aligned address of the CTA's window, so one PRMT forms a lookup address
  // (the GEMV's scheme). Stages then fill the space below it and above it; barriers sit at
  // kWideUsable. Whatever the window's start, that leaves at least kWideFit stages.
  static constexpr bool kWideLut = PairTable<BITS>::kLutEntries > 0 && kCtasPerSm == 1 && kLutReplicas == 32;
  static constexpr int kWideBytes = 232448;                      // the 227 KB opt-in maximum
  static constexpr int kWideUsable = kWideBytes - 2048;           // from the 1 KB-aligned base
  static constexpr int kWideFit = (kWideUsable - PairTable<BITS>::kWideLutBytes) / kStageBytes - 1;
  static constexpr int kStageOff = PairTable<BITS>::kLutBytes;  // a multiple of 1 KB (4 kLutReplicas B per entry)
  // Stages: as deep as fits next to the table in half an SM's shared memory (two CTAs per SM)
  // or a whole SM's (one), capped at 8. Tile t's stage
  // is refilled with tile t + kStages at iteration t + 2 (the wgmmas of tile t may still read
  // its x during iteration t + 1), so kStages - 2 K-tiles are in flight from DRAM (W) and L2 (x).
  static constexpr int kBudget = (kCtasPerSm == 2 ? 110 : 220) * 1024;
  static constexpr int kFit = kWideLut ? kWideFit : (kBudget - kStageOff) / kStageBytes;
  static constexpr int kStages = kFit > 8 ? 8 : kFit;
  static constexpr int kLead = kStages - 2;                 // K-tiles issued ahead of the one computed
  static constexpr int kPipeBytes = kStageOff + kStages * kStageBytes;
  static constexpr int kAcc = kSets * MT / 2;               // fp32 accumulators per thread
  static constexpr int kRedBytes = kAcc * kConsumers * 4;   // split-K partials, over the drained pipeline
  // arrivals per phase: the producer; else x's issuer and each slab's W issuer
  static constexpr int kBarCount = kProducer ? 1 : 1 + kSlabsCta;
  static constexpr int kBarOff = kPipeBytes > kRedBytes ? kPipeBytes : kRedBytes;  // one mbarrier per stage
  static constexpr int kBytes = kWideLut ? kWideBytes : kBarOff + 8 * kStages * (kProducer ? 2 : 1) + 1024;  // full (+ empty), + alignment
  static_assert(kXBytes % 1024 == 0 && kStageBytes % 1024 == 0 && kStageOff % 1024 == 0,
                "every stage's x tile starts on a 1 KB swizzle atom");
  static_assert(kUnitBytes % 16 == 0 && (BITS * 512) % 16 == 0, "bulk copies move 16 B multiples");
  static_assert(kXBytes + kSlabsCta * kUnitBytes < (1 << 20), "a stage's bytes fit the mbarrier's tx count");
  static_assert(kStages >= 3, "tile t + kStages - 2 is issued while tile t is computed");
  static_assert(kBytes <= 227 * 1024, "fits one SM's shared memory");
  static_assert(!kWideLut || (kRedBytes <= kWideUsable && kWideFit >= 3), "the wide table leaves room for the pipeline");
  static_assert(!kWideLut || kStages <= kWideFit, "stages beside the wide table");
};

}  // namespace wg
}  // namespace kbit
