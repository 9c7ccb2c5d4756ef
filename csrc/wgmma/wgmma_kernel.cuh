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
#include "dispatch/launchers.h"
#include "dispatch/wgmma_plan.h"

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

// ----------------------------------------------------------------------------- PTX helpers

__device__ __forceinline__ uint4 lds_v4(uint32_t addr) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
  return r;
}
// Orders this thread's earlier generic-proxy accesses of shared memory before later async-proxy
// ones: the LDS of W words in a stage before the TMA / bulk writes that refill it, and the
// unsplit epilogue's stmatrix writes of y before the TMA store that reads them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Shared-memory matrix descriptor of a K-major tile with 128-byte rows in the 128 B swizzle:
// start address >> 4, leading byte offset 16 B (unused by swizzled K-major), stride byte
// offset 1024 B (between 8-row core-matrix groups), layout type 1 = SWIZZLE_128B. A k16 step
// inside the 64-wide tile is +32 B on the start address (the hardware applies the XOR).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

#if KBIT_WGMMA_DEVICE
// The stage's mbarrier expects `bytes` more (the copies below complete them) besides the one
// arrival of the issuing thread.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Named barrier `id` (0 is __syncthreads) of `count` threads: the consumer warpgroups alone,
// without the producer warpgroup.
__device__ __forceinline__ void named_sync(uint32_t id, uint32_t count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// The same barrier, returning whether any of the `count` threads passed `pred` (a broadcast
// without shared memory: the wide-table CTAs use all 227 KB of it).
__device__ __forceinline__ bool named_sync_or(uint32_t id, uint32_t count, bool pred) {
  uint32_t r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r) : "r"(uint32_t(pred)), "r"(id), "r"(count) : "memory");
  return r != 0;
}
// TMA: box (64 k, MT rows) of x at (k, row) -> the swizzled tile at `dst`; rows past M and k past
// K arrive as zeros (the tensor map's bounds), so no predication and no padding of x.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int k, int row, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(bar)
      : "memory");
}
// Contiguous global -> shared copy by the TMA unit (16 B multiples): a unit's planes, its absmax.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// Four 8x8 b16 fragments (an mma C fragment's layout: lane l holds row l / 4, columns 2 (l % 4)
// and + 1 of each) stored transposed: row i of matrix q goes to the 16 bytes at the address lane
// 8 q + i gives, holding the fragment's column i. So accumulators whose rows are y's columns
// land as 16-byte runs of y's row, ready for a TMA store; one instruction instead of eight
// scalar stores, and no index arithmetic per element.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
// TMA: the swizzled box at `src` -> y at (column, row); parts past the tensor map's bounds (rows
// past M, columns past N) are not written. Completion is tracked per thread (bulk groups).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int col, int row) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(col), "r"(row), "r"(src)
               : "memory");
}
// The issuing thread's bulk stores have read their shared memory (the CTA may exit: the global
// writes complete with the grid).
__device__ __forceinline__ void tma_store_drain() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// The stage's mbarrier phase `parity` has completed.
__device__ __forceinline__ void stage_wait(uint32_t bar, uint32_t parity) {
  mbar_wait(bar, parity);
}
// Orders this thread's register writes (decoded A, zeroed accumulators) before the next wgmma.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator accesses across the asynchronous window.
template <int N> __device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N> __device__ __forceinline__ void fence_regs(uint32_t (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// D[64 x N] += A[64 x 16] (registers: this warp's 16 rows, the m16n8k16 A fragment layout)
// * B[16 x N] (shared memory, K-major, descriptor); fp32 accumulators.
template <int N, typename T> __device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc);
template <> __device__ __forceinline__ void wgmma_rs<16, __half>(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, 1, 1, 1, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <> __device__ __forceinline__ void wgmma_rs<16, __nv_bfloat16>(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, 1, 1, 1, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <> __device__ __forceinline__ void wgmma_rs<32, __half>(float (&d)[16], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, 1, 1, 1, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <> __device__ __forceinline__ void wgmma_rs<32, __nv_bfloat16>(float (&d)[16], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, 1, 1, 1, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <> __device__ __forceinline__ void wgmma_rs<64, __half>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <> __device__ __forceinline__ void wgmma_rs<64, __nv_bfloat16>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <> __device__ __forceinline__ void wgmma_rs<128, __half>(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <> __device__ __forceinline__ void wgmma_rs<128, __nv_bfloat16>(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <> __device__ __forceinline__ void wgmma_rs<256, __half>(float (&d)[128], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, 1, 1, 1, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <> __device__ __forceinline__ void wgmma_rs<256, __nv_bfloat16>(float (&d)[128], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, 1, 1, 1, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
#endif  // KBIT_WGMMA_DEVICE

// Row tile 2h + qp of one plane word (block kb = wi / 2, h = wi % 2: n8 groups 4h + 2qp, rows g,
// and 4h + 2qp + 1, rows g + 8) as A[k16 step][register].
// kNatural (K=5): the decoder's natural_pair hands out (k, k + 1) pairs, which are the A
// registers as they come.
template <int BITS, typename T, bool kWideLut, bool kNatural>
__device__ __forceinline__ void decode_row_tile(const Decoder<BITS, T, kWideLut>& dec, uint32_t codes, int qp,
                                                uint32_t (&A)[2][4], uint32_t lut_addr, uint32_t table) {
  const int q0 = 2 * qp, q1 = 2 * qp + 1;  // n8 groups 4h+q0 (rows g), 4h+q1 (rows g+8)
  const uint32_t s0 = scale2<T>(codes, q0), s1 = scale2<T>(codes, q1);
  if constexpr (kNatural) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // k16 step j >> 1, registers 0 / 1 (j even) or 2 / 3
      A[j >> 1][2 * (j & 1)] = hmul2<T>(dec.natural_pair(q0, j, table), s0);
      A[j >> 1][2 * (j & 1) + 1] = hmul2<T>(dec.natural_pair(q1, j, table), s1);
    }
  } else {
    uint32_t a0[4], a1[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      a0[s] = hmul2<T>(dec.pair(q0, s, lut_addr, table), s0);
      a1[s] = hmul2<T>(dec.pair(q1, s, lut_addr, table), s1);
    }
    // The pairs come in the decoder's k order (core/decode.cuh): pair s of this lane holds, for
    // K = 3..5, k = (2t + s', 16 + 2t + s') with s = 2 j + s' covering k = 8 j + ..., and for K = 2
    // (crumb pairs) k = (16 j + 2t + s', 16 j + 8 + 2t + s'). One PRMT per register regroups
    // them into the m16n8k16 A fragment of natural k (k16 step, then k = 2t, 2t+1 / 2t+8, 2t+9),
    // so x is used as stored: a TMA box of its rows, no permutation pass.
    constexpr bool kCrumb = PairTable<BITS>::kCrumbPairs;
    const uint32_t a[2][4] = {{a0[0], a0[1], a0[2], a0[3]}, {a1[0], a1[1], a1[2], a1[3]}};
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // rows g (fragment registers 0, 2) and g + 8 (1, 3)
      if constexpr (kCrumb) {
        A[0][r] = prmt(a[r][0], a[r][1], 0x5410);
        A[0][2 + r] = prmt(a[r][0], a[r][1], 0x7632);
        A[1][r] = prmt(a[r][2], a[r][3], 0x5410);
        A[1][2 + r] = prmt(a[r][2], a[r][3], 0x7632);
      } else {
        A[0][r] = prmt(a[r][0], a[r][1], 0x5410);
        A[0][2 + r] = prmt(a[r][2], a[r][3], 0x5410);
        A[1][r] = prmt(a[r][0], a[r][1], 0x7632);
        A[1][2 + r] = prmt(a[r][2], a[r][3], 0x7632);
      }
    }
  }
}

// Whether decode_word takes natural pairs: K=5.
constexpr bool kNaturalK5 = true;

// A fragments of one plane word: row tiles 2h and 2h+1 as A[qp][k16 step][register];
// or, with kOneTile, only row tile 2h + qp as A[0] (the 256-token CTA, whose warps each multiply
// one row tile of their word: half the decode per wgmma, Cfg::kTall).
template <int BITS, typename T, bool kWideLut = false, bool kOneTile = false>
__device__ __forceinline__ void decode_word(const uint32_t (&planes)[BITS], uint32_t codes,
                                            uint32_t (&A)[kOneTile ? 1 : 2][2][4], uint32_t lut_addr, uint32_t table,
                                            int qp = 0) {
  constexpr bool kNatural = BITS == 5 && kNaturalK5;
  Decoder<BITS, T, kWideLut> dec;
  dec.load(planes);
  if constexpr (kOneTile) {
    decode_row_tile<BITS, T, kWideLut, kNatural>(dec, codes, qp, A[0], lut_addr, table);
  } else {
#pragma unroll
    for (int q = 0; q < 2; ++q) decode_row_tile<BITS, T, kWideLut, kNatural>(dec, codes, q, A[q], lut_addr, table);
  }
}

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
template <int BITS, int MT, int CN, int R, int CPS, typename T, typename StageAddr, typename Issue>
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

// The unsplit epilogue where y has no tensor map (!p.y_tma): each accumulator plus its bias to
// y, element by element, clipped at M and N. The consumers only.
template <int BITS, int MT, int CN, int R, int CPS, typename T>
__device__ __forceinline__ void store_tile_scalar(const CtaTile<BITS, MT, CN, R, CPS>& tl, const Params& p,
                                                  const T* bias, T* y,
                                                  const float (&acc)[Cfg<BITS, MT, CN, R, CPS>::kSets][MT / 2]) {
  constexpr int kSets = Cfg<BITS, MT, CN, R, CPS>::kSets;
  const int pr0 = tl.pr0, g = tl.g, t4 = tl.t4, nu = tl.nu, m0 = tl.m0;
  const bool slab_ok = tl.slab_ok;
#pragma unroll
  for (int r = 0; r < kSets; ++r)
#pragma unroll
    for (int i = 0; i < MT / 2; ++i) {
      const int e = i & 3, j = i >> 2, pr = pr0 + r;
      const int col = nu * kUnitN + 16 * pr + 8 * (e >> 1) + g, row = m0 + 8 * j + 2 * t4 + (e & 1);
      if (slab_ok && col < p.n && row < p.m) {
        float v = acc[r][i];
        if (bias != nullptr) v += to_float(bias[col]);
        y[(long long)row * p.n + col] = from_float<T>(v);
      }
    }
}

// The split-K epilogue (splits > 1; the producer warpgroup, if any, meets its cluster barriers
// in produce): the CTAs of a cluster reduce their partials through distributed shared memory,
// and with p.groups > 1 the clusters' sums meet in the workspace.
template <int BITS, int MT, int CN, int R, int CPS, typename T>
__device__ __forceinline__ void reduce_split(const CtaTile<BITS, MT, CN, R, CPS>& tl, const Params& p,
                                             const float (&acc)[Cfg<BITS, MT, CN, R, CPS>::kSets][MT / 2]) {
  using C = Cfg<BITS, MT, CN, R, CPS>;
  constexpr int kThreads = C::kConsumers, kSets = C::kSets;
  // the kernel's values of these, read where this epilogue runs
  const int tid = threadIdx.x, split = blockIdx.x, splits = gridDim.x, m0 = token_tile() * MT;
  uint8_t* const smem = tl.smem;
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  // split-K: partials to this CTA's shared memory ([element][thread], conflict-free), then CTA
  // `rank` of the cluster sums its slice of the elements over the cluster's CTAs in rank order.
  // With p.groups > 1 the K range is split over that many clusters (plan_wgmma, choose_groups): each
  // CTA writes its slice's cluster sum to the workspace, and the one to arrive last at that
  // slice (a counter per tile and rank) adds the groups' sums in group order: bitwise
  // deterministic, whichever cluster arrives last.
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int csize = splits / p.groups, rank = split % csize, group = split / csize;
  __syncthreads();  // pipeline smem is reused (every issued copy was waited for in the loop)
  float* part = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int r = 0; r < kSets; ++r)
#pragma unroll
    for (int i = 0; i < MT / 2; ++i) part[(r * (MT / 2) + i) * kThreads + tid] = acc[r][i];
  cluster.sync();
  // four consecutive elements (four threads' partials of one register) per 16-byte DSMEM load
  constexpr int kElems = C::kAcc * kThreads;
  static_assert(kThreads % 4 == 0, "float4 slices stay inside one register row");
  const int per = div_up(div_up(kElems, csize), 4) * 4;
  const int e0 = rank * per, e1 = min(kElems, e0 + per);
  // The y store of elements E..E+3: four threads' partials of one register (one column, four
  // token rows). Every E of this thread has the same E % kThreads (its steps are multiples of
  // kThreads), so those four threads, and with them each value's column and row offsets, can
  // be fixed before the loop, leaving only the register index E / kThreads to vary (kHoisted).
  // At 128- and 256-token tiles only: at 64 tokens the hoisted form measured slower (code
  // placement in a layer that does not split), so those kernels store per element.
  constexpr bool kHoisted = MT >= 128;
  // thread th's slab and first row tile, as `slab` and `pr0` at the top for th = tid
  const auto slab_of = [](int th) { return C::kTall ? ((th >> 5) & 1) : R > 1 ? ((th >> 5) & 3) : (th >> 5); };
  const auto pr0_of = [](int th) { return C::kTall ? 2 * (th >> 7) + ((th >> 6) & 1) : R > 1 ? 2 * (th >> 7) : 0; };
  int col_u[4] = {}, row_u[4] = {};
  if constexpr (kHoisted) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int th = (e0 + 4 * tid) % kThreads + u, l_ = th & 31;
      col_u[u] = (col_group() * C::kSlabsCta + slab_of(th)) * kUnitN + 16 * pr0_of(th) + (l_ >> 2);
      row_u[u] = m0 + 2 * (l_ & 3);
    }
  }
  const auto store4 = [&](int E, const float4 v) {
    const float vs[4] = {v.x, v.y, v.z, v.w};
    const int idx = E / kThreads;
    const int r = idx / (MT / 2), i = idx % (MT / 2), e = i & 3, j = i >> 2;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      int col, row;
      if constexpr (kHoisted) {
        col = col_u[u] + 16 * r + 8 * (e >> 1), row = row_u[u] + 8 * j + (e & 1);
      } else {
        const int th = E % kThreads + u, l_ = th & 31, pr = r + pr0_of(th);
        col = (col_group() * C::kSlabsCta + slab_of(th)) * kUnitN + 16 * pr + 8 * (e >> 1) + (l_ >> 2);
        row = m0 + 8 * j + 2 * (l_ & 3) + (e & 1);
      }
      if (col < p.n && row < p.m) {
        float o = vs[u];
        if (bias != nullptr) o += to_float(bias[col]);
        y[(long long)row * p.n + col] = from_float<T>(o);
      }
    }
  };
  const long long tile = (long long)col_group() * gridDim.y + token_tile();
  float4* const sums = p.partial + tile * p.groups * (kElems / 4);  // [group][kElems / 4]
  const auto finish = [&](int E, const float4 v) {
    if (p.groups == 1) {
      store4(E, v);
    } else {
      __stcg(sums + group * (kElems / 4) + E / 4, v);
    }
  };
  // A thread's elements are E = e0 + 4 tid + 4 kThreads j. Every rank's 16-byte load of EB of
  // them is issued before the first sum (ranks unrolled to RB >= csize: up to 16 loads in
  // flight), as the GEMV's final pass does for its ranks, so the remote loads overlap instead of
  // each waiting out its latency. The sums still run in rank order (deterministic).
  const auto reduce_slice = [&](auto rb, auto eb) {
    constexpr int RB = decltype(rb)::value, EB = decltype(eb)::value;
    for (int E0 = e0 + 4 * tid; E0 < e1; E0 += 4 * kThreads * EB) {
      float4 r[EB][RB];
#pragma unroll
      for (int b = 0; b < EB; ++b)
#pragma unroll
        for (int q = 0; q < RB; ++q)
          if (q < csize && E0 + 4 * kThreads * b < e1)
            r[b][q] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(part, q) + E0 + 4 * kThreads * b);
#pragma unroll
      for (int b = 0; b < EB; ++b) {
        if (E0 + 4 * kThreads * b >= e1) break;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int q = 0; q < RB; ++q)
          if (q < csize) v.x += r[b][q].x, v.y += r[b][q].y, v.z += r[b][q].z, v.w += r[b][q].w;
        finish(E0 + 4 * kThreads * b, v);
      }
    }
  };
  using std::integral_constant;
  static_assert(kMaxSplits <= 16, "the reduction unrolls ranks to 16");
  if (csize <= 2) {
    reduce_slice(integral_constant<int, 2>{}, integral_constant<int, 8>{});
  } else if (csize <= 4) {
    reduce_slice(integral_constant<int, 4>{}, integral_constant<int, 4>{});
  } else if (csize <= 8) {
    reduce_slice(integral_constant<int, 8>{}, integral_constant<int, 2>{});
  } else {
    reduce_slice(integral_constant<int, 16>{}, integral_constant<int, 1>{});
  }
  if (p.groups > 1) {
    // Every consumer's part of the slice is stored before thread 0 moves the counter: the CTA
    // barrier, then thread 0's fence, a release that covers what the barrier ordered before it
    // (CUTLASS's semaphore pattern; the mma kernel fences in every thread instead).
    // Barriers of the consumers only: a producer warpgroup waits at the cluster barriers.
    named_sync(1, kThreads);
    int* const counter = p.counters + tile * csize + rank;
    bool last = false;
    if (tid == 0) {
      __threadfence();  // release: the slice before the count
      last = atomicAdd(counter, 1) == p.groups - 1;
      if (last) {
        *counter = 0;      // every launch leaves its counters zero (the caller's zeroed counters)
        __threadfence();   // acquire, in the thread that observed the count
      }
    }
    if (named_sync_or(1, kThreads, last)) {
      __threadfence();  // acquire for the threads that read the other groups' sums
      // kBatch float4 of each group in flight before any is added: they are L2 round trips
      constexpr int kBatch = 8;
      for (int E0 = e0 + 4 * tid; E0 < e1; E0 += 4 * kThreads * kBatch) {
        float4 v[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) v[b] = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int g2 = 0; g2 < p.groups; ++g2) {  // group order: deterministic
          float4 r[kBatch];
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            const int E = E0 + 4 * kThreads * b;
            r[b] = E < e1 ? __ldcg(sums + g2 * (kElems / 4) + E / 4) : make_float4(0.f, 0.f, 0.f, 0.f);
          }
#pragma unroll
          for (int b = 0; b < kBatch; ++b) v[b].x += r[b].x, v[b].y += r[b].y, v[b].z += r[b].z, v[b].w += r[b].w;
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
          if (E0 + 4 * kThreads * b < e1) store4(E0 + 4 * kThreads * b, v[b]);
      }
    }
  }
  cluster.sync();  // keep this CTA's partials alive until the cluster has read them
}
#endif  // KBIT_WGMMA_DEVICE

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
  if constexpr (C::kTall && !kSplitTall) __trap();  // unreachable: launch_typed launches kSplitTall
  reduce_split<BITS, MT, CN, R, CPS, T>(tl, p, acc);
#else
  __trap();  // not sm_90a code: the host never launches this (wgmma_supported)
#endif
}

// Occupancy of one instantiation (dispatch/wgmma_plan.h), from the CUDA occupancy API once per
// process; the first call also opts the kernel into its dynamic shared memory.
template <int BITS, int MT, int CN, int R, int CPS, typename T, bool kSplitTall = false> const Occupancy& occupancy() {
  static const Occupancy occ = [] {
    using C = Cfg<BITS, MT, CN, R, CPS>;
    const auto kernel = wgmma_kernel<BITS, MT, CN, R, CPS, T, kSplitTall>;
    Occupancy o;
    int dev = 0, smem_sm = 0, b = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    // two CTAs need 2 x (bytes + 1 KB reserved) <= the SM's shared memory: half of it is too much
    o.spread_bytes = C::kBytes > smem_sm / 2 ? C::kBytes : smem_sm / 2;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, o.spread_bytes);
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess)
      o.max_splits = kMaxSplits;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, C::kThreads, C::kBytes) == cudaSuccess && b > 0)
      o.per_sm = b;
    for (int s = 1; s <= kMaxSplits; ++s)
      for (int spread = 0; spread < 2; ++spread) {
        int n = 0;
        const int bytes = spread ? o.spread_bytes : C::kBytes;
        o.clusters[s][spread] = max_active_clusters(kernel, s, C::kThreads, bytes, &n) ? n : 0;
      }
    cudaGetLastError();  // an unanswered query leaves no sticky error behind
    return o;
  }();
  return occ;
}

// The driver's tensor-map encoder, fetched through the runtime once, so nothing links libcuda.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  using Encode = PFN_cuTensorMapEncodeTiled_v12000;
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  return encode;
}
// A row-major [rows][cols] tensor of T at `ptr` as a 2-D TMA map: boxes of `box_cols` x
// `box_rows` in the 128 B swizzle (so box_cols * sizeof(T) must be 128 B, one swizzle row), zeros
// out of bounds on loads, clipped on stores. `ptr` must be 16 B aligned and the row stride a 16 B
// multiple (callers check). Encoded per call on the host: a CUDA graph keeps the captured copy,
// as it keeps the pointer.
template <typename T>
cudaError_t encode_tile_map(const void* ptr, int rows, int cols, int box_rows, int box_cols,
                            CUtensorMapL2promotion promotion, CUtensorMap* map) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * sizeof(T)};
  const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)};
  const cuuint32_t unit_stride[2] = {1, 1};
  const CUresult r = encode(map, std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                            2, const_cast<void*>(ptr), dims, strides, box, unit_stride, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}
// x [M][K]: boxes of 64 k x `mt` tokens (K % 32 == 0 makes the row stride a 64 B multiple).
template <typename T> cudaError_t make_x_map(const Params& p, int mt, CUtensorMap* map) {
  return encode_tile_map<T>(p.x, p.m, p.k, mt, kUnitK, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, map);
}

// y [M][N] for the unsplit epilogue's stores: boxes of 64 columns (one slab) x `mt` tokens. Only
// where its row stride is a 16 B multiple and y 16 B aligned (N % 8 == 0: every layer of the
// models we serve); elsewhere the scalar store runs.
inline bool y_map_eligible(const Params& p) { return p.n % 8 == 0 && reinterpret_cast<uintptr_t>(p.y) % 16 == 0; }
template <typename T> cudaError_t make_y_map(const Params& p, int mt, CUtensorMap* map) {
  return encode_tile_map<T>(p.y, p.m, p.n, mt, kUnitN, CU_TENSOR_MAP_L2_PROMOTION_NONE, map);
}

// Launch one instantiation with `splits` CTAs along K: p.groups clusters of splits / p.groups
// (1..kMaxSplits) CTAs; `spread`: with spread_bytes of shared memory, so that no SM takes two;
// `y_tma`: an unsplit call may store y through TMA.
template <int BITS, int MT, int CN, int R, int CPS, typename T, bool kSplitTall = false>
cudaError_t launch_instantiation(Params p, int splits, bool spread, bool y_tma, cudaStream_t stream) {
  alignas(64) CUtensorMap xmap, ymap = {};
  const cudaError_t e = make_x_map<T>(p, MT, &xmap);
  if (e != cudaSuccess) return e;
  // an eligible call whose map does not encode is an error, so the TMA store never goes quietly
  p.y_tma = splits == 1 && y_tma && y_map_eligible(p);
  if (p.y_tma) {
    const cudaError_t ey = make_y_map<T>(p, MT, &ymap);
    if (ey != cudaSuccess) return ey;
  }
  using C = Cfg<BITS, MT, CN, R, CPS>;
  const auto kernel = wgmma_kernel<BITS, MT, CN, R, CPS, T, kSplitTall>;
  const Occupancy& occ = occupancy<BITS, MT, CN, R, CPS, T, kSplitTall>();  // and the shared-memory opt-in (once)
  cudaLaunchConfig_t cfg = {};
  const unsigned gy = div_up(n_units(p.n), C::kSlabsCta), gz = div_up(p.m, MT);
  cfg.gridDim = dim3(splits, gz, gy);  // token tiles first (col_group)
  cfg.blockDim = dim3(C::kThreads, 1, 1);
  cfg.dynamicSmemBytes = spread ? occ.spread_bytes : C::kBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = splits / p.groups;  // grid x = clusters of the split x groups
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.pdl ? 2 : 1;
  return cudaLaunchKernelEx(&cfg, kernel, p, xmap, ymap);
}

// The instantiations a plan can pick, (MT, CN, R, CPS): 512-column CTAs without a row split, one
// per SM; R = 1 at MT = 16; R = 1 or 2 at MT = 32; R = 2 at MT = 64 (two or one per SM) and 128
// (one per SM). Calls f(MT, CN, R, CPS) with the one the plan names, as integral constants (the
// single list both the occupancy queries and the launch go through).
template <int V> using IntC = std::integral_constant<int, V>;
template <typename F> decltype(auto) with_instantiation(int mt, int columns, int row_split, int built_per_sm, F&& f) {
  if (mt == 256) return f(IntC<256>{}, IntC<128>{}, IntC<2>{}, IntC<1>{});
  if (columns == 512) {
    if (mt == 16) return f(IntC<16>{}, IntC<512>{}, IntC<1>{}, IntC<1>{});
    if (mt == 32) return f(IntC<32>{}, IntC<512>{}, IntC<1>{}, IntC<1>{});
    return f(IntC<64>{}, IntC<512>{}, IntC<1>{}, IntC<1>{});
  }
  switch (mt) {
    case 16: return f(IntC<16>{}, IntC<256>{}, IntC<1>{}, IntC<2>{});
    case 32:
      return row_split == 2 ? f(IntC<32>{}, IntC<256>{}, IntC<2>{}, IntC<2>{}) : f(IntC<32>{}, IntC<256>{}, IntC<1>{}, IntC<2>{});
    case 64: return built_per_sm == 1 ? f(IntC<64>{}, IntC<256>{}, IntC<2>{}, IntC<1>{}) : f(IntC<64>{}, IntC<256>{}, IntC<2>{}, IntC<2>{});
    default: return f(IntC<128>{}, IntC<256>{}, IntC<2>{}, IntC<1>{});
  }
}

template <int BITS, typename T> const Occupancy& occupancy_for(int mt, int columns, int row_split, int built_per_sm) {
  return with_instantiation(mt, columns, row_split, built_per_sm, [](auto m, auto c, auto r, auto q) -> const Occupancy& {
    return occupancy<BITS, decltype(m)::value, decltype(c)::value, decltype(r)::value, decltype(q)::value, T>();
  });
}

// Whether the 64-token tile built for one CTA per SM has more pipeline stages than the one built
// for two (dispatch/wgmma_plan.h, one_per_sm): true at K = 3..5, whose tables and units leave
// two CTAs per SM 4-6 stages.
template <int BITS> constexpr bool one_per_sm_deeper() {
  return Cfg<BITS, 64, 256, 2, 1>::kStages > Cfg<BITS, 64, 256, 2, 2>::kStages;
}

// The plan of one call with this bit width's and dtype's instantiations' occupancy.
template <int BITS, typename T>
WgmmaPlan plan_typed(int m, int n, int k, int num_sms, int splits, bool pdl, const WgmmaOverrides& o) {
  WgmmaTarget t;
  t.bits = BITS;
  t.num_sms = num_sms;
  t.one_per_sm_deeper = one_per_sm_deeper<BITS>();
  t.pdl = pdl;
  return plan_wgmma(m, n, k, splits, t, o, [](int mt, int columns, int row_split, int built_per_sm) -> const Occupancy& {
    return occupancy_for<BITS, T>(mt, columns, row_split, built_per_sm);
  });
}

// Launch the plan's instantiation. With cluster groups the workspace holds the group counters
// (unless the caller's zeroed counters serve: p.counters) and then the groups' sums.
template <int BITS, typename T>
cudaError_t launch_typed(Params p, const WgmmaPlan& pl, cudaStream_t stream) {
  p.chunk = pl.chunk;
  p.groups = pl.groups;
  p.pdl = pl.pdl;
  if (pl.groups > 1) {
    if (p.partial == nullptr) return cudaErrorInvalidValue;
    const size_t counter_bytes = group_counter_bytes(pl);
    if (p.counters == nullptr || group_counters(pl) > size_t(kWgmmaZeroedCounters)) {
      p.counters = reinterpret_cast<int*>(p.partial);
      const cudaError_t e = cudaMemsetAsync(p.counters, 0, counter_bytes, stream);  // graph-capturable
      if (e != cudaSuccess) return e;
    }  // else the caller's counters, zero and left zero by every launch (self-reset)
    p.partial = reinterpret_cast<float4*>(reinterpret_cast<char*>(p.partial) + counter_bytes);
  }
  if (pl.tile_m == 256 && pl.grid_x() > 1)  // the tall CTAs split along K: their own build (kSplitTall)
    return launch_instantiation<BITS, 256, 128, 2, 1, T, true>(p, pl.grid_x(), false, pl.y_tma, stream);
  return with_instantiation(pl.tile_m, pl.columns, pl.row_split, pl.built_per_sm, [&](auto m, auto c, auto r, auto q) {
    return launch_instantiation<BITS, decltype(m)::value, decltype(c)::value, decltype(r)::value, decltype(q)::value,
                                T>(p, pl.grid_x(), pl.spread, pl.y_tma, stream);
  });
}

// Entry points of one bit width (instantiated in wgmma/instantiations/wgmma_k<BITS>.cu).
template <int BITS>
WgmmaPlan plan_bits(DType dtype, int m, int n, int k, int num_sms, int splits, bool pdl, const WgmmaOverrides& o) {
  if (dtype == DType::kBFloat16) return plan_typed<BITS, __nv_bfloat16>(m, n, k, num_sms, splits, pdl, o);
  return plan_typed<BITS, __half>(m, n, k, num_sms, splits, pdl, o);
}
template <int BITS>
cudaError_t launch_bits(DType dtype, const Params& p, const WgmmaPlan& plan, cudaStream_t stream) {
  if (dtype == DType::kHalf) return launch_typed<BITS, __half>(p, plan, stream);
  if (dtype == DType::kBFloat16) return launch_typed<BITS, __nv_bfloat16>(p, plan, stream);
  return cudaErrorInvalidValue;
}

#define KBIT_WGMMA_INSTANTIATE_BITS(BITS)                                                                   \
  template WgmmaPlan plan_bits<BITS>(DType, int, int, int, int, int, bool, const WgmmaOverrides&);         \
  template cudaError_t launch_bits<BITS>(DType, const Params&, const WgmmaPlan&, cudaStream_t)

}  // namespace wg
}  // namespace kbit
