// kbit GEMM with FP8 (e4m3) activations on Hopper's wgmma (sm_90a), for the tensor-core range
// of M: y[M, N] = (x_q[M, K] @ w_q[N, K]^T) * s_x[m] * 2^-r (+ bias), torch-free. The function
// it computes, operand roundings included, is vllm_kbit/fp8.py's reference (gemm_fp8_reference).
//
// Same scheme as the fp16 wgmma kernel (wgmma/kernel.cuh): Y^T = W X^T, the weights
// decoded in registers as wgmma's register-sourced A operand, x by TMA in shared memory as B.
//   * decode: the fp16 pair tables of core/decode.cuh with 16 * 2^r folded into the codebook (r:
//     the layer's weight exponent, so every weight times 2^r lies in e4m3's range), one HMUL2 by
//     the block's E4M4 scale, then one cvt.rn.satfinite.e4m3x2.f16x2 a pair. A k32 e4m3 wgmma
//     is exactly one 32-block.
//   * no data crosses lanes: the 8-bit A fragment gives lane t the k positions {4t..4t+3,
//     16+4t..16+4t+3} of each row, the tiled layout gives it the k {2t, 2t+1, 2t+8, 2t+9, 2t+16,
//     2t+17, 2t+24, 2t+25} of each block. A dot product does not care about k order, so each
//     lane packs its own eight weights into its eight positions, and the activation quantizer
//     (quantize_act_kernel below) writes x_q with k permuted inside each 32-block to match
//     (act_source_k; the Python mirror is fp8.k_permutation).
//   * CTA: one consumer warpgroup and a producer warp, 128 columns (two 64-column slabs) x MT tokens. Warp w decodes slab
//     w & 1, row tiles 2 (w >> 1) and 2 (w >> 1) + 1 of it, i.e. plane word h = w >> 1 of each
//     block, so each wgmma m64 takes one row tile from each warp (the epilogue maps rows back).
//     Two accumulator sets of 64 x MT: MT fp32 a thread. Two CTAs per SM (K=5 at MT = 128: one,
//     214 registers). MT = 256 (Cfg::kTall): two consumer warpgroups, each warp one row tile, so
//     each decoded weight feeds 256 tokens; one CTA per SM. CN = 256 columns (Cfg::kWide): two
//     consumer warpgroups on four slabs sharing the x tile, half the x traffic; one CTA per SM.
//   * K-tile = 128 k (two layout units), so the x tile has the same 128-byte rows and 128 B
//     swizzle as the fp16 kernel's and a k32 step is +32 B on the descriptor; one mbarrier a
//     stage (x box + each slab's planes and absmax: four bulk copies, one arrival).
//   * per block: decode into one of two A buffers, two wgmma (one per row-tile set), commit,
//     wait_group 1: the tensor cores multiply block b while the warps decode block b + 1.
//     After block 0 of tile t every group of tile t - 1 has retired, so each consumer thread
//     then hands tile t - 1's stage back (an "empty" mbarrier) and a producer warp refills it
//     with tile t + kStages - 1: no CTA barrier in the loop, no load issue between wgmmas.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <type_traits>

#include "core/common.cuh"
#include "core/decode.cuh"
#include "core/layout.cuh"
#include "wgmma/ptx.cuh"
#include "wgmma_fp8/fp8_config.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KBIT_FP8_DEVICE 1
#else
#define KBIT_FP8_DEVICE 0
#endif

namespace kbit {
namespace fp8 {

constexpr float kE4m3Max = 448.f;
// s_x = max(amax, kAmaxFloor) / 448 stays a normal fp32 (fast math flushes subnormals), so an
// all-zero row quantizes to zeros rather than 0 / 0.
constexpr float kAmaxFloor = 0x1p-64f;
// The pair table holds fp16(cb * 16 * 2^r): r <= 11 keeps 16 * 2^r * |cb| <= 32768 finite.
constexpr int kMaxWeightExp = 11;
constexpr int kMinWeightExp = -24;

struct Params {
  const float* x_scale;     // [m] s_x
  const uint32_t* packed;   // tiled layout (core/layout.cuh)
  const uint8_t* absmax;    // tiled layout
  const float* codebook;    // [2^bits]
  const void* bias;         // [n] of the output type, or nullptr
  void* y;                  // [m, n] fp16 / bf16
  int m, n, k;
  int ku_count;             // k_units(k)
  int w_exp;                // r
};

// Inside a 32-block, x_q position p (what the A fragment's byte i of register 0 / 2 of lane t
// meets: p = 16 half + 4 t + i) holds x at this k. Lane t's pairs come from the decoder as
// elements (e, e + 4) (K = 3..5) or (0,2), (1,3), (4,6), (5,7) (K = 2); pairs 0, 1 fill register
// 0 (bytes lo, hi, lo, hi), pairs 2, 3 register 2; element e of the layout byte is at
// k = 16 (e >> 2) + 8 ((e >> 1) & 1) + 2 t + (e & 1) (core/layout.cuh).
__host__ __device__ constexpr int act_element(int bits, int p) {
  const int half = p >> 4, i = p & 3, pair = 2 * half + (i >> 1), hi = i & 1;
  return bits == 2 ? (pair >> 1) * 4 + (pair & 1) + 2 * hi : pair + 4 * hi;
}
__host__ __device__ constexpr int act_source_k(int bits, int p) {
  if (bits == 0) return p;  // natural order: the x of the dequantize + scaled_mm path
  const int t = (p >> 2) & 3, e = act_element(bits, p);
  return 16 * (e >> 2) + 8 * ((e >> 1) & 1) + 2 * t + (e & 1);
}

template <int BITS, int MT, int CN> struct Cfg {
  static_assert(MT == 64 || MT == 128 || MT == 256, "tokens per CTA (wgmma N): 64, 128 or 256");
  static_assert(CN == 128 || (CN == 256 && MT <= 128), "128 columns, or 256 up to 128 tokens");
  // The tall CTA (MT = 256): two consumer warpgroups on the same x tile, warp w of warpgroup wg
  // decoding only row tile 2 (w >> 1) + wg of slab w & 1 (one accumulator set of 64 x 256), so
  // each decoded weight feeds 256 tokens: half the decode per MMA of the 128-token tile. One CTA
  // per SM (its 128 fp32 accumulators a thread, 8 consumer warps).
  static constexpr bool kTall = MT == 256;
  // The wide CTA (CN = 256): two consumer warpgroups, each the 128-column CTA's work on slabs
  // 2 wg and 2 wg + 1, sharing one x tile: half the x traffic per MMA (the shared-memory fills
  // from L2 are what bound the 128 x 128 tile at large M). One CTA per SM.
  static constexpr bool kWide = CN == 256;
  static constexpr int kWG = kTall || kWide ? 2 : 1;        // consumer warpgroups
  static constexpr int kSets = kTall ? 1 : 2;                // accumulator sets (row tiles) a warp
  static constexpr int kConsumers = 128 * kWG;               // the warps that decode and multiply
  // and the loads' issuer: one warp; in the wide CTA a whole warpgroup, which gives its registers
  // to the consumers (setmaxnreg 40 / 232: 128 x 40 + 256 x 232 <= 64 K, launched with 168 a
  // thread). ptxas allocates a wgmma kernel's registers per warpgroup, so a lone producer warp
  // next to two consumer warpgroups caps them at 168 and serialises their wgmmas (C7512).
  static constexpr bool kProducerWG = kWide;
  static constexpr int kThreads = kConsumers + (kProducerWG ? 128 : 32);
  static constexpr int kSlabs = CN / kUnitN;                 // 64-column slabs per CTA
  static constexpr int kColumns = kSlabs * kUnitN;
  static constexpr int kTileUnits = 2;                       // layout units along K per K-tile
  static constexpr int kTileK = kTileUnits * kUnitK;         // 128 k: one 128 B swizzle row of e4m3
  static constexpr int kXBytes = MT * kTileK;
  static constexpr int kPlaneBytes = BITS * 512;             // one unit's planes
  static constexpr int kSlabPlaneBytes = kTileUnits * kPlaneBytes;
  static constexpr int kSlabAbsBytes = kTileUnits * kUnitAbsmaxBytes;
  static constexpr int kAbsOff = kXBytes + kSlabs * kSlabPlaneBytes;  // slab 0's absmax in a stage
  static constexpr int kWBytes = kSlabs * (kSlabPlaneBytes + kSlabAbsBytes);
  static constexpr int kStageBytes = kXBytes + (kWBytes + 1023) / 1024 * 1024;
  static constexpr int kLutBytes = PairTable<BITS>::kLutBytes;  // a multiple of 1 KB
  // shared memory: two CTAs per SM (228 KB, 1 KB each reserved), or the tall / wide CTA alone
  static constexpr int kBudget = kWG == 2 ? 226 * 1024 : 113 * 1024;
  static constexpr int kFit = (kBudget - 1024 - kLutBytes - 128) / kStageBytes;
  static constexpr int kStages = kFit > 6 ? 6 : kFit;
  static constexpr int kBytes = 1024 + kLutBytes + kStages * kStageBytes + 16 * kStages;
  static constexpr int kAcc = MT / 2;                        // fp32 a thread per accumulator set
  static_assert(kStages >= 3, "two K-tiles in flight while one is computed");
  static_assert(kBytes <= kBudget, "fits the CTAs per SM it is built for");
  static_assert(kXBytes % 1024 == 0 && kLutBytes % 1024 == 0, "x tiles start on 1 KB swizzle atoms");
};

// ----------------------------------------------------------------------------- PTX helpers

// The PTX wrappers it shares with the fp16 wgmma kernel (wgmma/ptx.cuh). The shared-memory
// descriptor's bytes are the same: the fp16 kernel's k16 step is this kernel's k32 step (+32 B).
using wg::fence_proxy_async;
using wg::smem_desc;
#if KBIT_FP8_DEVICE
using wg::bulk_load;
using wg::fence_regs;
using wg::mbar_arrive_expect_tx;
using wg::tma_load_2d;
using wg::wgmma_commit;
using wg::wgmma_fence;
using wg::wgmma_wait;
#endif

// e4m3 conversions exist from sm_89 on; the quantizer's other targets compile a trap body and
// the host never launches it there (fp8_launch.cu, supported()).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define KBIT_FP8_CVT 1
#else
#define KBIT_FP8_CVT 0
#endif
#if KBIT_FP8_CVT
// Two fp16 weights -> two e4m3 (lo half -> lo byte), round to nearest even, saturating.
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t h2) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(r) : "r"(h2));
  return r;
}
// Two fp32 -> two e4m3: lo -> byte 0, hi -> byte 1 (the instruction takes the high one first).
__device__ __forceinline__ uint32_t e4m3x2_f32(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif

#if KBIT_FP8_DEVICE
// D[64 x N] += A[64 x 32] (registers, e4m3: this warp's 16 rows) * B[32 x N] (shared memory,
// K-major e4m3, descriptor); fp32 accumulators.
template <int N> __device__ __forceinline__ void wgmma_e4m3(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc);
template <> __device__ __forceinline__ void wgmma_e4m3<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <> __device__ __forceinline__ void wgmma_e4m3<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <> __device__ __forceinline__ void wgmma_e4m3<256>(float (&d)[128], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, 1, 1, 1;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

// One block's A fragments (row tiles 2h + qp0 + r, r < SETS, of the warp's slab) from this
// lane's plane words of the block (word 2 kb + h) and the block's E4M4 codes.
template <int BITS, int SETS>
__device__ __forceinline__ void decode_block(const uint32_t (&planes)[BITS], uint32_t codes, uint32_t (&A)[SETS][4],
                                             uint32_t lut_addr, uint32_t table, int qp0) {
  Decoder<BITS, __half, false> dec;
  dec.load(planes);
#pragma unroll
  for (int r = 0; r < SETS; ++r) {
    const int qp = qp0 + r, q0 = 2 * qp, q1 = 2 * qp + 1;  // n8 groups 4h + q0 (rows g), 4h + q1 (rows g + 8)
    const uint32_t s0 = scale2<__half>(codes, q0), s1 = scale2<__half>(codes, q1);
    uint32_t c0[4], c1[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      c0[s] = e4m3x2_f16x2(hmul2<__half>(dec.pair(q0, s, lut_addr, table), s0));
      c1[s] = e4m3x2_f16x2(hmul2<__half>(dec.pair(q1, s, lut_addr, table), s1));
    }
    // registers: 0 row g (positions 4t..4t+3), 1 row g + 8, 2 row g (16 + 4t..), 3 row g + 8
    A[r][0] = c0[0] | (c0[1] << 16);
    A[r][1] = c1[0] | (c1[1] << 16);
    A[r][2] = c0[2] | (c0[3] << 16);
    A[r][3] = c1[2] | (c1[3] << 16);
  }
}
#endif  // KBIT_FP8_DEVICE

// Grid (token tiles, column groups): the token tiles of one column group run next to each
// other, so the W they share comes from DRAM once.
template <int BITS, int MT, int CN, typename T>
__global__ void __launch_bounds__(Cfg<BITS, MT, CN>::kThreads, 1) gemm_kernel(const Params p, const __grid_constant__ CUtensorMap xmap) {
#if KBIT_FP8_DEVICE
  using C = Cfg<BITS, MT, CN>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw_addr = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_addr);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  // consumer warp w of warpgroup wg: slab w & 1 (+ 2 wg in the wide CTA), plane word h = w >> 1,
  // row tiles 2h + qp0 + r
  const int wg = warp >> 2, slab = (C::kWide ? 2 * wg : 0) + (warp & 1), h = (warp >> 1) & 1;
  const int qp0 = C::kTall ? wg : 0;
  constexpr int kSets = C::kSets;
  const int m0 = blockIdx.x * MT;
  const int nus = n_units(p.n), ku_count = p.ku_count;
  const int nt = div_up(ku_count, C::kTileUnits);
  const uint32_t lut_base = base, stage0 = base + C::kLutBytes, bar0 = stage0 + C::kStages * C::kStageBytes;
  // one "full" mbarrier a stage (the producer's arrival and the stage's bytes) and one "empty"
  // (every consumer thread is done with the stage: its LDS read and its wgmma groups retired)
  const uint32_t empty0 = bar0 + 8 * C::kStages;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(bar0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, C::kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&xmap)) : "memory");
  }
  const uint32_t table = init_codebook<BITS, __half>(p.codebook, ldexpf(16.f, p.w_exp),
                                                     reinterpret_cast<uint32_t*>(smem), tid, C::kThreads);
  __syncthreads();  // barriers initialised, the pair table written

  if (warp >= C::kConsumers / 32) {
    if constexpr (C::kProducerWG) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    // The producer warp (one lane): K-tile i -> stage i % kStages once the consumers have handed
    // it back: the x box (zeros past M and K), then each slab's planes and absmax of the tile's
    // units (a slab past N copies the last one: read, never stored). Outside the consumers'
    // code, so no load issue sits between their wgmma instructions (ptxas serialises them then).
    if (warp == C::kConsumers / 32 && lane == 0) {
      for (int i = 0; i < nt; ++i) {
        const int sg = i % C::kStages, ku = i * C::kTileUnits, units = min(C::kTileUnits, ku_count - ku);
        if (i >= C::kStages) mbar_wait(empty0 + 8 * sg, ((i / C::kStages) - 1) & 1);
        fence_proxy_async();  // the consumers' reads of the stage (generic proxy) before the async writes
        const uint32_t st = stage0 + sg * C::kStageBytes, bar = bar0 + 8 * sg;
        mbar_arrive_expect_tx(bar, C::kXBytes + C::kSlabs * units * (C::kPlaneBytes + kUnitAbsmaxBytes));
        tma_load_2d(st, &xmap, ku * kUnitK, m0, bar);
#pragma unroll
        for (int sl = 0; sl < C::kSlabs; ++sl) {
          const int nu = min(int(blockIdx.y) * C::kSlabs + sl, nus - 1);
          const long long unit = (long long)nu * ku_count + ku;
          bulk_load(st + C::kXBytes + sl * C::kSlabPlaneBytes, p.packed + unit * unit_words(BITS),
                    units * C::kPlaneBytes, bar);
          bulk_load(st + C::kAbsOff + sl * C::kSlabAbsBytes, p.absmax + unit * kUnitAbsmaxBytes,
                    units * kUnitAbsmaxBytes, bar);
        }
      }
    }
    return;
  }
  if constexpr (C::kProducerWG) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const uint32_t lut_addr = opaque(lut_base + 4u * (lane % kLutReplicas));

  float acc[kSets][C::kAcc];
#pragma unroll
  for (int r = 0; r < kSets; ++r)
#pragma unroll
    for (int i = 0; i < C::kAcc; ++i) acc[r][i] = 0.f;
  uint32_t A[2][kSets][4];  // [buffer][accumulator set][register]
  for (int t = 0; t < nt; ++t) {
    const int sg = t % C::kStages;
    const uint32_t st = stage0 + sg * C::kStageBytes;
    mbar_wait(bar0 + 8 * sg, (t / C::kStages) & 1);
    const int units = min(C::kTileUnits, ku_count - t * C::kTileUnits);
    const uint32_t wst = st + C::kXBytes + slab * C::kSlabPlaneBytes, ast = st + C::kAbsOff + slab * C::kSlabAbsBytes;
#pragma unroll
    for (int blk = 0; blk < 2 * C::kTileUnits; ++blk) {
      const int u = blk >> 1, kb = blk & 1;
      uint32_t(&Ab)[kSets][4] = A[blk & 1];
      // this lane's plane words and codes of the block (word 2 kb + h of unit u), read per block:
      // the whole tile's at once take 20-30 more registers, which at K=5 cost the second CTA
      // of an SM. Past the last unit (odd unit count) the scale is 0: weights 0 against the
      // box's zeros, and no branch in the wgmma sequence (one costs its overlap, ptxas C7515).
      uint32_t pw[BITS];
#pragma unroll
      for (int b = 0; b < BITS; ++b) pw[b] = lds_u32(wst + u * C::kPlaneBytes + b * 512 + lane * 16 + (2 * kb + h) * 4);
      const uint32_t codes = u < units ? lds_u32(ast + u * kUnitAbsmaxBytes + g * 16 + (2 * kb + h) * 4) : 0u;
      decode_block<BITS, kSets>(pw, codes, Ab, lut_addr, table, qp0);
#pragma unroll
      for (int r = 0; r < kSets; ++r) fence_regs(acc[r]);
      wgmma_fence();
#pragma unroll
      for (int r = 0; r < kSets; ++r) wgmma_e4m3<MT>(acc[r], Ab[r], smem_desc(st + blk * 32));
      wgmma_commit();
#pragma unroll
      for (int r = 0; r < kSets; ++r) fence_regs(acc[r]);
      wgmma_wait<1>();  // the other buffer's group (the previous block) has retired
#pragma unroll
      for (int r = 0; r < kSets; ++r) fence_regs(Ab[r]);
      // after block 0 every group of tile t - 1 has retired: this thread is done with its stage
      // (each thread arrives: an arrival releases only its own reads)
      if (blk == 0 && t > 0) mbar_arrive(empty0 + 8 * ((t - 1) % C::kStages));
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int r = 0; r < kSets; ++r) fence_regs(acc[r]);

  // Epilogue: accumulator i of set r is column nu * 64 + 16 (2h + qp0 + r) + 8 (e >> 1) + g, token
  // m0 + 8 j + 2 t + (e & 1) (e = i & 3, j = i >> 2); times s_x[token] * 2^-r, plus bias.
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  const int nu = blockIdx.y * C::kSlabs + slab;
  const float wscale = ldexpf(1.f, -p.w_exp);
#pragma unroll
  for (int j = 0; j < MT / 8; ++j) {
    float sx[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = m0 + 8 * j + 2 * t4 + e;
      sx[e] = row < p.m ? p.x_scale[row] * wscale : 0.f;
    }
#pragma unroll
    for (int r = 0; r < kSets; ++r)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nu * kUnitN + 16 * (2 * h + qp0 + r) + 8 * (e >> 1) + g, row = m0 + 8 * j + 2 * t4 + (e & 1);
        if (nu < nus && col < p.n && row < p.m) {
          float v = acc[r][4 * j + e] * sx[e & 1];
          if (bias != nullptr) v += to_float(bias[col]);
          y[(long long)row * p.n + col] = from_float<T>(v);
        }
      }
  }
#else
  __trap();
#endif
}

// ----------------------------------------------------------------------------- host side

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
// x_q [m][k] bytes as a 2-D TMA map: boxes of 128 k x `mt` tokens in the 128 B swizzle, zeros
// out of bounds. Encoded per call on the host: a CUDA graph keeps the captured copy.
inline cudaError_t make_xq_map(const uint8_t* xq, int m, int k, int mt, CUtensorMap* map) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {cuuint64_t(k), cuuint64_t(m)};
  const cuuint64_t strides[1] = {cuuint64_t(k)};
  const cuuint32_t box[2] = {128u, cuuint32_t(mt)};
  const cuuint32_t unit_stride[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(xq), dims, strides, box,
                            unit_stride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <int BITS, int MT, int CN, typename T>
cudaError_t launch_tile(const Params& p, const uint8_t* xq, cudaStream_t stream) {
  using C = Cfg<BITS, MT, CN>;
  alignas(64) CUtensorMap xmap;
  const cudaError_t e = make_xq_map(xq, p.m, p.k, MT, &xmap);
  if (e != cudaSuccess) return e;
  const auto kernel = gemm_kernel<BITS, MT, CN, T>;
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kBytes);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(div_up(p.m, MT), div_up(n_units(p.n), C::kSlabs));
  kernel<<<grid, C::kThreads, C::kBytes, stream>>>(p, xmap);
  return cudaGetLastError();
}

// The selector's entry of one instantiation (fp8_kernels.h, generated).
template <int BITS, int MT, int CN, typename T>
constexpr Fp8Kernel kernel_entry() {
  constexpr cudaError_t (*launch)(const Params&, const uint8_t*, cudaStream_t) = &launch_tile<BITS, MT, CN, T>;
  return {launch};
}

// Per-token e4m3 quantization of x [M, K] (K % 32 == 0): s_x[m] = max(amax_m, floor) / 448,
// x_q = e4m3_rn_satfinite(x / s_x), k permuted inside each 32-block for `bits` (act_source_k;
// BITS = 0: natural order).
// One CTA a row: pass 1 the row's amax, pass 2 (the row again, from L1 / L2) the quantization,
// one thread a 32-block: 64 B in, 32 B out.
template <typename T, int BITS>
__global__ void __launch_bounds__(256) quantize_act_kernel(const T* __restrict__ x, uint8_t* __restrict__ xq,
                                                           float* __restrict__ scale, int k) {
#if KBIT_FP8_CVT
  const int row = blockIdx.x, nb = k / 32;
  const T* xr = x + (long long)row * k;
  float amax = 0.f;
  for (int i = threadIdx.x; i < k / 8; i += blockDim.x) {
    const uint4 v = *reinterpret_cast<const uint4*>(xr + 8 * i);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      using V = typename Vec2<T>::type;
      const V h2 = *reinterpret_cast<const V*>(&w[c]);
      amax = fmaxf(amax, fmaxf(fabsf(to_float(h2.x)), fabsf(to_float(h2.y))));
    }
  }
  __shared__ float red[8];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = red[0];
  for (int w = 1; w < int(blockDim.x >> 5); ++w) amax = fmaxf(amax, red[w]);
  const float s = __fdiv_rn(fmaxf(amax, kAmaxFloor), kE4m3Max);
  if (threadIdx.x == 0) scale[row] = s;
  for (int b = threadIdx.x; b < nb; b += blockDim.x) {
    float v[32];
    const uint4* src = reinterpret_cast<const uint4*>(xr + 32 * b);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint4 u = src[q];
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        using V = typename Vec2<T>::type;
        const V h2 = *reinterpret_cast<const V*>(&w[c]);
        v[8 * q + 2 * c] = to_float(h2.x);
        v[8 * q + 2 * c + 1] = to_float(h2.y);
      }
    }
    uint32_t out[8];
#pragma unroll
    for (int o = 0; o < 8; ++o) {
      const uint32_t lo = e4m3x2_f32(__fdiv_rn(v[act_source_k(BITS, 4 * o)], s), __fdiv_rn(v[act_source_k(BITS, 4 * o + 1)], s));
      const uint32_t hi = e4m3x2_f32(__fdiv_rn(v[act_source_k(BITS, 4 * o + 2)], s), __fdiv_rn(v[act_source_k(BITS, 4 * o + 3)], s));
      out[o] = lo | (hi << 16);
    }
    uint4* dst = reinterpret_cast<uint4*>(xq + (long long)row * k + 32 * b);
    dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
    dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
  }
#else
  __trap();
#endif
}

}  // namespace fp8
}  // namespace kbit
