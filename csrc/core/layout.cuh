// kbit tiled weight layout: the one layout every kbit kernel reads (GEMV and tensor-core).
// Torch-free; included by the repack, GEMV and MMA kernels. The Python mirror (exactly the
// same index math, used to test the repack kernel) is vllm_kbit/layout.py.
//
// Why this layout. The m16n8k16 MMA gives lane l (g = l/4, t = l%4) of a warp, per n8 column
// group, the B elements of column g at k = 2t, 2t+1 (reg b0) and 2t+8, 2t+9 (reg b1) of each
// k16 step. A 32-weight kbit block is two k16 steps, so each lane needs exactly 8 elements of
// each (column, block): one byte per bit-plane. The repack gathers those 8 bits into one byte,
// and puts 16 such bytes (8 n8-groups x 2 blocks) for one lane and one plane into one 16-byte
// vector. So:
//   * every lane loads its own fragment data with 16-byte loads, a warp reads 512 contiguous
//     bytes per plane (coalesced from global, conflict-free from shared memory), no lane
//     needs another lane's data, and nothing is re-shuffled in shared memory;
//   * the same unit serves the GEMV: a warp streams the units of one 64-column slab along K,
//     and each lane's 8 elements per (column, block) meet 8 x values it keeps in registers.
//
// Units. The weight W[N, K] (N out, K in) is padded to N64 = ceil(N/64)*64 columns and
// K64 = ceil(K/64)*64. A unit is 64 columns x 64 k (two 32-blocks). Units are stored
// n-unit major, k-unit minor: unit (nu, ku) is unit number nu * KU + ku, KU = K64 / 64, so
// the K stream of one 64-column slab is contiguous.
//
// packed (uint32), per unit: [bits][32 lanes][4 words]   -> bits * 128 words = 64*64*bits/8 B
// absmax (uint8),  per unit: [8 g][4 words][4 bytes]     -> 128 bytes
//
// Word w (0..3), byte q (0..3) of lane l stand for:
//     block   kb = w >> 1                  (k offset 32*kb inside the unit)
//     n8 group j = 4 * (w & 1) + q         (column c = 64*nu + 8*j + g, g = l >> 2)
// Bit e (0..7) of that byte in plane b is bit b of the codebook index of the weight at
//     k = 64*ku + 32*kb + 16*(e >> 2) + 8*((e >> 1) & 1) + 2*t + (e & 1),   t = l & 3,
// i.e. e = 0,1 -> b0 of k16 step 2*kb, e = 2,3 -> its b1; e = 4..7 the same for step 2*kb+1.
// K = 3, 4, 5 store nibble words in the plane slots instead (slot_form below): N_s, where bit
// 4m + b of N_s is bit 4m + s of plane b (b < 4; a transpose of 4x4 bit blocks), so nibble
// m = 2q + (e >> 2) of N_s, s = e & 3, holds the low (up to four) index bits of element e of
// byte q. K=4: slots 0..3 hold N_0..N_3. K=5: N_0..N_3 of planes 0..3, then plane 4 as is.
// K=3: three slots for four nibble words of three bits each: slot b holds N_b in bits 4m..4m+2
// and bit 4m + b of N_3 in bit 4m + 3. Same bytes per unit; the kernels skip most of the
// transpose the planes would need (~1 integer op per weight).
// time with it).
// The absmax byte at [g][w][q] is the E4M4 code of (column c, block kb): the four lanes of
// one g read the same 16 bytes, which the memory system serves as one broadcast.
// Padding (columns >= N, k >= K) holds index 0 and absmax code 0, i.e. weight 0; kernels must
// still not read x beyond K (0 * NaN is NaN).
#pragma once
#include <cstdint>

namespace kbit {

constexpr int kBlock = 32;        // weights per absmax block (format constant)
constexpr int kUnitN = 64;        // columns per layout unit
constexpr int kUnitK = 64;        // k per layout unit: two blocks, so a K-tile never splits a block
constexpr int kUnitAbsmaxBytes = kUnitN * kUnitK / kBlock;  // 128
static_assert(kUnitK % kBlock == 0 && kUnitK / kBlock == 2, "a unit holds exactly two blocks");
static_assert(kUnitN == 8 * 8, "a unit is 8 n8 MMA column groups");

// What the `bits` slots of a lane's word position hold (see the header).
enum class SlotForm {
  kPlanes,          // K=2: the bit-planes
  kNibbles,         // K=4: N_0..N_3
  kNibblesPlane4,   // K=5: N_0..N_3 of planes 0..3, then plane 4
  kPackedNibbles,   // K=3: N_0..N_2 (3 bits a nibble) with N_3's bits in each nibble's bit 3
};
__host__ __device__ constexpr SlotForm slot_form(int bits) {
  return bits == 2 ? SlotForm::kPlanes
       : bits == 3 ? SlotForm::kPackedNibbles
       : bits == 4 ? SlotForm::kNibbles
                   : SlotForm::kNibblesPlane4;
}

__host__ __device__ constexpr int div_up(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int n_units(int n) { return div_up(n, kUnitN); }
__host__ __device__ constexpr int k_units(int k) { return div_up(k, kUnitK); }
// uint32 words of one unit for `bits`.
__host__ __device__ constexpr int unit_words(int bits) { return bits * 32 * 4; }

// E4M4 (exponent bias 11, subnormals) -> float. Exact: E4M4(code) == 16 * fp16_from_bits(code << 6)
// for every code, subnormals included, because fp16 has bias 15 = 11 + 4 and the same
// subnormal rule; kernels may use that form to decode two codes with one shift into a half2.
__host__ __device__ inline float decode_e4m4(uint8_t code) {
  const int e = code >> 4, m = code & 0xF;
  const float mant = e ? 1.0f + m * 0.0625f : m * 0.0625f;
  const int exp = (e ? e : 1) - 11;
  // ldexpf without the libm dependency: exp is in [-10, 4]
  return exp >= 0 ? mant * float(1 << exp) : mant / float(1 << -exp);
}

}  // namespace kbit
