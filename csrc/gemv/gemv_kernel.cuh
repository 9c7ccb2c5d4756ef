// Small-M kbit GEMM ("GEMV" path, 1 <= M <= 16): y[M, N] = x[M, K] @ dequant(W)^T (+ bias).
// Torch-free; instantiated once per bit width in gemv/instantiations/gemv_k<BITS>.cu, planned by
// dispatch/gemv_plan.h. docs/DESIGN.md describes the design, docs/PERFORMANCE.md its measurements.
//
//   * Memory bound in principle (at K=4 a weight is 0.53 B), so the budget is a few
//     thread-instructions per weight for everything: load, decode, multiply, reduce. The decode
//     is what it spends them on, so the layout does what it can ahead of time (K = 3..5 store
//     nibble words, so the bit-matrix transpose is mostly a register move).
//   * Work: a warp streams the 64x64 units (core/layout.cuh) of one 64-column slab along K,
//     16-byte loads, a few units in flight in registers. A CTA owns one slab (or G slabs with x
//     resident) and a K range (its warps interleave over the units); a cluster of S CTAs (sm_90)
//     splits K further and reduces through distributed shared memory, in a fixed order:
//     deterministic, no global workspace, no memset, one launch (CUDA-graph safe).
//   * Multiply on the tensor cores even at M = 1: W is the A operand (m16 = two n8 column
//     groups, exactly the bytes a lane holds in the layout) and x^T the B operand (n8 = up to
//     8 rows of x; a second n8 tile for M <= 16). So the cost per weight is the decode alone
//     and does not grow with M. The block scale multiplies either the decoded pairs (HMUL2)
//     or, in fp32, a fresh accumulator holding the block's two k16 steps (the D fragment rows
//     are the columns the lane's absmax bytes describe): per bit width and M, scale_weights.
//   * Decode, per 32 elements (one word of each bit-plane):
//       K=2: 2 planes -> two words of 2-bit fields; every nibble is a PAIR of indices, looked
//            up with one shuffle in a 16-entry half2 pair table held by the lanes.
//       K=3,4: nibble words (stored so by the layout); every byte is a pair of indices, looked
//            up in a 256-entry (128 for K=3) half2 pair table in shared memory, replicated 32x
//            so lane l always hits bank l (conflict-free). A CTA alone on its SM lays the rows
//            256 B apart from a 64 KB-aligned address, so one PRMT forms the lookup address.
//       K=5: as K=4 plus the 5th plane merged into byte-wide fields; single-value shuffle
//            lookups (32-entry table = 32 lanes) and one PRMT per pair.
//     A pair always holds two elements of one column and one block; since the MMA sums over
//     k in any order, x is permuted to match (PRMT of the 32-bit x loads), never W.
//   * E4M4 absmax: fp16 bits (code << 6) == E4M4(code) / 16 exactly (core/layout.cuh), two
//     codes per shift; the 16 is applied once in the epilogue, or folded into the codebook
//     where the weights are scaled (scale2 / codebook_mult, core/decode.cuh).
//   * 8 < M <= 16: x reaches the MMA through shared memory (a per-warp ring, or resident for
//     the CTA's whole K range in CTAs of several slabs), so 16 warps fit an SM.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#include <cooperative_groups.h>
#endif

#include "core/common.cuh"
#include "core/decode.cuh"
#include "core/layout.cuh"
#include "gemv/gemv_config.h"

namespace kbit {
namespace gemv {

// CTAs per SM the kernel is compiled for (registers: 65536 / (threads x this) each).
template <int MT, int W> constexpr int min_blocks() { return W == kNarrowWarps ? 4 : MT > 1 ? 1 : W == kWarps ? 2 : 1; }
constexpr int kPairsPerLane = 4;          // m16 column-group pairs per unit (8 n8 groups / 2)

using Params = StreamParams;  // core/common.cuh

// Per bit width: how many units a warp keeps in flight (the table: PairTable, core/decode.cuh).
template <int BITS> struct Traits : PairTable<BITS> {
  // register stages: stages - 1 units in flight per warp while one is decoded (16 warps/SM)
  static constexpr int kStages = BITS == 5 ? 2 : 3;
};

// 8 < M <= 16 (two n8 tiles of x): x reaches the MMA through shared memory. Read straight into
// B-fragment registers, a lane's x words are 32-bit loads from eight rows: twice the L1 traffic
// of the weights and lookups together, and too many registers for 16 warps per SM. Instead each
// warp copies its unit's 16 x 64 x tile with 16-byte cp.async into a ring slot of its own and
// reads the B fragments with one ldmatrix.x4 per n8 tile and block: two stages fit 128
// registers, so 16 warps per SM (one 16-warp or four 4-warp CTAs). Rows are padded to kXRowBytes
// so the eight rows of an ldmatrix phase hit eight different 16-byte bank groups. Devices whose
// CTAs cannot have the ring (sm_86 / sm_89: 99 KB) run the 8-warp register kernel (as does the
// plan override gemv.x_smem=0).
constexpr int kXRowBytes = 144;
constexpr int kXSmemStages = 2;

// Where the E4M4 block scales are applied (compute_stage): on the decoded weights (HMUL2 per
// pair, the MMAs accumulate in place) or in fp32 on each block's MMA result (FFMA per output:
// 4 per n8 tile of x and pair of columns, as many as the HMUL2 at 8 < M <= 16, half at M <= 8).
// Same instruction count at M > 8, shorter chains (no fresh accumulator per block): on the
// weights at M > 8, and at M <= 8 for K=2 (its shuffle lookups leave the FMA pipe idle) and for
// K=4 in the one-warp-a-slab x-resident CTAs (kOneWarpSlab: 15 / 16 slabs). Every other choice
// measured slower (docs/PERFORMANCE.md).
template <int BITS, int MT, bool kOneWarpSlab = false> constexpr bool scale_weights() {
  return MT == 2 || BITS == 2 || (kOneWarpSlab && BITS == 4);
}

// One unit as a lane holds it in registers: its 16 bytes of each bit-plane, the 16 absmax
// codes of its column group, and the x pairs its B fragments need.
template <int BITS, int MT> struct Stage : LaneUnit<BITS> {  // planes w, absmax a
  uint32_t x[MT][2][4];      // [n8 tile][block][i]: x[row][32 kb + 2t + 8i .. +1]
};

// Loads of unit `ku` into registers: the lane's planes and absmax (LaneUnit), 32-bit x loads.
// (Measured: carrying incremented pointers across the loop instead of this index math costs
// registers and was 10-20% slower at the 128-register cap.)
// kXs: x goes to this stage's ring slot at `xslot` instead (16-byte chunk c = lane + 32 j is
// row c / 8, k 8 (c % 8) of the unit; zero-filled past M and K).
template <int BITS, int MT, typename T, bool kXs>
__device__ __forceinline__ void load_stage(Stage<BITS, MT>& st, const Params& p, int nu, int ku, int lane,
                                           uint32_t xslot) {
  st.load(p.packed, p.absmax, (long long)nu * p.ku_count + ku, lane);
  const T* x = static_cast<const T*>(p.x);
  if constexpr (kXs) {
#pragma unroll
    for (int j = 0; j < 2 * MT; ++j) {
      const int c = lane + 32 * j, row = c >> 3, k = ku * kUnitK + 8 * (c & 7);
      const bool ok = row < p.m && k < p.k;
      cp_async16(xslot + row * kXRowBytes + 16 * (c & 7), ok ? x + (long long)row * p.k + k : x, ok);
    }
    return;
  }
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int row = 8 * mt + g;
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) {
      const int k0 = ku * kUnitK + kb * kBlock;
      if (row < p.m && k0 < p.k) {  // never read x beyond K (padding) or M
        const uint32_t* xr = reinterpret_cast<const uint32_t*>(x + (long long)row * p.k + k0 + 2 * t);
#pragma unroll
        for (int i = 0; i < 4; ++i) st.x[mt][kb][i] = __ldg(xr + 4 * i);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) st.x[mt][kb][i] = 0u;
      }
    }
  }
}

// Decode one unit and accumulate (see the file comment for the scheme).
// kXs: x is read from the stage's ring slot; `xlane` = its address + this lane's ldmatrix row
// offset, so register i of n8 tile mt, block kb is x[8 mt + g][32 kb + 8 i + 2t], as st.x holds it.
// kScaleW (scale_weights): the block scales multiply the decoded pairs (HMUL2, the weight rounded
// once to T, as the wgmma kernel and the dequantize path do) and the MMAs accumulate in place;
// else each block's two k16 steps go into a fresh accumulator scaled in fp32 (FFMA per output).
template <int BITS, int MT, typename T, bool kWideLut, bool kXs, bool kScaleW>
__device__ __forceinline__ void compute_stage(const Stage<BITS, MT>& st, float (&acc)[kPairsPerLane][MT][4],
                                              uint32_t lut_addr, uint32_t table, uint32_t xlane) {
#pragma unroll
  for (int kb = 0; kb < 2; ++kb) {
    // B operands (x^T) of the block's two k16 steps, permuted to the decoder's pairing
    uint32_t bx[MT][2][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      uint32_t L[4];
      if constexpr (kXs) {
        ldmatrix_x4(L, xlane + mt * 8 * kXRowBytes + kb * 2 * kBlock);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) L[i] = st.x[mt][kb][i];
      }
      const uint32_t u0 = L[0], u1 = Traits<BITS>::kCrumbPairs ? L[1] : L[2];
      const uint32_t v0 = Traits<BITS>::kCrumbPairs ? L[2] : L[1], v1 = L[3];
      bx[mt][0][0] = prmt(u0, u1, 0x5410);
      bx[mt][0][1] = prmt(u0, u1, 0x7632);
      bx[mt][1][0] = prmt(v0, v1, 0x5410);
      bx[mt][1][1] = prmt(v0, v1, 0x7632);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int w = 2 * kb + h;
      uint32_t planes[BITS];
#pragma unroll
      for (int b = 0; b < BITS; ++b) planes[b] = comp(st.w[b], w);
      Decoder<BITS, T, kWideLut> dec;
      dec.load(planes);
      const uint32_t codes = comp(st.a, w);
      // fp32 path: (code << 6) as fp16 is E4M4 / 16, for columns q = 0..3 of this word
      float scale[4] = {0.f, 0.f, 0.f, 0.f};
      if constexpr (!kScaleW) {
        const uint32_t s02 = (codes & 0x00FF00FFu) << 6, s13 = (codes >> 2) & 0x3FC03FC0u;
        const float2 f02 = __half22float2(*reinterpret_cast<const __half2*>(&s02));
        const float2 f13 = __half22float2(*reinterpret_cast<const __half2*>(&s13));
        scale[0] = f02.x, scale[1] = f13.x, scale[2] = f02.y, scale[3] = f13.y;
      }
#pragma unroll
      for (int qp = 0; qp < 2; ++qp) {
        const int q0 = 2 * qp, q1 = 2 * qp + 1;
        const uint32_t s0 = kScaleW ? scale2<T>(codes, q0) : 0u, s1 = kScaleW ? scale2<T>(codes, q1) : 0u;
        uint32_t a0[4], a1[4];
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          a0[s] = dec.pair(q0, s, lut_addr, table);
          a1[s] = dec.pair(q1, s, lut_addr, table);
          if constexpr (kScaleW) a0[s] = hmul2<T>(a0[s], s0), a1[s] = hmul2<T>(a1[s], s1);
        }
        const uint32_t frag0[4] = {a0[0], a1[0], a0[1], a1[1]};  // k16 step 0: pairs 0, 1
        const uint32_t frag1[4] = {a0[2], a1[2], a0[3], a1[3]};  // k16 step 1: pairs 2, 3
        const int pr = 2 * h + qp;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (kScaleW) {
            mma_m16n8k16<T>(acc[pr][mt], frag0, bx[mt][0][0], bx[mt][0][1], acc[pr][mt]);  // A = W, B = x^T
            mma_m16n8k16<T>(acc[pr][mt], frag1, bx[mt][1][0], bx[mt][1][1], acc[pr][mt]);
          } else {
            const float zero[4] = {0.f, 0.f, 0.f, 0.f};
            float d[4];
            mma_m16n8k16<T>(d, frag0, bx[mt][0][0], bx[mt][0][1], zero);
            mma_m16n8k16<T>(d, frag1, bx[mt][1][0], bx[mt][1][1], d);
            acc[pr][mt][0] = fmaf(scale[q0], d[0], acc[pr][mt][0]);
            acc[pr][mt][1] = fmaf(scale[q0], d[1], acc[pr][mt][1]);
            acc[pr][mt][2] = fmaf(scale[q1], d[2], acc[pr][mt][2]);
            acc[pr][mt][3] = fmaf(scale[q1], d[3], acc[pr][mt][3]);
          }
        }
      }
    }
  }
}

// The one-CTA-per-SM configurations (16 warps, and the 8-warp M > 8 one with x in registers)
// of K=3,4 read a pair table with wide rows (PairTable::kWideLutBytes): one instruction less
// per pair (Decoder), for up to 64 KB of padding and twice the table, which only a CTA alone
// on its SM can spare, and only where the device lets one CTA have that much (the planner
// weighs each kernel's shared memory, dispatch/gemv_plan.h): sm_90 (227 KB) always; sm_80
// (163 KB) at M <= 8 (100-133 KB); sm_86 / sm_89 (99 KB) never. Not the K=4 16-warp kernel with
// the x ring (M > 8), where it measured slower. The x-resident kernels take the wide rows too
// (kernel_entry). The plan override gemv.wide_table=0 takes the packed table everywhere (same bits).
template <int BITS, int MT, int W> constexpr bool wide_lut() {
  return Traits<BITS>::kLutEntries > 0 && min_blocks<MT, W>() == 1 && kLutReplicas == 32 &&
         !(BITS == 4 && MT == 2 && W == kWideWarps);
}

// The dynamic shared memory opt-in of `Kernel`, once per device. It is a per-kernel, per-device
// setting, so the flags are per instantiation: a template on the kernel's type alone shares
// them between all gemv_kernel instantiations (one signature), and every kernel after the
// first launched without its opt-in ("invalid argument").
template <auto Kernel> cudaError_t opt_in_smem(int bytes) {
  static bool done[64];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= 0 && dev < 64 && done[dev]) return cudaSuccess;
  e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess && dev >= 0 && dev < 64) done[dev] = true;
  return e;
}

// Register (kXs: ring) stages of a warp's unit stream.
// x resident at M <= 8 keeps the register kernels' depth (its stages hold no x, as the ring's).
// At M > 8 a third stage would fit the resident kernels' 128 registers with a few spills, and
// measured slower.
template <int BITS, bool kXs, int MT = 2, int G = 0> constexpr int stages() {
  return kXs && !(G > 0 && MT == 1) ? kXSmemStages : Traits<BITS>::kStages;
}

// Shared memory of one CTA: the pair table (K=3,4), reused after the main loop for the
// cross-warp reduction scratch, then the partial sums the cluster reads, which during the
// main loop hold the warps' x rings (kXs). With wide rows the table starts at the first 64
// KB-aligned shared address (kPad bytes reserved for the gap).
// G > 0 (x resident, kXs): the x rows of the CTA's K range, then (after the loop) the G slabs'
// partial sums, in place of the ring; kBytes is the bound for xr_max_units(MT), bytes(chunk)
// what a launch needs.
template <int BITS, int MT, int W, bool kWide, bool kXs, int G = 0> struct Smem {
  static constexpr int kAcc = kPairsPerLane * MT * 4;                  // floats per lane
  static constexpr int kLutBytes = kWide ? Traits<BITS>::kWideLutBytes : Traits<BITS>::kLutBytes;
  static constexpr int kRedBytes = W * kAcc * 32 * 4;
  static constexpr int kPart = kLutBytes > kRedBytes ? kLutBytes : kRedBytes;  // from the table's start
  static constexpr int kPartBytes = (G > 0 ? G : 1) * kAcc * 32 * 4;
  static constexpr int kXSlot = 8 * MT * kXRowBytes;                   // one unit's x rows
  static constexpr int kPad = kWide ? 65536 - 16 : 0;
  // x resident: units of K a CTA can hold (with the wide table, what its padding and 64 KB leave)
  static constexpr int kXrUnits = !kWide ? xr_max_units(MT) : (227 * 1024 - kPad - kPart) / kXSlot;
  static constexpr int kXRing = !kXs ? 0 : G > 0 ? kXrUnits * kXSlot : W * stages<BITS, kXs>() * kXSlot;
  // the region after the table / scratch holds `x_bytes` of x, then the partial sums
  static constexpr int with_x(int x_bytes) { return kPad + kPart + (x_bytes > kPartBytes ? x_bytes : kPartBytes); }
  static constexpr int kBytes = with_x(kXRing);
  static constexpr int bytes(int chunk) { return G > 0 ? with_x(chunk * kXSlot) : kBytes; }
  static_assert(kWide || kXs || kBytes <= 48 * 1024, "fits without the dynamic shared memory opt-in");
  static_assert(kPart % 16 == 0 && kXSlot % 16 == 0, "cp.async and ldmatrix need 16-byte aligned rows");
  static_assert(G == 0 || (kXs && W % (G > 0 ? G : 1) == 0), "x resident: whole warps per slab");
  static_assert(kBytes <= 227 * 1024, "one CTA per SM on sm_90");
};

template <int BITS, int MT, typename T, int W, bool kWide, bool kXs, int G = 0>
__global__ void __launch_bounds__(W * 32, (min_blocks<MT, W>())) gemv_kernel(const Params p) {
  // G > 0: x resident, G slabs per CTA, kWarps warps per slab (the slab's units interleave
  // over them); else one slab per CTA, all W warps on it.
  constexpr int kSlabs = G > 0 ? G : 1, kWarps = W / kSlabs, kThreads = W * 32;
  extern __shared__ __align__(16) uint32_t smem_raw[];
  using S = Smem<BITS, MT, W, kWide, kXs, G>;
  constexpr bool kOneWarpSlab = kWarps == 1;  // the 15- and 16-slab CTAs (xr_warps)
  constexpr bool kScaleW = scale_weights<BITS, MT, kOneWarpSlab>();
  const uint32_t smem_addr = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t lut_base = kWide ? (smem_addr + 0xFFFFu) & ~0xFFFFu : smem_addr;
  uint32_t* smem = smem_raw + (lut_base - smem_addr) / 4;  // the table, then the reduction
  constexpr int kAcc = S::kAcc;
  const int lane = threadIdx.x & 31, warp_cta = threadIdx.x >> 5;
  const int warp = warp_cta % kWarps, slab = warp_cta / kWarps;  // this warp's place on its slab
  const int nu = blockIdx.x * kSlabs + slab, split = blockIdx.y, splits = gridDim.y;
  const int ku_begin = split * p.chunk;
  const int ku_end = min(p.ku_count, ku_begin + p.chunk);

  wait_prior_grids();  // programmatic dependent launch (core/common.cuh)
  const uint32_t xbase = lut_base + S::kPart;  // the ring, or the resident x rows
  if constexpr (G > 0) {
    // the K range's x rows, one cp.async group before the table: 16-byte chunk c of unit u is
    // row (c % (64 MT)) / 8, k 8 (c % 8) (load_stage's order); zeros past M and K
    const T* x = static_cast<const T*>(p.x);
    for (int c = threadIdx.x; c < (ku_end - ku_begin) * 64 * MT; c += kThreads) {
      const int u = c / (64 * MT), r = c % (64 * MT), row = r >> 3, k = (ku_begin + u) * kUnitK + 8 * (r & 7);
      const bool ok = row < p.m && k < p.k;
      cp_async16(xbase + u * S::kXSlot + row * kXRowBytes + 16 * (r & 7), ok ? x + (long long)row * p.k + k : x, ok);
    }
    cp_async_commit();
  }
  // ---- codebook table: in the lanes (K=2: pair table, K=5: values) or in shared memory
  const uint32_t table = init_codebook<BITS, T, kWide>(p.codebook, kScaleW ? codebook_mult<T>() : 1.0f, smem, threadIdx.x, kThreads);
  if constexpr (Traits<BITS>::kLutEntries > 0) __syncthreads();
  // entry v of replica r is the word 32 v + r (bank r), 64 v + r with wide rows; lane l reads
  // replica l % kLutReplicas. Wide rows: the PRMT key (core/decode.cuh, Decoder::pair).
  const uint32_t lut_addr = opaque(kWide ? (lut_base & 0xFFFF0000u) | (4u * lane) : lut_base + 4u * (lane % kLutReplicas));

  float acc[kPairsPerLane][MT][4];
#pragma unroll
  for (int i = 0; i < kPairsPerLane; ++i)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][mt][j] = 0.f;

  // ---- stream this warp's units (ku = ku_begin + warp + it * kWarps): a ring of kStages
  // register stages, kStages - 1 units in flight while one is decoded. kXs: stage s's x in
  // ring slot s of this warp; one cp.async group per stage (empty past the end, so that
  // wait_group<kStages - 1> always means "stage it has landed").
  constexpr int kStages = stages<BITS, kXs, MT, G>();
  const uint32_t xring = xbase + uint32_t(G > 0 ? 0 : warp * kStages * S::kXSlot);
  const uint32_t xlane = xring + (lane & 7) * kXRowBytes + 16 * (lane >> 3);
  const int count = nu < n_units(p.n) ? ku_end - ku_begin : 0;  // (a last CTA's missing slabs: none)
  const int n_iter = count > warp ? (count - warp + kWarps - 1) / kWarps : 0;
  Stage<BITS, MT> st[kStages];
  if constexpr (G > 0) {
    // weights only: unit it of this warp is at x row block (warp + it * kWarps). Its own loop:
    // one loop for both, the load behind a lambda, kept the ring kernels' SASS but gave these
    // 16-32 more instructions and spills (sm_90a, nvcc 13.0).
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s)
      if (s < n_iter) st[s].load(p.packed, p.absmax, (long long)nu * p.ku_count + ku_begin + warp + s * kWarps, lane);
    cp_async_wait<0>();
    __syncthreads();  // every thread's x copies have landed
    for (int it0 = 0; it0 < n_iter; it0 += kStages) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) {
        const int it = it0 + s;
        if (it < n_iter) {
          const int nxt = it + kStages - 1, sn = (s + kStages - 1) % kStages;
          if (nxt < n_iter)
            st[sn].load(p.packed, p.absmax, (long long)nu * p.ku_count + ku_begin + warp + nxt * kWarps, lane);
          compute_stage<BITS, MT, T, kWide, kXs, kScaleW>(st[s], acc, lut_addr, table, xlane + (warp + it * kWarps) * S::kXSlot);
        }
      }
    }
  } else {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_iter) load_stage<BITS, MT, T, kXs>(st[s], p, nu, ku_begin + warp + s * kWarps, lane, xring + s * S::kXSlot);
    if constexpr (kXs) cp_async_commit();
  }
  for (int it0 = 0; it0 < n_iter; it0 += kStages) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      const int it = it0 + s;
      if (it < n_iter) {
        const int nxt = it + kStages - 1, sn = (s + kStages - 1) % kStages;
        if constexpr (kXs) __syncwarp();  // every lane's ldmatrix of slot sn (stage it - 1) is done
        if (nxt < n_iter)
          load_stage<BITS, MT, T, kXs>(st[sn], p, nu, ku_begin + warp + nxt * kWarps, lane, xring + sn * S::kXSlot);
        if constexpr (kXs) {
          cp_async_commit();
          cp_async_wait<kStages - 1>();
          __syncwarp();  // the other lanes' copies into slot s are visible
        }
        compute_stage<BITS, MT, T, kWide, kXs, kScaleW>(st[s], acc, lut_addr, table, xlane + s * S::kXSlot);
      }
    }
  }
  if constexpr (kXs) cp_async_wait<0>();  // (only empty groups can be left) before `part` reuses the ring
  }

  // ---- reduce: warps of the CTA through shared memory, then the CTAs of the cluster through
  // distributed shared memory; every sum runs in a fixed order (deterministic).
  __syncthreads();  // the table region (and, x resident, the x rows under `part`) is reused below
  // every warp is past its loads (the bias is a weight); M <= 8 only (use_pdl_trigger, dispatch/launchers.h)
  if constexpr (MT == 1) {
    if (p.trigger) allow_dependents();
  }
  float* red = reinterpret_cast<float*>(smem);
  float* part = reinterpret_cast<float*>(reinterpret_cast<char*>(smem) + S::kPart);
  // part[slab][e]: the sum over that slab's warps (warp_cta = slab * kWarps + warp)
  constexpr int kElems = kSlabs * kAcc * 32;
  constexpr bool kDirect = kOneWarpSlab && (BITS != 3 || MT == 2);
  // One warp a slab (the 15- and 16-slab CTAs): its accumulators are the slab's sums, so they
  // go straight to `part`, in the layout the pass below would copy them to. Not K=3 at M <= 8:
  // there the same change rescheduled the main loop (same instructions, other order) and
  // measured slower.
  float* const dst = kDirect ? part : red;
#pragma unroll
  for (int i = 0; i < kPairsPerLane; ++i)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j) dst[(warp_cta * kAcc + (i * MT + mt) * 4 + j) * 32 + lane] = acc[i][mt][j];
  if constexpr (!kDirect) {
    __syncthreads();
    // four elements (one register i, four lanes) per thread, 16-byte loads and store, the sums in
    // the same order as one element a thread would take
    for (int e = 4 * threadIdx.x; e < kElems; e += 4 * kThreads) {
      const float* r = red + e + (e / (kAcc * 32)) * (kWarps - 1) * kAcc * 32;
      float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float4 v = *reinterpret_cast<const float4*>(r + w * kAcc * 32);
        s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
      }
      *reinterpret_cast<float4*>(part + e) = s;
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  if (splits > 1) cluster.sync(); else __syncthreads();
#else
  // The host picks splits > 1 from the device's compute capability; code built from pre-sm_90
  // PTX running on Hopper would get them without the cluster reduction: fail loudly instead
  // of writing one split's partial sums.
  if (splits > 1) __trap();
  __syncthreads();
#endif
  // CTA `split` of the cluster finishes elements [e0, e1) of the slabs' kElems, four
  // at a time: lanes 4c..4c+3 of one accumulator register i, i.e. one column and rows
  // 8 mt + (j & 1) + {0, 2, 4, 6}. Every rank's 16-byte load is issued before the first sum
  // (ranks unrolled to kMaxSplits, to which the plan clamps S), so the remote loads overlap
  // instead of each waiting out its latency. The sums run in rank order (deterministic).
  const int per = div_up(div_up(kElems, splits), 4) * 4;
  const int e0 = split * per, e1 = min(kElems, e0 + per);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  for (int e = e0 + 4 * threadIdx.x; e < e1; e += 4 * kThreads) {
    const int i = (e >> 5) % kAcc;  // i = (pair * MT + mt) * 4 + j
    const int j = i & 3, mt = (i >> 2) % MT, pr = (i >> 2) / MT;
    const int row0 = 8 * mt + (j & 1);  // row of lane 4c; lane 4c + q is row0 + 2q
    const int col = (blockIdx.x * kSlabs + e / (kAcc * 32)) * kUnitN + 8 * (2 * pr + (j >> 1)) + ((e & 31) >> 2);
    if (row0 >= p.m || col >= p.n) continue;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (splits > 1) {
      float4 v[kMaxSplits];
#pragma unroll
      for (int r = 0; r < kMaxSplits; ++r)
        if (r < splits) v[r] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(part, r) + e);
#pragma unroll
      for (int r = 0; r < kMaxSplits; ++r)
        if (r < splits) s.x += v[r].x, s.y += v[r].y, s.z += v[r].z, s.w += v[r].w;
    } else
#endif
    {
      const float4 v = *reinterpret_cast<const float4*>(part + e);
      s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
    const float sq[4] = {s.x, s.y, s.z, s.w};
    const float b = bias != nullptr ? to_float(bias[col]) : 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int row = row0 + 2 * q;
      if (row < p.m) {
        float v = kScaleW ? sq[q] : 16.f * sq[q];  // the fp32 scales were E4M4 / 16
        if (bias != nullptr) v += b;
        y[(long long)row * p.n + col] = from_float<T>(v);
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (splits > 1) cluster.sync();  // keep this CTA's `part` alive until the cluster read it
#endif
}

// Launch one instantiation; `splits` >= 1 already chosen (and 1 below sm_90).
template <int BITS, int MT, typename T, int W, bool kWide = false, bool kXs = false, int G = 0>
cudaError_t launch_kernel(const Params& p, int splits, cudaStream_t stream) {
  using S = Smem<BITS, MT, W, kWide, kXs, G>;
  constexpr auto kernel = gemv_kernel<BITS, MT, T, W, kWide, kXs, G>;
  if constexpr (S::kBytes > 48 * 1024) {
    const cudaError_t e = opt_in_smem<kernel>(S::kBytes);
    if (e != cudaSuccess) return e;
  }
  if (G > 0 && p.chunk > S::kXrUnits) return cudaErrorInvalidValue;  // the plan never asks
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(div_up(n_units(p.n), G > 0 ? G : 1), splits, 1);
  cfg.blockDim = dim3(W * 32, 1, 1);
  cfg.dynamicSmemBytes = S::bytes(p.chunk);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  cfg.attrs = attr;
  cfg.numAttrs = 0;
  if (splits > 1) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attr[cfg.numAttrs].val.clusterDim.x = 1;
    attr[cfg.numAttrs].val.clusterDim.y = splits;
    attr[cfg.numAttrs].val.clusterDim.z = 1;
    ++cfg.numAttrs;
  }
  if (p.pdl) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[cfg.numAttrs].val.programmaticStreamSerializationAllowed = 1;
    ++cfg.numAttrs;
  }
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// The selector's entry of one instantiation (gemv_kernels.h, generated): its launch and the
// facts the planner weighs (dispatch/gemv_plan.h, plan_gemv_on). The wide-row table is built
// only where wide_lut allows it, and for the x-resident CTAs of 4, 15 and 16 slabs at K = 3, 4
// (their K range must fit beside it: Smem::kXrUnits; G = 2 with the wide rows: not measured).
template <int BITS, int MT, typename T, int W, bool kWide, bool kXs, int G>
constexpr GemvKernel kernel_entry() {
  static_assert(!kWide || (G > 0 ? Traits<BITS>::kLutEntries > 0 && G != 2 : wide_lut<BITS, MT, W>()),
                "the wide-row table only where it applies");
  static_assert(G == 0 || W == xr_warps(G), "x-resident CTAs: xr_warps(G) warps");
  using S = Smem<BITS, MT, W, kWide, kXs, G>;
  return {&launch_kernel<BITS, MT, T, W, kWide, kXs, G>, {S::kBytes, G > 0 ? S::kXrUnits : 0}};
}

}  // namespace gemv
}  // namespace kbit
