// kbit GEMM on Hopper's asynchronous tensor-core instruction (wgmma, sm_90a) for mid-size M:
// y[M, N] = x[M, K] @ dequant(W)^T, torch-free. Instantiated per bit width in
// csrc/generated/wgmma_k{2,3,4,5}.cu; csrc/kbit_wgmma.cu holds the host plan.
//
// Why this shape (Machete's transposition, seed 002): compute Y^T = W X^T with the
// dequantized W as wgmma's register-sourced A operand and x^T as the shared-memory B operand.
// Then the weights never round-trip through shared memory after decode, the tokens are the
// wgmma N dimension (16..256 per CTA; M from 17 to wgmma_max_m is served here), and the
// instruction is asynchronous: the tensor cores multiply one 32-block while the warps decode the
// next.
//   * a warpgroup (4 warps): warp w owns the 64-column slab w of the CTA's slabs, i.e.
//     exactly the lane-local fragments of kbit_layout.cuh (no data crosses lanes or warps).
//     A wgmma m64 tile takes rows 16w..16w+15 from warp w, so row tile `pr` of the four warps'
//     units forms one m64 (rows permuted across slabs; the epilogue maps them back): four
//     accumulator sets of 64 x MT per warpgroup, 256 columns x MT tokens, 2 MT fp32 / thread
//     (with a row split R = 2: two sets, MT fp32 / thread).
//     CTA = one warpgroup (256 columns); or two sharing one x tile (512 columns, half the x
//     traffic per weight; only when forced since the TMA loads, plan_t); or two that split each
//     unit's row tiles between them (row split R = 2: at MT = 128 so that the accumulators fit,
//     at MT = 64 and short-K MT = 32 for 16 warps per SM, plan_t). At MT = 256 (the tall CTA,
//     Cfg::kTall, from 192 rows on the layers where choose_tall takes it) 128 columns: each warp
//     multiplies one row tile of its plane words at n = 256, so each weight is decoded once per
//     256 tokens; split along K in one cluster where too few tall CTAs would leave SMs idle.
//   * per 32-block: decode (kbit_decode.cuh: the GEMV's pair tables, codebook pre-multiplied
//     by the E4M4 constant, then one HMUL2 by the block's scale) -> 8 wgmma (4 row tiles x
//     2 k16 steps) into two alternating A buffers: block b+1 decodes while block b multiplies
//     (wgmma.wait_group 1).
//   * x is used as stored: the decoder's pairs come in a permuted k order (kbit_decode.cuh), and
//     one PRMT per A register regroups them into natural k, so x goes to shared memory as
//     stored, by TMA (a 2-D tensor map of x, box MT rows x 64 k) straight into the 128 B
//     swizzle wgmma's descriptor describes, in the same stage as W (bulk copies of the CTA's
//     units, one per slab's warp). The bytes and 1 + slabs arrivals complete the stage's
//     mbarrier. (cp.async by every thread, before: each SM moved only ~35 GB/s from L2, and
//     the loads alone took 62% of a 57344x8192 M=256 call, docs/MMA.md; now 10-12% faster
//     at M = 128..256, 6-9% at M = 64.)
//   * each lane reads back only its own 16 B per plane of its warp's unit (conflict-free LDS.128).
//   * per K-tile: every thread waits for the stage's mbarrier, then one __syncthreads (every
//     warp is past the previous tile, so the stage two tiles back may be refilled). Where one
//     CTA holds the SM (MT = 128, and MT = 64 where one_per_sm takes it), a producer warpgroup
//     issues the copies instead and the consumers hand stages back through per-stage "empty"
//     mbarriers: no CTA barrier in the loop (Cfg::kProducer). K=3,4 use the wide-row pair
//     table wherever one CTA holds the SM (Cfg::kWideLut; also the forced 512-column CTAs).
//   * an unsplit call's y leaves through shared memory: stmatrix writes each slab's tile
//     transposed into the 128 B swizzle and one TMA store a slab writes whole lines (N % 8 == 0;
//     else element by element). 8% faster on 28672x4096 at M = 256, 5% at M = 64 (docs/MMA.md).
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

// wgmma exists only in arch-specific sm_90a code; every other target compiles a trap body and
// the host never launches it there (wgmma_supported in kbit_wgmma.cu).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KBIT_WGMMA_DEVICE 1
#else
#define KBIT_WGMMA_DEVICE 0
#endif

namespace kbit {
namespace wg {

constexpr int kSlabs = 4;               // one 64-column layout slab per warp of a warpgroup
// Split-K clusters of up to 16 CTAs: sizes 9..16 are "non-portable" (sm_90 allows them with
// cudaFuncAttributeNonPortableClusterSizeAllowed); the plan takes them only for long K ranges
// (choose_splits, kBigClusterChunk).
constexpr int kMaxSplits = 16;
constexpr int kPortableSplits = 8;      // the largest cluster every sm_90 launch allows
constexpr int kPlanInts = kWgmmaPlanInts;  // wgmma_plan_info's out[] (kbit_ops.h)
// Grid (splits, token tiles, column groups): the token tiles of one column group are launched
// next to each other, so the W they share is read from DRAM once and from L2 after (0-7% faster
// at M = 128..512 than column groups first, wgmma_dev.py, H200).
__device__ __forceinline__ int token_tile() { return blockIdx.y; }
__device__ __forceinline__ int col_group() { return blockIdx.z; }

using Params = StreamParams;  // kbit_common.cuh

// Row split R of a 256-column CTA: R warpgroups share its four slabs; with R = 2 warpgroup wg
// takes row tiles 2 wg and 2 wg + 1 of every unit (the lane's plane words h = wg). Each weight
// is still decoded once per CTA; what changes is how many warps share the decode (16 per SM
// instead of 8 where two CTAs fit an SM) and how many accumulators a thread holds (4 / R sets
// of MT / 2). The plan (plan_t) picks R; measurements there.
// CTAs per SM of an (MT, CN, R) CTA unless the plan asks for one per SM (one_per_sm): two
// wherever a thread's accumulators fit 128 registers (64 fp32 with the row split at MT <= 64,
// 128 without it at 256 columns), else one.
constexpr int default_cps(int mt, int cn, int rs) { return (rs == 1 && cn == 256) || (rs == 2 && mt <= 64) ? 2 : 1; }
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
  // (no cluster groups, plan_t).
  static constexpr bool kTall = MT == 256;
  static_assert(!kTall || (CN == 128 && R == 2 && CPS == 1), "the tall CTA: 128 columns, two warpgroups, one per SM");
  static_assert(!(R == 1 && MT == 128), "128 x 64 fp32 accumulators per thread do not fit the registers");
  static_assert(CPS == 1 || default_cps(MT, CN, R) == 2, "two CTAs per SM only where their accumulators fit");
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
  // CTAs (forced only): the copies of eight slabs spill out of the producer's 40 registers (64
  // would fit; not measured). With the wide table (below): 7-10% faster at K=4, M = 128..512
  // on 28672x4096 and 57344x8192 (wgmma_dev.py), 4-8% in the 8B decode step at K = 2..4 and
  // 1-2% at K=5 (docs/MMA.md, tenth session).
  static constexpr bool kProducer = kCtasPerSm == 1 && CN <= 256;
  static constexpr int kThreads = kConsumers + (kProducer ? 128 : 0);
  static constexpr int kUnitBytes = BITS * 512 + kUnitAbsmaxBytes;  // one layout unit
  static constexpr int kXBytes = MT * 128;    // MT rows x 64 k x 2 B; a multiple of the 1 KB swizzle atom
  static constexpr int kWBytes = kSlabsCta * kUnitBytes;    // one K-tile of W (the slabs' units)
  static constexpr int kStageBytes = kXBytes + (kWBytes + 1023) / 1024 * 1024;  // x tile, then W (1 KB steps)
  static constexpr int kLutOff = 0;
  // Wide-row pair table (K=3,4, one CTA per SM; kbit_decode.cuh PairTable::kWideLutBytes): at
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
// registers as they come (2-6% faster at M = 32..256, docs/MMA.md).
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
    // The pairs come in the decoder's k order (kbit_decode.cuh): pair s of this lane holds, for
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

// kSplitTall: the tall CTA's split-K build (Cfg::kTall only). A separate instantiation, so the
// unsplit tall kernel keeps the code it had before the tall CTAs could split: compiled into it,
// the split epilogue's registers cost the unsplit main loop 1.0-2.5% at K = 2, 3 (8B decode step,
// M = 1000 / 2048, two builds alternated twice, docs/MMA.md).
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
  wait_prior_grids();  // programmatic dependent launch (kbit_common.cuh): x may be the previous kernel's output

  // Without a producer, K-tile i -> stage i % kStages: thread 0 loads x rows m0.. as stored,
  // zeros past M and K (TMA); lane 0 of each slab's warp its unit.
  // Measured against thread 0 issuing every unit's copies and against cp.async of W by the
  // slab's warps (arriving on the same mbarrier): 2-5% faster at M = 64..256, equal at M = 16.
  // the warps that load W, one slab each: with warpgroups on shared slabs (R > 1) the last
  // one, so that the first (whose thread 0 issues x) does not also carry W's issue work
  // (0.2-1.1% faster at M = 128 / 256 on four shapes, wgmma_dev.py, same call)
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

  __syncthreads();  // the barriers are initialised before anyone arrives or waits on them
  if constexpr (C::kProducer) {
    if (producer) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
      // every K-tile into stage i % kStages once the consumers have handed that stage back: the
      // x box and each slab's unit, one mbarrier arrival announcing all their bytes
      if (tid == kThreads) {
        for (int i = 0; i < nt; ++i) {
          const int sg = i % C::kStages, ku = ku_begin + i;
          if (i >= C::kStages) mbar_wait(empty0 + 8 * sg, ((i / C::kStages) - 1) & 1);
          const uint32_t st = stage_addr(sg), bar = bar0 + 8 * sg;
          fence_proxy_async();
          mbar_arrive_expect_tx(bar, C::kXBytes + C::kSlabsCta * C::kUnitBytes);
          tma_load_2d(st, &xmap, ku * kUnitK, m0, bar);
#pragma unroll
          for (int sl = 0; sl < C::kSlabsCta; ++sl) load_unit(st, sl, ku, bar);
        }
      }
      if (splits > 1) {  // the consumers' epilogue barriers (below)
        __syncthreads();
        cooperative_groups::this_cluster().sync();
        cooperative_groups::this_cluster().sync();
      }
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
  if constexpr (!C::kProducer) {
#pragma unroll
    for (int i = 0; i < C::kLead; ++i) issue(i);
  }
  // (published by the first iteration's __syncthreads; with a producer, by a barrier of the
  // consumers alone, so that the producer's first copies need not wait for the table)
  const uint32_t table = init_codebook<BITS, T, C::kWideLut>(
      p.codebook, codebook_mult<T>(), reinterpret_cast<uint32_t*>(smem + (lut_base - base)), tid, kThreads);
  if constexpr (C::kProducer) named_sync(1, kThreads);
  // the lane's replica, or with wide rows the PRMT key (Decoder::pair)
  const uint32_t lut_addr = opaque(C::kWideLut ? (lut_base & 0xFFFF0000u) | (4u * lane)
                                               : lut_base + 4u * (lane % kLutReplicas));

  // two A buffers: block b+1 decodes while block b multiplies (no spills: <= 255 registers, or
  // <= 128 for two 256-thread CTAs per SM, where K=5 at MT = 64 uses all 128 under CUDA 13)
  uint32_t A[2][kSets][2][4];
  for (int t = 0; t < nt; ++t) {
    stage_wait(bar0 + 8 * (t % C::kStages), (t / C::kStages) & 1);  // x and W of tile t have landed
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
        decode_word<BITS, T, C::kWideLut, true>(pw[kb][0], codes[kb][0], Ab, lut_addr, table, qp);
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
        if (kb == 0 && t > 0) mbar_arrive(empty0 + 8 * ((t - 1) % C::kStages));
      }
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int r = 0; r < kSets; ++r) fence_regs(acc[r]);

  // ---- epilogue. D fragment of wgmma m64nMT, register i = 4j + e of set r: row (in the m64)
  // 16 (warp % 4) + g + 8 (e >> 1) = column 64 nu + 16 pr + 8 (e >> 1) + g of y, pr = pr0 + r
  // (pr0 = 2 wg with a row split, + qp in the tall CTA; 0 for one warpgroup), token
  // 8 j + 2 t4 + (e & 1).
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  if (splits == 1) {
    if (p.y_tma) {
      // Through shared memory: each slab's [MT tokens][64 columns] tile in the 128 B swizzle
      // (16-byte chunk c of token row t at chunk c ^ (t % 8): the eight rows of one stmatrix
      // fragment hit eight different bank groups), then one TMA store per slab writes whole
      // lines, clipped at M and N by the tensor map. Per element, the scalar store below
      // recomputes its column and row and writes 2 bytes; its phase took 6.0 us of each
      // 28672x4096 CTA at M = 256 (2.6 at M = 64) after a 51 us main loop (per-CTA trace).
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
    return;
  }
  // (the tall CTA splits K in one cluster only, in its kSplitTall build: plan_t keeps 128-token
  // tiles under forced cluster groups, KBIT_WGMMA_GROUPS >= 2)
  static_assert(!kSplitTall || C::kTall, "kSplitTall: the tall CTA's split build only");
  if constexpr (C::kTall && !kSplitTall) __trap();  // unreachable: launch_t2 launches kSplitTall
  // split-K: partials to this CTA's shared memory ([element][thread], conflict-free), then CTA
  // `rank` of the cluster sums its slice of the elements over the cluster's CTAs in rank order.
  // With p.groups > 1 the K range is split over that many clusters (plan_t, choose_groups): each
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
  // be fixed before the loop, leaving only the register index E / kThreads to vary. Per
  // element, the index arithmetic was most of the sums' phase (4.2 of its 6.1 us at M = 256
  // with own-rank loads only and no stores, per-CTA trace). Hoisted at 128-token tiles,
  // the K=4 8B decode step at M = 256 took 7834 us against 7935 (qkv 35.7 -> 34.5, o 26.6 ->
  // 25.7; two builds alternated twice in one call, docs/MMA.md). Hoisted at 64-token tiles too,
  // M = 64 measured 2% slower at K=4, mostly in a layer that does not split (code placement, we
  // think), so those kernels keep the per-element store and their code as before. The tall CTA's
  // split build (MT = 256) hoists too.
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
  // flight), as the GEMV's final pass does for its ranks; one at a time, each remote load
  // waited out its latency. The epilogue took 7-9 us of a 27-36 us call at M = 256 (qkv, o,
  // down; per-CTA globaltimer trace, H200); this took 1-1.5 us a layer off (docs/MMA.md, Next).
  // The sums still run in rank order (deterministic).
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
      // kBatch float4 of each group in flight before any is added: they are L2 round trips (one
      // at a time, 4096x4096 at M = 256 took 35.5 us in the decode graph, batched 30.7)
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
#else
  __trap();  // not sm_90a code: the host never launches this (wgmma_supported)
#endif
}

// Occupancy of one instantiation, from the CUDA occupancy API once per process (the first call
// also opts the kernel into its dynamic shared memory): CTAs one SM holds, the dynamic shared
// memory that leaves room for only one CTA per SM ("spread" launches, below), and how many
// clusters of s CTAs can be resident at once, packed or spread.
struct Occupancy {
  int per_sm = 1;
  int spread_bytes = 0;
  int max_splits = kPortableSplits;      // kMaxSplits where the device allows non-portable sizes
  int clusters[kMaxSplits + 1][2] = {};  // [s][spread]; 0 = the API gave no answer
};

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
// (1..kMaxSplits) CTAs; `spread`: with spread_bytes of shared memory, so that no SM takes two.
template <int BITS, int MT, int CN, int R, int CPS, typename T, bool kSplitTall = false>
cudaError_t launch_t(Params p, int splits, bool spread, cudaStream_t stream) {
  alignas(64) CUtensorMap xmap, ymap = {};
  const cudaError_t e = make_x_map<T>(p, MT, &xmap);
  if (e != cudaSuccess) return e;
  // an eligible call whose map does not encode is an error, so the TMA store never goes quietly
  p.y_tma = splits == 1 && env_int("KBIT_WGMMA_Y_TMA", 1) != 0 && y_map_eligible(p);
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

// Split-K factor from the shape and the occupancy: the fewest waves x CTA time, a CTA's time
// being its K-tiles at a rate set by how many CTAs share its SM, plus a fixed cost (pipeline
// fill, table, reduction: ~3 K-tiles). Measured on the H200 (bench_gemm.py --sweep-splits
// --path wgmma, M = 16 and 64, 8192x28672 and 4096x14336, 2026-11-21):
//   * a K-tile takes a 256-column CTA ~1.0 us alone on its SM and ~1.7 us with a second one
//     beside it (0.83 us per K-tile per SM: two CTAs gain only ~20%);
//   * the cluster scheduler packs clusters two CTAs per SM where it can: 128 CTAs in clusters
//     of 4 took 170 us against 149 for 96 in clusters of 3 (150 vs 112 K-tiles each). So a grid
//     of at most one CTA per SM is launched spread (shared memory for one CTA per SM);
//   * clusters that cannot all be resident at once run in a second wave: 32 clusters of 8
//     (256 CTAs for 264 two-per-SM slots) took 179 us against 111 for 32 clusters of 7. The
//     occupancy API's count of resident clusters says when.
// A grid of `ctas` that can launch spread: an SM could hold more than one, and the grid fits one per SM.
inline bool fits_spread(const Occupancy& occ, long long ctas, int num_sms) { return occ.per_sm > 1 && ctas <= num_sms; }
// Waves of `clusters` clusters of s CTAs: as many at once as the occupancy API counted resident,
// else the SMs' CTA slots (per_sm each, one when spread) over s.
inline long long cluster_waves(long long clusters, const Occupancy& occ, int s, bool spread, int num_sms) {
  const int counted = occ.clusters[s][spread];
  const long long resident = counted > 0 ? counted : (long long)num_sms * (spread ? 1 : occ.per_sm) / s;
  return div_up(clusters, resident > 0 ? resident : 1LL);
}
// CTAs on the busiest SM of a one-wave grid of `ctas`: one when launched spread, else as many as
// the grid puts on an SM, at most what fits.
inline long long busiest_ctas(const Occupancy& occ, long long ctas, int num_sms, bool spread) {
  const long long per_sm = div_up(ctas, (long long)num_sms);
  return spread ? 1 : per_sm < occ.per_sm ? per_sm : occ.per_sm;
}

//   * clusters of 9..16 CTAs pay only where each CTA keeps a long K range: with 16 K-tiles or
//     more a CTA, 4096x14336 took 30.4 against 35.3 us at M = 32 and 36.5 against 37.9 at
//     M = 64 (K=4; K = 2 / 5 alike), while 4096x4096 at M = 64 (4-7 K-tiles a CTA) went from
//     18.5 to 21.4 us with them (bench_gemm.py --path wgmma, KBIT_WGMMA_MAX_SPLITS=16 / 8,
//     alternated twice in one call; the --sweep-splits table is irregular past 8, so only the
//     model's pick, not every size, is worth trusting there).
constexpr int kBigClusterChunk = 16;
//   * a split CTA pays its reduction on top (`split_cost`, in the same units): at MT = 128,
//     whose partials are 128 KB a CTA, 4 K-tiles (kSplitCost128). Fitted to forced sweeps
//     s = 1..16 on 4096x4096, 6144x4096, 4096x14336 and 28672x4096 at M = 256..1000 (K=4,
//     bench_gemm.py --sweep-splits, 49 cases, bench_gemm_wgmma_splits_m*_9f74899.json): any
//     cost from 3.5 to 4.8 K-tiles picks the fastest forced split in all 49, a cost of 0 in 40
//     (28672x4096 at M = 448..768 ran s = 2 at 1.09-1.14x the time of s = 1, 4096x14336 at
//     M = 704 / 768 s = 8 at 1.14x); tests/test_wgmma_plan.py replays them on the CPU. MT <= 64
//     keeps the cost 0 its own sweeps were fitted with.
constexpr int kSplitCost128 = 40;
inline int choose_splits(long long tiles, int ku, int num_sms, const Occupancy& occ, int split_cost,
                         long long* cost_out = nullptr) {
  constexpr int kAlone = 10, kShared = 17, kFixed = 3 * kAlone;
  const int cap = env_int("KBIT_WGMMA_MAX_SPLITS", kMaxSplits);  // tuning: 8 = portable sizes only
  const int max_s = cap < 1 ? 1 : cap > occ.max_splits ? occ.max_splits : cap;
  int best = 1;
  long long best_cost = -1;
  for (int s = 1; s <= max_s && s <= ku; ++s) {
    if (s > 1 && div_up(ku, s) < 2) break;  // at least two K-tiles per CTA
    if (s > kPortableSplits && div_up(ku, s) < kBigClusterChunk) break;
    const long long ctas = tiles * s;
    const bool spread = fits_spread(occ, ctas, num_sms);
    const long long waves = cluster_waves(tiles, occ, s, spread, num_sms);
    const long long busiest = busiest_ctas(occ, ctas, num_sms, spread);
    const long long per_cta = div_up(ku, s) * (busiest >= 2 ? kShared : kAlone) + kFixed + (s > 1 ? split_cost : 0);
    const long long cost = waves * per_cta;
    if (best_cost < 0 || cost < best_cost) best = s, best_cost = cost;
  }
  if (cost_out != nullptr) *cost_out = best_cost;
  return best;
}

// The split of a plan: `forced` (> 0) or choose_splits' pick, clamped to the device's largest
// cluster and the K-tiles, then the fewest CTAs that keep its K-tiles per CTA (`*chunk`), so no
// CTA is empty. plan_t and the CPU replay (tests/cpp/wgmma_splits_test.cu) both go through it.
inline int plan_split(long long tiles, int ku, int num_sms, const Occupancy& occ, int split_cost, int forced,
                      int* chunk, long long* cost_out = nullptr) {
  int s = forced > 0 ? forced : choose_splits(tiles, ku, num_sms, occ, split_cost, cost_out);
  s = s < 1 ? 1 : s > occ.max_splits ? occ.max_splits : s > ku ? ku : s;
  *chunk = div_up(ku, s);
  return div_up(ku, *chunk);
}

// Split-K over G > 1 clusters of c CTAs each, the clusters' sums added through a global
// workspace (the kernel's epilogue): for layers whose few tiles leave SMs idle at one CTA per SM
// because the clusters that would fill them do not all fit. The H200 holds 30 clusters of 4
// (of 132 SMs), so the 32 tiles of 4096 columns at 129..256 tokens ran as clusters of 3 on 96
// SMs; as two clusters of 2 a tile they take 128. Each CTA then writes its slice of the tile's
// cluster sum (128 KB / c at MT = 128) and the last of the G reads G of them: kGroupSliceCost
// per 128 KB in choose_splits' units, as much as a cluster's own reduction (kSplitCost128).
// Measured on the H200 (8B decode graph, K=4, alternated twice in one call, docs/MMA.md): at
// M = 256, 4096x14336 took 71.8 / 74.3 -> 67.0 / 66.2 us as two clusters of 2; a probe build
// had 4096x4096 at 27.8 -> 28.4 (its reduction weighs more against its shorter K range). With
// this cost the plan groups the first and not the second. Only at MT = 128 (one CTA per SM), never past one wave, never with a
// forced split; KBIT_WGMMA_GROUPS = 1 turns it off, = G >= 2 forces G (tuning and tests).
// Not at the 64-token tiles built for one CTA per SM either: 4096x14336 at 33..64 tokens as
// four clusters of 2 a tile took 31.5 -> 31.9 us in the decode graph (one call, alternated
// twice, docs/MMA.md), once the slice's stores were waited for before the counter moved.
constexpr int kGroupSliceCost = 40;
inline int choose_groups(long long tiles, int ku, int num_sms, const Occupancy& occ, int split_cost, int s,
                         int* c_out, long long* cost_out = nullptr) {
  constexpr int kAlone = 10, kFixed = 3 * kAlone;  // choose_splits' units, one CTA per SM
  const auto cost = [&](int c, int g) -> long long {
    const long long waves = cluster_waves(tiles * g, occ, c, false, num_sms);
    return waves * (div_up(ku, c * g) * kAlone + kFixed + (c * g > 1 ? split_cost : 0) +
                    (g > 1 ? kGroupSliceCost * (g + 1) / c : 0));
  };
  long long best = cost(s, 1);
  int best_g = 1;
  *c_out = s;
  for (int c = 1; c <= kPortableSplits; ++c)
    for (int g = 2; c * g <= kMaxSplits && tiles * c * g <= num_sms; ++g) {
      const int chunk = div_up(ku, c * g);
      if (chunk < 2 || (long long)(c * g - 1) * chunk >= ku) break;  // no CTA without K-tiles
      const long long v = cost(c, g);
      if (v < best) best = v, best_g = g, *c_out = c;
    }
  if (cost_out != nullptr) *cost_out = best;
  return best_g;
}

// 256-token tiles (Cfg::kTall: 128 columns) or the 128-token plan, by choose_splits' cost in its
// units: a tall CTA's K-tile costs kTallK / 10 of choose_splits' units (0.88 of a lone 128-token
// CTA's K-tile at kAlone = 10), and no fixed cost unsplit. Never where the last token tile holds 64 rows
// or fewer: those ran far slower than a full tile on the same grid (57344x8192 at M = 320 844 us
// against 653 at M = 448, 8192x28672 471 against 311; the rows past M, docs/MMA.md). Fitted on
// the H200 to a sweep of both forced, eight shapes, M = 320..1000 (K=4; tests/test_wgmma_plan.py
// replays it): the pick runs within 4% of the faster everywhere except five cases where the
// 128-token plan it keeps is 5-16% slower.
// One tile from 192 rows: at M = 192..256 the same cost model takes it on the wide layers
// (28672x4096 99.5 against 109.4 us at M = 192, 57344x8192 382 / 397; the 8B step 0.94-0.97x at
// K = 2..5, the 70B layers' 0.93x), while at M = 160 the tall tile ran slower there (118 / 108,
// 451 / 396 us; the step 1.07x): the rows past M again, whose TMA zero fill is what costs (two
// probes that skip them, docs/MMA.md; H200, tall_one_tile_probe_2535e04.json).
// Split along K (thirty-sixth session): where the unsplit tall grid leaves SMs idle (fewer than
// two waves of tall CTAs) the tall CTAs may run in clusters of 2..kTallMaxSplits along K, reduced
// through distributed shared memory as the 128-token CTAs' splits are, at a cost of
// kTallSplitCost + split_cost units a CTA besides its K-tiles, over the waves of clusters that fit
// (occupancy), against the 128-token plan's cost with its cluster groups where choose_groups
// takes them (they keep 4096x14336 at M = 192..256 at 128 tokens: 60.8 us against the tall
// split's 63.7 at 256). Before, the 128-token plan's split won there (4096x4096 and 4096x14336 at M = 512:
// 64 tall CTAs, 50.3 / 152.1 us against 38.6 / 103.1). Sweep of s = 1, 2, 3, 4, 6, 8 forced on
// eight shapes, M = 192..1000, K=4 (bench_gemm_wgmma_tall_split_sweep_cc915a1.json; H200; us,
// the plan before / the split): 4096x4096 M = 256 28.9 / 27.3 (s = 3), 512 37.2 / 34.8 (s = 2);
// 6144x4096 M = 256 36.3 / 34.2; 4096x14336 M = 512 102.6 / 92.6; 8192x8192 M = 768 180.5 / 163.6;
// 10240x8192 M = 512 177.9 / 161.1; 8192x28672 M = 256 191.4 / 173.5, 768 610.1 / 526.5. Clusters
// of 4 or more were never the fastest (the H200 holds 30 of 4), and where the model took them
// (10240x8192 at M = 192..256, three waves of clusters of 4) they ran 4-5% slower than unsplit:
// hence kTallMaxSplits = 3. The pick runs within 4% of the fastest forced configuration on all
// 56 cases but 4096x4096 at M = 384 (5%; tests/test_wgmma_plan.py replays it). Decode steps, split
// against KBIT_WGMMA_TALL_SPLIT=0, alternated twice in one call (bench_decode_tall_split_ab_*.json):
// Llama-3-8B 0.95-0.98x at M = 192..512 (K = 2..5), 1.00x at 768 and 1000; the 70B layers (16,
// K=4) 0.96-0.99x at M = 192..768, 1.00x at 1000.
// KBIT_WGMMA_TALL_MIN_M overrides the 192 (A/B);
// KBIT_WGMMA_TILE_M = 256 / 128 forces either tile (tile_m); forced 256-token tiles run unsplit
// unless the split is forced too.
constexpr int kTallMinM = 192;
constexpr int kTallK = 88;  // tenths of choose_splits' units
// a split tall CTA's cost besides its K-tiles and its reduction (split_cost), in choose_splits'
// units: its kFixed (pipeline fill, table)
constexpr int kTallSplitCost = 30;
constexpr int kTallMaxSplits = 3;
// A split must cost under kTallSplitGain / 10 of the unsplit tall plan: the model overrates the
// split where the unsplit grid fills the SMs already (6144x4096 at M = 1000, two waves of 96 + 96
// CTAs: 6% predicted for clusters of 2, 2% measured alone, and the 8B decode step 1.1-1.6% slower
// at K = 2..4 with it; 8192x8192 at M = 768: 16% predicted, 9% measured).
constexpr int kTallSplitGain = 9;
// Returns 0 for the 128-token plan, else the tall plan's split (1: unsplit).
// allow_split: plan_t passes m <= wgmma_short_max_m, so above it (where the tile picks
// kbit::gemm's path, auto_path) the plan is the unsplit model the path rule was measured with.
inline int choose_tall(int m, int n, int ku, int num_sms, const Occupancy& occ128, const Occupancy& occ_tall,
                       int split_cost, bool allow_split = true) {
  if (m < env_int("KBIT_WGMMA_TALL_MIN_M", kTallMinM) || m - 256 * (div_up(m, 256) - 1) <= 64) return 0;
  const long long tiles128 = (long long)div_up(n_units(n), 256 / kUnitN) * div_up(m, 128);
  const long long tiles_tall = (long long)div_up(n_units(n), 128 / kUnitN) * div_up(m, 256);
  // the 128-token plan: its split, or cluster groups where plan_t would take them
  long long cost128 = 0;
  int chunk = 0;
  const int s128 = plan_split(tiles128, ku, num_sms, occ128, split_cost, 0, &chunk, &cost128);  // as plan_t
  if (env_int("KBIT_WGMMA_GROUPS", 0) == 0) {
    long long cost_g = cost128;
    int c = s128;
    choose_groups(tiles128, ku, num_sms, occ128, split_cost, s128, &c, &cost_g);
    cost128 = cost_g < cost128 ? cost_g : cost128;
  }
  const long long unsplit = div_up(tiles_tall, (long long)num_sms) * ku * kTallK;  // tenths of units
  long long best = unsplit;
  int best_s = 1;
  if (allow_split && tiles_tall < 2 * num_sms && env_int("KBIT_WGMMA_TALL_SPLIT", 1) != 0) {
    const int over = env_int("KBIT_WGMMA_TALL_SPLIT_COST", kTallSplitCost + split_cost);
    for (int s = 2; s <= kTallMaxSplits && div_up(ku, s) >= 2; ++s) {
      const long long waves = cluster_waves(tiles_tall, occ_tall, s, false, num_sms);
      const long long cost = waves * (div_up(ku, s) * kTallK + 10LL * over);
      if (cost < best && cost * 10 < unsplit * kTallSplitGain) best = cost, best_s = s;
    }
  }
  return best < cost128 * 10 ? best_s : 0;
}

// Debug overrides for tuning, read on every call, unset in production:
// KBIT_WGMMA_TILE_M = 16 | 32 | 64 | 128 | 256, KBIT_WGMMA_WIDE = 1 (512-column CTAs at tiles <= 64),
// KBIT_WGMMA_SPREAD = 0 (never launch spread), KBIT_WGMMA_ROWSPLIT = 1 | 2 (at MT = 32) and
// KBIT_WGMMA_MAX_SPLITS = 1..16 (the largest cluster choose_splits considers),
// KBIT_WGMMA_SPLIT_COST = 0.. (choose_splits' reduction cost at MT = 128; 0 = the plan before it),
// KBIT_WGMMA_GROUPS = 1 | G (choose_groups), KBIT_WGMMA_Y_TMA = 0 (unsplit calls store y
// element by element instead of through shared memory and TMA; A/B and the tests),
// KBIT_WGMMA_TALL_MIN_M (choose_tall's first M), KBIT_WGMMA_TALL_SPLIT = 0 (the tall CTAs unsplit,
// as before they could split; A/B), KBIT_WGMMA_TALL_SPLIT_COST (choose_tall's cost of a split tall
// CTA besides its K-tiles). Above wgmma_short_max_m the tile they give also
// picks kbit::gemm's path (auto_path: wgmma only at 256-token tiles).
// (256-token tiles: plan_t asks choose_tall where this gives 128)
inline int tile_m(int m) {
  const int t = env_int("KBIT_WGMMA_TILE_M", 0);
  if (t == 16 || t == 32 || t == 64 || t == 128 || t == 256) return t;
  return m <= 16 ? 16 : m <= 32 ? 32 : m <= 64 ? 64 : 128;
}

// The instantiations a plan can pick, (MT, CN, R, CPS): 512-column CTAs without a row split, one
// per SM; R = 1 at MT = 16; R = 1 or 2 at MT = 32; R = 2 at MT = 64 (two or one per SM) and 128
// (one per SM). Calls f(MT, CN, R, CPS) with the one the plan names, as integral constants (the
// single list both the occupancy queries and the launch go through).
template <int V> using IntC = std::integral_constant<int, V>;
template <typename F> decltype(auto) with_instantiation(int mt, int cn, int rs, int cps, F&& f) {
  if (mt == 256) return f(IntC<256>{}, IntC<128>{}, IntC<2>{}, IntC<1>{});
  if (cn == 512) {
    if (mt == 16) return f(IntC<16>{}, IntC<512>{}, IntC<1>{}, IntC<1>{});
    if (mt == 32) return f(IntC<32>{}, IntC<512>{}, IntC<1>{}, IntC<1>{});
    return f(IntC<64>{}, IntC<512>{}, IntC<1>{}, IntC<1>{});
  }
  switch (mt) {
    case 16: return f(IntC<16>{}, IntC<256>{}, IntC<1>{}, IntC<2>{});
    case 32:
      return rs == 2 ? f(IntC<32>{}, IntC<256>{}, IntC<2>{}, IntC<2>{}) : f(IntC<32>{}, IntC<256>{}, IntC<1>{}, IntC<2>{});
    case 64: return cps == 1 ? f(IntC<64>{}, IntC<256>{}, IntC<2>{}, IntC<1>{}) : f(IntC<64>{}, IntC<256>{}, IntC<2>{}, IntC<2>{});
    default: return f(IntC<128>{}, IntC<256>{}, IntC<2>{}, IntC<1>{});
  }
}

template <int BITS, typename T> const Occupancy& occupancy_for(int mt, int cn, int rs, int cps) {
  return with_instantiation(mt, cn, rs, cps, [](auto m, auto c, auto r, auto q) -> const Occupancy& {
    return occupancy<BITS, decltype(m)::value, decltype(c)::value, decltype(r)::value, decltype(q)::value, T>();
  });
}

// One CTA per SM at MT = 64 (Cfg CPS = 1): the producer warpgroup, the wide table at K = 3, 4
// and eight stages, where two CTAs per SM hold four stages and the packed table. Measured on the
// H200 (scripts/wgmma_dev.py base against a build of MT = 64 at one per SM, K=4 fp16, L2 flushed,
// forced splits 1..12 and each plan's own, one call, 2476a70; us at M = 64, two per SM / one):
// 4096x14336 36.5 / 34.2, 4096x4096 18.1 / 16.7, 6144x4096 21.5 / 19.6, 28672x4096 49.9 / 49.6,
// 57344x8192 162.3 / 176.9, 8192x28672 88.6 / 105.4 (its best split 106.4). A lone CTA runs a K-tile
// in ~0.69 us, each of two sharing an SM in ~1.27 (0.64 per SM), so one per SM wins only where
// it gives no SM more K-tiles than the two-per-SM plan's busiest SM (fewer, longer splits: less
// cluster reduction and pipeline fill per K-tile) and runs in one wave: layers with few column
// groups. And only where it is `deeper` (more stages than two per SM have: K = 3..5, whose
// tables and units leave those 4-6; at K=2 both have 8, and one per SM took Llama-3-8B's
// gate_up 1.05-1.08x the time at M = 33..64, docs/MMA.md).
// Given the two-per-SM plan (occ2, split *s, *chunk K-tiles a CTA, launched spread or not),
// returns whether to take one per SM, and then its own split in *s and *chunk (a forced split
// stays). KBIT_WGMMA_ONE = 0 / 1 forces it off / on at MT = 64 (tuning and tests). plan_t and
// the CPU replay (tests/cpp/wgmma_splits_test.cu) both go through it.
template <int BITS> constexpr bool one_per_sm_deeper() {
  return Cfg<BITS, 64, 256, 2, 1>::kStages > Cfg<BITS, 64, 256, 2, 2>::kStages;
}
inline bool one_per_sm(long long tiles, int ku, int num_sms, const Occupancy& occ2, const Occupancy& occ1, int forced,
                       bool deeper, bool spread, int* s, int* chunk) {
  const int force = env_int("KBIT_WGMMA_ONE", -1);
  if (force == 0 || (force != 1 && !deeper)) return false;
  int chunk1 = 0;
  const int s1 = plan_split(tiles, ku, num_sms, occ1, 0, forced, &chunk1);
  const int resident = occ1.clusters[s1][0];  // clusters of s1 that fit at once
  const bool take = force == 1 || (tiles * s1 <= num_sms && resident >= tiles &&
                                   chunk1 <= busiest_ctas(occ2, tiles * *s, num_sms, spread) * *chunk);
  if (take) *s = s1, *chunk = chunk1;
  return take;
}

// Row split (Cfg) of a 256-column CTA. Measured on the H200 (wgmma_dev.py, K=4 fp16, L2
// flushed, R = 1 against 2 in the same call, us; and decode steps of bench_decode.py):
//   * MT = 64: R = 2 is never slower at K=4: 4096x4096 20.6 -> 18.0, 4096x14336 41.2 -> 37.5,
//     28672x4096 51.8 -> 49.8, 57344x8192 161.8 -> 161.4, 8192x28672 88.6 -> 88.6 (K = 2, 3, 5
//     not measured with R = 1 here).
//   * MT = 32: R = 2 wins where a CTA runs few K-tiles (4096x14336, 38 per CTA: 36.0 -> 34.8;
//     4096x4096, 11: 17.4 -> 17.0) and loses where it runs many (57344x8192, 128: 134.0 ->
//     138.8; 8192x28672, 64: 74.0 -> 76.5), so R = 2 up to kShortChunk K-tiles. The 8B decode
//     step at M = 32 (every layer <= 38 per CTA), R = 1 -> 2: K=2 2862 -> 2745, K=3 3423 ->
//     3271, K=4 3169 -> 3135, K=5 4281 -> 4158 us.
//   * MT = 16 (forced paths only since the GEMV serves M <= 16; measured when dispatch sent
//     layers of >= one slab per SM at 8 < M <= 16 here): R = 1.
//     The same step at M = 16 (28672x4096 on this kernel), R = 2 -> 1: K=2 2725 -> 2362,
//     K=4 2579 -> 2543 us (K=3, K=5 within 0.6%).
//   * R = 4 (one 512-thread CTA per SM, one row tile per warpgroup; a probe build) was slower
//     wherever a grid needs more than one wave: 57344x8192 at M = 64 161.8 -> 230.0 us.
constexpr int kShortChunk = 48;

// 512-column CTAs (two warpgroups sharing one x tile) halve the x traffic per weight but halve
// the CTA count. With x loaded by cp.async they were 5-7% faster at M = 32..64 on 57344x8192
// and 28672x4096; since the TMA loads (538d5d1) 256-column CTAs are equal or faster on all six
// benchmark shapes at M = 16, 32, 64 (57344x8192 M = 64: 161.9 vs 170.0 us, 28672x4096: 50.8
// vs 55.2; bench_gemm.py with KBIT_WGMMA_WIDE=0 / 1 / unset, same call, H200). So the plan
// takes them only when forced (KBIT_WGMMA_WIDE=1, for tuning and the tests).
//
// The plan of one call: [tile_m, splits (CTAs per cluster), grid x (splits x cluster groups),
// grid y (token tiles), grid z (column groups), columns per CTA, CTAs per SM the launch allows
// (1 when spread or built for one), row split, CTAs per SM the kernel is built for
// (one_per_sm), cluster groups (choose_groups)]. `splits` > 0 forces the
// split factor (clamped to 1..min(the device's largest cluster: 16, or 8 without non-portable
// sizes; K-tiles)).
template <int BITS, typename T> void plan_t(Params& p, int splits, int num_sms, int* out) {
  int mt = tile_m(p.m);
  const int cost128 = env_int("KBIT_WGMMA_SPLIT_COST", kSplitCost128);  // the split cost at MT = 128
  const int groups_env = env_int("KBIT_WGMMA_GROUPS", 0);  // cluster groups: 0 = choose_groups
  // the tall CTA splits K in one cluster only: forced cluster groups keep 128 tokens
  const bool forced_split = splits > 1 || groups_env >= 2;
  if (mt == 256 && groups_env >= 2) mt = 128;
  int tall_split = 1;  // forced 256-token tiles: unsplit unless the split is forced too
  if (mt == 128 && splits == 0 && !forced_split && env_int("KBIT_WGMMA_TILE_M", 0) == 0) {
    const int t = choose_tall(p.m, p.n, p.ku_count, num_sms, occupancy_for<BITS, T>(128, 256, 2, 1),
                              occupancy_for<BITS, T>(256, 128, 2, 1), cost128, p.m <= wgmma_short_max_m(BITS));
    if (t > 0) mt = 256, tall_split = t;
  }
  const int gz = div_up(p.m, mt);
  const int cn = mt == 256 ? 128 : mt <= 64 && env_int("KBIT_WGMMA_WIDE", 0) == 1 ? 512 : 256;
  const int gy = div_up(n_units(p.n), cn / kUnitN);
  const long long tiles = (long long)gy * gz;
  // the split from R = 1's occupancy at MT <= 32 (the same two CTAs per SM as R = 2)
  const int rs_split = cn == 512 || mt <= 32 ? 1 : 2;
  const Occupancy& occ_split = occupancy_for<BITS, T>(mt, cn, rs_split, default_cps(mt, cn, rs_split));
  const int split_cost = mt == 128 ? cost128 : 0;
  int s = plan_split(tiles, p.ku_count, num_sms, occ_split, split_cost, mt == 256 && splits == 0 ? tall_split : splits, &p.chunk);
  int rs = cn == 512 || mt == 16 ? 1 : mt >= 64 || p.chunk <= kShortChunk ? 2 : 1;
  const int rs_force = env_int("KBIT_WGMMA_ROWSPLIT", 0);
  if (cn == 256 && mt == 32 && (rs_force == 1 || rs_force == 2)) rs = rs_force;
  int cps = default_cps(mt, cn, rs);
  const Occupancy& occ = occupancy_for<BITS, T>(mt, cn, rs, cps);
  bool spread = fits_spread(occ, tiles * s, num_sms) && env_int("KBIT_WGMMA_SPREAD", 1) != 0;
  if (mt == 64 && cn == 256 &&
      one_per_sm(tiles, p.ku_count, num_sms, occ, occupancy_for<BITS, T>(64, 256, 2, 1), splits,
                 one_per_sm_deeper<BITS>(), spread, &s, &p.chunk))
    cps = 1, spread = false;
  // cluster groups (choose_groups): s becomes the cluster size, the grid s x groups along K
  int groups = 1;
  if (groups_env >= 2) {
    groups = groups_env;
  } else if (groups_env == 0 && splits == 0 && mt == 128) {  // one CTA per SM
    groups = choose_groups(tiles, p.ku_count, num_sms, occ_split, split_cost, s, &s);
  }
  // (a forced G: at most what leaves every CTA a K-tile)
  while (groups > 1 && (long long)(s * groups - 1) * div_up(p.ku_count, s * groups) >= p.ku_count) --groups;
  if (groups > 1) {
    p.chunk = div_up(p.ku_count, s * groups);
    spread = false;
  }
  p.groups = groups;
  out[0] = mt; out[1] = s; out[2] = s * groups; out[3] = gz; out[4] = gy; out[5] = cn;
  out[6] = spread || cps == 1 ? 1 : occ.per_sm; out[7] = rs; out[8] = cps; out[9] = groups;
}

// Workspace of a plan (plan_t's out[]): none without cluster groups; else a counter per tile and
// cluster rank (256 B steps), then each group's fp32 sum of every tile.
inline size_t group_counters(const int* pl) { return pl[9] > 1 ? size_t(pl[3]) * pl[4] * pl[1] : 0; }
inline size_t group_counter_bytes(const int* pl) { return (group_counters(pl) * sizeof(int) + 255) / 256 * 256; }
inline size_t workspace_bytes(const int* pl) {
  return pl[9] > 1 ? group_counter_bytes(pl) + size_t(pl[3]) * pl[4] * pl[9] * pl[5] * pl[0] * sizeof(float) : 0;
}

template <int BITS, typename T>
cudaError_t launch_t2(Params p, int splits, int num_sms, cudaStream_t stream, int* plan) {
  int local[kPlanInts];
  int* pl = plan != nullptr ? plan : local;
  plan_t<BITS, T>(p, splits, num_sms, pl);
  if (plan != nullptr && p.x == nullptr) return cudaSuccess;  // plan query only
  if (p.groups > 1) {  // the workspace (p.partial): counters, then the clusters' sums (workspace_bytes)
    if (p.partial == nullptr) return cudaErrorInvalidValue;
    const size_t counter_bytes = group_counter_bytes(pl);
    if (p.counters == nullptr || group_counters(pl) > size_t(kWgmmaZeroedCounters)) {
      p.counters = reinterpret_cast<int*>(p.partial);
      const cudaError_t e = cudaMemsetAsync(p.counters, 0, counter_bytes, stream);  // graph-capturable
      if (e != cudaSuccess) return e;
    }  // else the caller's counters, zero and left zero by every launch (self-reset)
    p.partial = reinterpret_cast<float4*>(reinterpret_cast<char*>(p.partial) + counter_bytes);
  }
  const bool spread = pl[6] == 1 && occupancy_for<BITS, T>(pl[0], pl[5], pl[7], pl[8]).per_sm > 1;
  if (pl[0] == 256 && pl[2] > 1)  // the tall CTAs split along K: their own build (kSplitTall)
    return launch_t<BITS, 256, 128, 2, 1, T, true>(p, pl[2], false, stream);
  return with_instantiation(pl[0], pl[5], pl[7], pl[8], [&](auto m, auto c, auto r, auto q) {
    return launch_t<BITS, decltype(m)::value, decltype(c)::value, decltype(r)::value, decltype(q)::value, T>(
        p, pl[2], spread, stream);  // grid x: the split x the cluster groups
  });
}

// Entry point of one bit width (instantiated in generated/wgmma_k<BITS>.cu). With `plan`
// non-null and x null, only fills the plan.
template <int BITS>
cudaError_t launch_bits(DType dtype, const Params& p, int splits, int num_sms, cudaStream_t stream, int* plan) {
  if (dtype == DType::kHalf) return launch_t2<BITS, __half>(p, splits, num_sms, stream, plan);
  if (dtype == DType::kBFloat16) return launch_t2<BITS, __nv_bfloat16>(p, splits, num_sms, stream, plan);
  return cudaErrorInvalidValue;
}

}  // namespace wg
}  // namespace kbit
