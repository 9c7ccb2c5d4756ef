// kbit tensor-core GEMM on mma.sync (y[M,N] = x[M,K] @ dequant(W)^T), torch-free: the path for
// 16 < M < 512 on GPUs without the wgmma kernel. Planned by dispatch/mma_plan.h; instantiated per
// bit width in mma/instantiations/mma_k<BITS>.cu.
//
//   * mma.sync m16n8k16, fp16 or bf16 fragments, fp32 accumulators. TILE_K = 64 = one layout
//     unit = two 32-blocks, so a scale never straddles a K-tile. A warp owns 16*MB rows x 32
//     columns (half a 64-column layout unit: the lane's words h and 2+h of each plane); at
//     MB = 8 each dequantized B fragment feeds 8 MMAs, which halves the dequant instructions
//     per MMA against a 64 x 64 warp tile with the same 128 accumulators.
//   * x (A) goes global -> shared with cp.async (16 B, zero-fill for the M and K tails) into
//     an XOR-swizzled tile that ldmatrix.x4 reads without bank conflicts.
//   * W (B) goes global -> shared with cp.async as the raw unit bytes (the layout is already
//     in fragment order); each lane reads its own 16 B per bit-plane with one conflict-free
//     LDS.128: no shared-memory write-back, no ldmatrix for B.
//   * dequant in registers: the bit-planes of 8 weights sit in one byte per plane; 2*bits-1
//     shift/mask ops turn the plane words into 8 nibble indices at once (4 byte indices for
//     K = 5); the codebook lives in registers (lane l holds entry l mod 2^K, so an index
//     word's bits above K never matter) and is read with one shfl per weight (why shuffles:
//     constant memory serialises divergent reads, a shared table adds LSU traffic next to
//     ldmatrix, and a prmt table covers 4 fp16 entries only); the E4M4 scale is decoded once
//     per (column, block, K-tile) with a prmt and a shift (E4M4(c) == 16 * fp16_from_bits(c
//     << 6); bf16: E4M4(c) == 2^116 * bf16_from_bits(c << 3)), the constant folded into the
//     codebook registers, so a weight is codebook * scale with a single rounding.
//   * 6-stage cp.async pipeline, 4 K-tiles ahead, one cp.async wait + __syncthreads per two
//     K-tiles; it runs straight across work items (the next tile's first K-tiles are in flight
//     during the epilogue).
//   * persistent grid over (m-tile, n-tile, k-chunk) work items in an L2-friendly grouped
//     order; split-K with a deterministic reduction: every k-chunk writes its fp32 partial
//     (fragment order, coalesced) to the workspace, the last one to arrive (per-tile atomic
//     counter, zeroed on-stream) sums all chunks in k-chunk order and writes y. Bitwise
//     deterministic; the grid and workspace depend on the shapes only (graph safe).
//   * three tile configs (32, 64, 128 rows x 256 columns, 8 warps; mma_plan.h cfg_desc).
// 128 accumulators per thread leave 2 warps per scheduler, and several instructions per HMMA
// (ldmatrix, shuffles, index math) keep the tensor pipe about half busy at large M, which is why
// dispatch sends large M to dequantize + cuBLAS and Hopper to the wgmma kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/common.cuh"
#include "core/decode.cuh"
#include "core/layout.cuh"
#include "mma/mma_config.h"

namespace kbit {
namespace mma {

constexpr int kTileK = kUnitK;  // 64: one layout unit, two absmax blocks
static_assert(kTileK == 64 && kBlock == 32, "the kernel assumes two 32-blocks per K-tile");
static_assert(kUnitN == 64, "a warp tile is one 64-column layout unit");
// Stage hand-off: wait on cp.async groups and __syncthreads every kTilesPerSync K-tiles
// (compute-sanitizer racecheck proves this hazard-free).
constexpr int kStages = 6;      // cp.async pipeline depth in K-tiles (all configs)
constexpr int kTilesPerSync = 2;  // K-tiles computed per wait + __syncthreads
// Loads run kPrefetch K-tiles ahead of compute; the kTilesPerSync stages before those are
// the ones being computed, so a stage is refilled only after a barrier that follows its use.
constexpr int kPrefetch = kStages - kTilesPerSync;
static_assert(kPrefetch >= kTilesPerSync, "the wait below assumes at least one step of lookahead");
constexpr int kGroupM = 8;      // m-tiles per L2 group in the tile order

// ----------------------------------------------------------------------------- PTX helpers

// Codebook lookup: shfl.idx reads only bits [4:0] of the source-lane operand (PTX ISA,
// shfl.sync), so a shifted index word can be passed without masking its upper bits;
// __shfl_sync documents no such guarantee, hence the explicit instruction.
__device__ __forceinline__ uint32_t shfl_lut(uint32_t table, uint32_t lane_bits) {
  uint32_t r;
  asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;\n" : "=r"(r) : "r"(table), "r"(lane_bits));
  return r;
}

// Byte permute: the cheapest way to move a byte (an E4M4 code) into 16-bit lanes.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Per-dtype pieces: the MMA, the packed multiply / fma used to apply the scale, how a
// codebook entry and an E4M4 code become 16-bit values, and the output conversion.
template <typename T>
struct Dt;

template <>
struct Dt<half> {
  // E4M4(c) == 16 * fp16_from_bits(c << 6), exact for all 256 codes (core/layout.cuh): the
  // scale register holds fp16_from_bits(c << 6) and the codebook register 16 * cb.
  static constexpr int kScaleShift = 6;
  __device__ __forceinline__ static uint32_t cb_bits(float v) {
    return __half_as_ushort(__float2half_rn(v * 16.0f));
  }
  // Packed f16x2 multiply / fma (FMA pipe, not the integer ALU that the index math loads).
  __device__ __forceinline__ static uint32_t mul2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  __device__ __forceinline__ static uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
  __device__ __forceinline__ static float to_float(const half* p) { return __half2float(*p); }
  __device__ __forceinline__ static void store2(half* p, float a, float b) {
    *reinterpret_cast<half2*>(p) = __floats2half2_rn(a, b);
  }
  __device__ __forceinline__ static void store1(half* p, float a) { *p = __float2half_rn(a); }
};

template <>
struct Dt<__nv_bfloat16> {
  // E4M4(c) == 2^116 * bf16_from_bits(c << 3): bf16 has the E4M4 mantissa bits and its
  // exponent bias is 116 larger (127 - 11); the subnormal codes (c < 16) map to bf16
  // subnormals with the same rule, and sm_90 bf16x2 mul/fma keep subnormals (no .ftz form
  // exists for bf16). The codebook register holds bf16(cb) * 2^116 (exact, < 2^117).
  static constexpr int kScaleShift = 3;
  __device__ __forceinline__ static uint32_t cb_bits(float v) {
    const float s = __bfloat162float(__float2bfloat16_rn(v)) * 0x1p116f;
    return __bfloat16_as_ushort(__float2bfloat16_rn(s));
  }
  // a * b as fma(a, b, -0): exact (x + -0 == x, signed zeros included) and available on
  // sm_80, where mul.bf16x2 is not (sm_90+).
  __device__ __forceinline__ static uint32_t mul2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
  }
  __device__ __forceinline__ static uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
  __device__ __forceinline__ static float to_float(const __nv_bfloat16* p) {
    return __bfloat162float(*p);
  }
  __device__ __forceinline__ static void store2(__nv_bfloat16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
  }
  __device__ __forceinline__ static void store1(__nv_bfloat16* p, float a) {
    *p = __float2bfloat16_rn(a);
  }
};

// ----------------------------------------------------------------------------- configuration

// A warp owns 16*MB rows x 8*NG columns. NG = 8: a whole 64-column layout unit (words 0-3 of
// the lane's 16 B per plane); NG = 4: half a unit (words h, 2+h: n8 groups 4h..4h+3), which
// lets a warp go to MB = 8 with the same 128 accumulators: every dequantized B fragment then
// feeds 8 MMAs instead of 4, halving the dequant instructions per MMA. WM x WN warps per CTA.
template <int BITS, int MB, int NG, int WM, int WN, int MINB>
struct TileCfg {
  static_assert(NG == 4 || NG == 8, "a warp covers half a unit or a whole unit");
  static constexpr int kBits = BITS;
  static constexpr int kMB = MB;
  static constexpr int kNG = NG;
  static constexpr int kWM = WM;
  static constexpr int kWN = WN;
  static constexpr int kThreads = 32 * WM * WN;
  static constexpr int kTileM = 16 * MB * WM;
  static constexpr int kTileN = 8 * NG * WN;
  static constexpr int kUnits = kTileN / kUnitN;               // layout units per CTA tile
  static constexpr int kWarpsPerUnit = 8 / NG;
  static constexpr int kABytes = kTileM * kTileK * 2;          // swizzled [row][8 x 16 B]
  static constexpr int kBBytes = kUnits * unit_words(BITS) * 4;  // raw layout units
  static constexpr int kSBytes = kUnits * kUnitAbsmaxBytes;      // their absmax bytes
  static constexpr int kStageBytes = kABytes + kBBytes + kSBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  static constexpr int kMinBlocks = MINB;                      // CTAs per SM (register cap)
  static constexpr int kAChunks = kTileM * 8;                  // 16 B cp.async per stage
  static constexpr int kBChunks = kBBytes / 16;
  static constexpr int kSChunks = kSBytes / 16;
  static_assert(kTileN % kUnitN == 0, "a CTA tile is whole layout units");
  static_assert(kABytes % 128 == 0 && kBBytes % 128 == 0 && kSBytes % 128 == 0,
                "stage sections stay 128 B aligned");
  static_assert(kAChunks % kThreads == 0, "A chunks divide evenly over the threads");
  static_assert(kSChunks <= kThreads, "one absmax chunk per thread at most");
  static_assert(unit_words(BITS) * 4 == BITS * 32 * 16, "a unit is [bits][32 lanes][16 B]");
  static_assert(kUnitAbsmaxBytes == 8 * 16, "absmax unit is [8 g][16 B]");
  static_assert(MINB * (kSmemBytes + 1024) <= 228 * 1024, "MINB CTAs fit the sm_90 shared memory");
};

// ----------------------------------------------------------------------------- kernel

__device__ __forceinline__ void decode_item(const Params& p, int item, int& tile, int& mt,
                                            int& nt, int& kc, int& kt0, int& kt1) {
  tile = item / p.splits;
  kc = item - tile * p.splits;
  // Grouped order: kGroupM m-tiles run together across the n-tiles, so the CTAs in flight share
  // a few x row-blocks and a few weight column-blocks in L2.
  const int group_size = kGroupM * p.n_tiles;
  const int group = tile / group_size;
  const int first_m = group * kGroupM;
  const int gm = min(p.m_tiles - first_m, kGroupM);
  const int r = tile - group * group_size;
  mt = first_m + r % gm;
  nt = r / gm;
  kt0 = kc * p.kt_per_split;
  kt1 = min(kt0 + p.kt_per_split, p.k_tiles);
}

// What one thread copies global -> shared per K-tile, set up once per work item so that a
// K-tile only adds kt-proportional offsets (the per-chunk index math was ~40% of the loop).
//   x: kAChunks / kThreads 16 B chunks, rows r0 + 32*it (r0 = tid / 8), chunk c = tid % 8,
//      stored swizzled at row*128 + ((c ^ (row & 7)) << 4), row & 7 == r0 & 7;
//   W: chunks tid + it*kThreads of the CTA's kUnits raw units, copied verbatim;
//   absmax: chunk tid (tid < kSChunks).
template <typename T, typename C>
struct Loader {
  static constexpr int kAIt = C::kAChunks / C::kThreads;
  static constexpr int kUnitChunks = C::kBits * 32;                 // 16 B chunks per unit
  static constexpr int kThreadsPerUnit = C::kThreads / C::kUnits;   // threads copying one unit
  static constexpr int kBIt = (kUnitChunks + kThreadsPerUnit - 1) / kThreadsPerUnit;
  static_assert(C::kThreads % C::kUnits == 0, "threads split evenly over the units");
  const char* a_src;  // x chunk `it = 0` of this item at kt = 0 (row clamped into range)
  uint32_t valid;     // bit it (< kAIt): that x row is < M; bit 30: the unit exists; bit 31: absmax chunk
  uint32_t b_off;     // 16 B chunk index of this thread's first W chunk at kt = 0 in packed
  uint32_t s_off;     // 16 B chunk index of this thread's absmax chunk at kt = 0

  __device__ __forceinline__ void setup(const Params& p, int mt, int nt) {
    const int tid = threadIdx.x;
    const int r0 = mt * C::kTileM + (tid >> 3);
    a_src = reinterpret_cast<const char*>(static_cast<const T*>(p.x) + (size_t)min(r0, p.m - 1) * p.k) +
            (tid & 7) * 16;
    valid = 0;
#pragma unroll
    for (int it = 0; it < kAIt; ++it) valid |= (r0 + 32 * it < p.m ? 1u : 0u) << it;
    const int nu = nt * C::kUnits + tid / kThreadsPerUnit;  // W: thread -> (unit, chunk column)
    if (nu < p.n_units) valid |= 1u << 30;
    b_off = (uint32_t)(min(nu, p.n_units - 1) * p.k_tiles) * kUnitChunks + tid % kThreadsPerUnit;
    const int nu_s = nt * C::kUnits + (tid >> 3);           // absmax: 8 chunks per unit
    if (tid < C::kSChunks && nu_s < p.n_units) valid |= 1u << 31;
    s_off = (uint32_t)(min(nu_s, p.n_units - 1) * p.k_tiles) * 8 + (tid & 7);
  }

  __device__ __forceinline__ void issue(const Params& p, uint32_t sbase, int kt) const {
    const int tid = threadIdx.x;
    const bool k_ok = kt * kTileK + (tid & 7) * 8 < p.k;  // K % 32 == 0: chunk all in or out
    const uint32_t a_dst = sbase + (tid >> 3) * 128 + (((tid & 7) ^ ((tid >> 3) & 7)) << 4);
    const size_t a_it_stride = (size_t)32 * p.k * sizeof(T);
#pragma unroll
    for (int it = 0; it < kAIt; ++it) {
      const bool v = k_ok && ((valid >> it) & 1u);
      const char* src = v ? a_src + it * a_it_stride + (size_t)kt * (kTileK * sizeof(T)) : static_cast<const char*>(p.x);
      cp_async16(a_dst + it * (32 * 128), src, v);
    }
    const bool bv = (valid >> 30) & 1u;
    const uint32_t b_src = b_off + (uint32_t)kt * kUnitChunks;
    const uint32_t b_dst = sbase + C::kABytes + (tid / kThreadsPerUnit) * (kUnitChunks * 16) + (tid % kThreadsPerUnit) * 16;
#pragma unroll
    for (int it = 0; it < kBIt; ++it) {
      if (kUnitChunks % kThreadsPerUnit == 0 || tid % kThreadsPerUnit + it * kThreadsPerUnit < kUnitChunks)
        cp_async16(b_dst + it * kThreadsPerUnit * 16, p.packed + (bv ? b_src + it * kThreadsPerUnit : 0u), bv);
    }
    if (tid < C::kSChunks) {
      const bool sv = valid >> 31;
      cp_async16(sbase + C::kABytes + C::kBBytes + tid * 16, p.absmax + (sv ? s_off + kt * 8u : 0u), sv);
    }
  }
};

template <typename T, int BITS, int MB, int NG, int WM, int WN, int MINB>
__global__ void __launch_bounds__(32 * WM * WN, MINB) kbit_mma_kernel(const Params p) {
  using C = TileCfg<BITS, MB, NG, WM, WN, MINB>;
  using D = Dt<T>;
  constexpr int kW = NG / 4;  // word positions a warp reads per block (1: half unit, 2: unit)
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int s_last;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / WN, warp_n = warp - warp_m * WN;
  const int g = lane >> 2, t = lane & 3;
  const int w_unit = warp_n / C::kWarpsPerUnit;        // unit within the CTA tile
  const int w_half = warp_n % C::kWarpsPerUnit;        // NG == 4: which word parity (0 or 1)

  // Codebook in registers: lane l holds entry l mod 2^BITS as (v, 0) and (0, v), so one shfl
  // per weight fetches it already in the half of the pair it belongs to.
  uint32_t cb_lo, cb_hi;
  {
    const uint32_t bits16 = D::cb_bits(__ldg(p.codebook + (lane & ((1 << BITS) - 1))));
    cb_lo = bits16;
    cb_hi = bits16 << 16;
  }

  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

  // ---- load cursor: runs kStages-1 K-tiles ahead of compute, across work items.
  Loader<T, C> ld;
  int l_item = blockIdx.x, l_kt = 0, l_kt1 = 0;
  auto l_setup = [&]() {
    if (l_item < p.items) {
      int tile, kc, mt, nt;
      decode_item(p, l_item, tile, mt, nt, kc, l_kt, l_kt1);
      ld.setup(p, mt, nt);
    }
  };
  auto l_issue = [&](int stage) {
    if (l_item < p.items) {
      ld.issue(p, smem_base + stage * C::kStageBytes, l_kt);
      if (++l_kt == l_kt1) {
        l_item += gridDim.x;
        l_setup();
      }
    }
  };
  l_setup();
#pragma unroll
  for (int s = 0; s < kPrefetch; ++s) {  // one commit group per K-tile, always (maybe empty)
    l_issue(s);
    cp_async_commit();
  }
  int c_stage = 0, l_stage = kPrefetch;

  // Per-lane ldmatrix offsets: row (lane & 15) of the m16 block, chunk 2*s + (lane >> 4),
  // swizzled by row & 7 == lane & 7 (block row starts are multiples of 16); since 2*s has a
  // clear bit 0, chunk ^ swizzle == (2*s) ^ (lane >> 4) ^ (lane & 7).
  const uint32_t a_lane_row = (uint32_t)(warp_m * MB * 16 + (lane & 15)) * 128;
  const uint32_t a_lane_sw = (uint32_t)((lane >> 4) ^ (lane & 7));
  const uint32_t b_lane_off = C::kABytes + w_unit * (BITS * 512) + lane * 16;
  const uint32_t s_lane_off = C::kABytes + C::kBBytes + w_unit * 128 + g * 16;

  for (int item = blockIdx.x; item < p.items; item += gridDim.x) {
    int tile, mt, nt, kc, kt0, kt1;
    decode_item(p, item, tile, mt, nt, kc, kt0, kt1);
    const int row_base = mt * C::kTileM + warp_m * MB * 16;
    const int nu = nt * C::kUnits + w_unit;
    // Warps whose unit is past N or whose rows are all past M skip the math (warp-uniform).
    const bool active = nu < p.n_units && row_base < p.m;

    float acc[MB][NG][4];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int j = 0; j < NG; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mb][j][r] = 0.f;

    for (int kt = kt0; kt < kt1;) {
      // Up to kTilesPerSync K-tiles per wait + barrier: the barrier (and the dequant prologue
      // behind it, which the 2 warps per scheduler cannot hide) is paid half as often.
      // Groups committed so far = consumed + kPrefetch; the next n tiles must have landed.
      const int n_here = min(kTilesPerSync, kt1 - kt);
      cp_async_wait<kPrefetch - kTilesPerSync>();
      __syncthreads();  // those stages landed for all threads; the stages of the last step are free
      for (int i = 0; i < n_here; ++i) {  // refill exactly what this step consumes
        l_issue(l_stage);
        cp_async_commit();
        l_stage = l_stage + 1 == kStages ? 0 : l_stage + 1;
      }
      for (int i = 0; i < n_here; ++i, ++kt) {
      if (active) {
        const uint32_t st = c_stage * C::kStageBytes;
        const uint32_t sA = smem_base + st + a_lane_row;
        // This lane's fragment bits for the unit: one conflict-free LDS.128 per plane, and
        // its column's 16 absmax codes (word w = 2*kb + (group >> 2), byte = group & 3). Only
        // the words of the warp's n8 groups are kept: 2*kb + wi (whole unit) or 2*kb + w_half.
        uint32_t pw[2][kW][BITS], cws[2][kW];
        {
          const uint4 codes = *reinterpret_cast<const uint4*>(smem + st + s_lane_off);
#pragma unroll
          for (int b = 0; b < BITS; ++b) {
            const uint4 v = *reinterpret_cast<const uint4*>(smem + st + b_lane_off + b * 512);
#pragma unroll
            for (int wi = 0; wi < kW; ++wi) {
              const bool odd = kW == 2 ? wi == 1 : w_half == 1;
              pw[0][wi][b] = odd ? v.y : v.x;
              pw[1][wi][b] = odd ? v.w : v.z;
            }
          }
#pragma unroll
          for (int wi = 0; wi < kW; ++wi) {
            const bool odd = kW == 2 ? wi == 1 : w_half == 1;
            cws[0][wi] = odd ? codes.y : codes.x;
            cws[1][wi] = odd ? codes.w : codes.z;
          }
        }

#pragma unroll
        for (int kb = 0; kb < 2; ++kb) {
          IndexWords<BITS> iw[kW];
          uint32_t cw[kW];
#pragma unroll
          for (int wi = 0; wi < kW; ++wi) {
            iw[wi].build(pw[kb][wi]);
            cw[wi] = cws[kb][wi];
          }
          // Scales of this block for the warp's n8 groups, each broadcast to both halves:
          // byte q of the code word -> bytes 0 and 2, then shifted into place.
          uint32_t sc[NG];
#pragma unroll
          for (int j = 0; j < NG; ++j) {
            const uint32_t q = j & 3;
            sc[j] = prmt(cw[j >> 2], 0u, q | (4u << 4) | (q << 8) | (4u << 12)) << D::kScaleShift;
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int s = 2 * kb + h;  // k16 step within the K-tile
            // Dequantize the warp's NG B fragments of this k16 step (8 registers) ...
            uint32_t bf[NG][2];
#pragma unroll
            for (int j = 0; j < NG; ++j) {
              const IndexWords<BITS>& W = iw[j >> 2];
              const int q = j & 3;
              // Codebook lookups: (cb[i0], 0), (0, cb[i1]) ... then scale with one rounding:
              // b = lo * s + (hi * s) puts cb[i0]*s in the low half and cb[i1]*s in the high.
              const uint32_t l0 = shfl_lut(cb_lo, W.lane_of(q, h, 0));
              const uint32_t h0 = shfl_lut(cb_hi, W.lane_of(q, h, 1));
              const uint32_t l1 = shfl_lut(cb_lo, W.lane_of(q, h, 2));
              const uint32_t h1 = shfl_lut(cb_hi, W.lane_of(q, h, 3));
              bf[j][0] = D::fma2(l0, sc[j], D::mul2(h0, sc[j]));
              bf[j][1] = D::fma2(l1, sc[j], D::mul2(h1, sc[j]));
            }
            // ... then the MMAs, m-blocks in groups of 4 so at most 16 A registers are live.
            constexpr int kMG = MB < 4 ? MB : 4;
#pragma unroll
            for (int m0 = 0; m0 < MB; m0 += kMG) {
              uint32_t a[kMG][4];
#pragma unroll
              for (int mb = 0; mb < kMG; ++mb) ldmatrix_x4(a[mb], sA + (m0 + mb) * 16 * 128 + ((a_lane_sw ^ (2 * s)) << 4));
#pragma unroll
              for (int j = 0; j < NG; ++j)
#pragma unroll
                for (int mb = 0; mb < kMG; ++mb)
                  mma_m16n8k16<T>(acc[m0 + mb][j], a[mb], bf[j][0], bf[j][1], acc[m0 + mb][j]);
            }
          }
        }
      }
      c_stage = c_stage + 1 == kStages ? 0 : c_stage + 1;
      }
    }

    // ---- split-K: every chunk writes its partial; the last to arrive sums all of them.
    if (p.splits > 1) {
      constexpr int kTileF4 = C::kTileM * C::kTileN / 4;
      float4* tile_ws = p.partial + (size_t)tile * p.splits * kTileF4;
      // fragment order: [warp][mb][j][lane] float4, coalesced 512 B per warp store
      const int frag_base = (warp * MB * NG) * 32 + lane;
      if (active) {
        float4* mine = tile_ws + (size_t)kc * kTileF4 + frag_base;
#pragma unroll
        for (int mb = 0; mb < MB; ++mb)
#pragma unroll
          for (int j = 0; j < NG; ++j)
            __stcg(mine + (mb * NG + j) * 32,
                   make_float4(acc[mb][j][0], acc[mb][j][1], acc[mb][j][2], acc[mb][j][3]));
      }
      __threadfence();  // release: partial visible device-wide before the counter moves
      __syncthreads();
      if (tid == 0) {
        const int old = atomicAdd(p.counters + tile, 1);
        s_last = old == p.splits - 1;
        if (s_last) p.counters[tile] = 0;  // self-reset (the launcher also zeroes on-stream)
      }
      __syncthreads();
      if (!s_last) continue;
      __threadfence();  // acquire: see the other chunks' partials
      if (active) {
        // acc = chunk 0 + chunk 1 + ... in chunk order, whoever arrives last: bitwise
        // deterministic. All MB*NG loads of a chunk are independent and issued together.
        for (int c2 = 0; c2 < p.splits; ++c2) {
          const float4* src = tile_ws + (size_t)c2 * kTileF4 + frag_base;
#pragma unroll
          for (int mb = 0; mb < MB; ++mb)
#pragma unroll
            for (int j = 0; j < NG; ++j) {
              const float4 v = __ldcg(src + (mb * NG + j) * 32);
              if (c2 == 0) {
                acc[mb][j][0] = v.x; acc[mb][j][1] = v.y; acc[mb][j][2] = v.z; acc[mb][j][3] = v.w;
              } else {
                acc[mb][j][0] += v.x; acc[mb][j][1] += v.y; acc[mb][j][2] += v.z; acc[mb][j][3] += v.w;
              }
            }
        }
      }
    }

    // ---- epilogue: bias, convert, store. c0,c1: row g, cols 2t,2t+1; c2,c3: row g+8.
    if (active) {
      T* y = static_cast<T*>(p.y);
      const T* bias = static_cast<const T*>(p.bias);
      const int col_base = nu * kUnitN + (NG == 4 ? 32 * w_half : 0) + 2 * t;
      const bool even_n = (p.n & 1) == 0;
#pragma unroll
      for (int j = 0; j < NG; ++j) {
        const int col = col_base + 8 * j;
        if (col >= p.n) continue;
        const bool has2 = col + 1 < p.n;
        float bia0 = 0.f, bia1 = 0.f;
        if (bias != nullptr) {
          bia0 = D::to_float(bias + col);
          if (has2) bia1 = D::to_float(bias + col + 1);
        }
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const int row = row_base + mb * 16 + g + 8 * hr;
            if (row >= p.m) continue;
            T* dst = y + (size_t)row * p.n + col;
            const float v0 = acc[mb][j][2 * hr] + bia0, v1 = acc[mb][j][2 * hr + 1] + bia1;
            if (even_n) {
              D::store2(dst, v0, v1);  // col even and n even: col + 1 < n, 4 B aligned
            } else {
              D::store1(dst, v0);
              if (has2) D::store1(dst + 1, v1);
            }
          }
        }
      }
    }
  }
  cp_async_wait<0>();
}

// ----------------------------------------------------------------------------- host side

template <typename T, int BITS, int MB, int NG, int WM, int WN, int MINB>
cudaError_t launch_cfg(const Params& prm, int grid, cudaStream_t stream) {
  using C = TileCfg<BITS, MB, NG, WM, WN, MINB>;
  static_assert(C::kThreads == 256, "cfg_desc says 256 threads");
  auto kern = kbit_mma_kernel<T, BITS, MB, NG, WM, WN, MINB>;
  // Raise the dynamic shared-memory limit (> 48 KB). A per-function attribute, no sync; set
  // on every launch so it holds on whichever device is current.
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  if (e != cudaSuccess) return e;
  kern<<<grid, C::kThreads, C::kSmemBytes, stream>>>(prm);
  return cudaGetLastError();
}

// The selector's entry of tile config C (mma_kernels.h, generated).
template <typename T, int BITS, int C>
constexpr MmaKernel kernel_entry() {
  constexpr cudaError_t (*launch)(const Params&, int, cudaStream_t) =
      &launch_cfg<T, BITS, cfg_desc(C).mb, cfg_desc(C).ng, cfg_desc(C).wm, cfg_desc(C).wn, cfg_desc(C).min_blocks>;
  return {launch};
}

}  // namespace mma
}  // namespace kbit
