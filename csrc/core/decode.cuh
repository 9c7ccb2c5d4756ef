// Codebook decode of the tiled layout into tensor-core operand registers, shared by the GEMV
// (mma.sync) and the wgmma kernel (torch-free). Both use W as the A operand (Y^T = W X^T):
// a lane's 16 bytes per bit-plane (core/layout.cuh) are the A fragments of the four m16 row
// tiles of a 64-column unit, two 32-blocks deep.
//
// The decoder pairs elements so that one table lookup yields one 32-bit operand register
// (two weights). The pairs are not the MMA's natural (k, k+1): K=3..5 pair elements (e, e+4)
// of the layout byte, K=2 pairs (e, e+2). Because an MMA sums over k in any order, the GEMV
// permutes its x operand to match (PRMT on x registers; the table below says how). The wgmma
// kernel takes x as stored (a TMA box) and regroups the decoded pairs into the natural order
// instead (a PRMT a register, wgmma/decode.cuh decode_row_tile), or at K=5, whose pairs are two
// shuffled values joined by one PRMT anyway, joins (e, e+1) directly (Decoder::natural_pair).
//
// Operand-register slots of one k16 step (m16n8k16 / wgmma A and B fragments, t = lane % 4):
// slots 2t, 2t+1 (register 0 / b0) and 2t+8, 2t+9 (register 2 / b1). With the pairing above,
// slot -> k offset inside a 32-block of x is, for step 0 and step 1 of the block:
//   K=3..5:  2t -> 2t,    2t+1 -> 2t+16,  2t+8 -> 2t+1,  2t+9 -> 2t+17   (step 1: +8)
//   K=2:     2t -> 2t,    2t+1 -> 2t+8,   2t+8 -> 2t+1,  2t+9 -> 2t+9    (step 1: +16)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "core/common.cuh"
#include "core/layout.cuh"

namespace kbit {

// Replicas of the shared-memory pair table: replica r serves lanes r, r + kLutReplicas, ..., so
// with 32 every lane owns a bank (conflict-free lookups) and with 16 two lanes share one (a
// 2-way conflict where their entries differ) for half the shared memory.
constexpr int kLutReplicas = 32;
static_assert(kLutReplicas == 32 || kLutReplicas == 16 || kLutReplicas == 8, "pair-table replicas: 32, 16 or 8");

// Per bit width: where the codebook lives and how x is paired.
template <int BITS> struct PairTable {
  static_assert(BITS >= 2 && BITS <= 5, "kbit supports 2..5 bits");
  // shared-memory pair table entries (pair index = idx_a | idx_b << 4), 0 when lanes hold it
  static constexpr int kLutEntries = BITS == 4 ? 256 : BITS == 3 ? 128 : 0;
  // entry v of replica r is word kLutReplicas v + r (bank r)
  static constexpr int kLutBytes = kLutEntries * kLutReplicas * 4;
  static constexpr int kRowShift = kLutReplicas == 32 ? 7 : kLutReplicas == 16 ? 6 : 5;  // log2(bytes per entry)
  // The same table with entries 256 B apart from a 64 KB-aligned shared address ("wide" rows,
  // half of each row unused): then the address of entry v for lane l is a byte permutation of
  // (v, 4 l, the table's high bytes), one PRMT instead of PRMT + LEA (Decoder::pair).
  static constexpr int kWideLutBytes = kLutEntries * 256;
  // x pairing: K=2 pairs elements (e, e+2) of a byte, the nibble schemes pair (e, e+4)
  static constexpr bool kCrumbPairs = BITS == 2;
};

// The codebook as the decoder reads it, every value multiplied by `mult` (1 where the block
// scale is applied in fp32 after the MMA; codebook_mult<T>() where scale2 / hmul2 scale the
// weights before it).
// K=3,4: writes the replicated pair table to `lut` (all threads of the CTA take part; the
// caller synchronises). K=2: returns this lane's entry of the 16-entry pair table;
// K=5: this lane's codebook value (32 entries = 32 lanes), as a pair of equal values.
template <int BITS, typename T, bool kWideRows = false>
__device__ __forceinline__ uint32_t init_codebook(const float* codebook, float mult, uint32_t* lut, int tid,
                                                  int nthreads) {
  const int lane = tid & 31;
  if constexpr (BITS == 2) {
    return pack2<T>(mult * __ldg(codebook + (lane & 3)), mult * __ldg(codebook + ((lane >> 2) & 3)));
  } else if constexpr (BITS == 5) {
    const float v = mult * __ldg(codebook + lane);
    return pack2<T>(v, v);
  } else {
    constexpr int kEntries = PairTable<BITS>::kLutEntries;
    constexpr int kMask = (1 << BITS) - 1;
    uint4* lut4 = reinterpret_cast<uint4*>(lut);
    constexpr int kPer = kLutReplicas / 4;  // uint4 per entry
    for (int i = tid; i < kEntries * kPer; i += nthreads) {
      const int v = i / kPer;
      const uint32_t e = pack2<T>(mult * __ldg(codebook + (v & kMask)), mult * __ldg(codebook + ((v >> 4) & kMask)));
      lut4[kWideRows ? v * 16 + i % kPer : i] = make_uint4(e, e, e, e);  // wide rows: 256 B = 16 uint4
    }
    return 0u;
  }
}

// Half2 of the E4M4 scale of column q (byte q of `codes`) in the operand type, without the
// format's constant (for kernels that scale the weights before the MMA): fp16 bits (code << 6) are E4M4 / 16, bf16 bits (code << 3) E4M4 / 2^116
// (exact, subnormals included; core/layout.cuh). The codebook carries the constant instead.
template <typename T> __device__ __forceinline__ uint32_t scale2(uint32_t codes, int q) {
  const uint32_t c2 = prmt(codes, 0u, 0x4040u | uint32_t(q) | (uint32_t(q) << 8));  // code | code << 16
  return std::is_same<T, __half>::value ? c2 << 6 : c2 << 3;
}
template <typename T> constexpr float codebook_mult() { return std::is_same<T, __half>::value ? 16.f : 0x1p116f; }

template <typename T> __device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  using V = typename Vec2<T>::type;
  const V r = __hmul2(*reinterpret_cast<const V*>(&a), *reinterpret_cast<const V*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

__device__ __forceinline__ uint32_t comp(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;  // i is a compile-time constant
}

// Nibble word N_s (s = 0..3) of one lane's word position: nibble m holds the low (up to 4)
// index bits of the element at bit 4m + s of the plane words (bit 4m + b of N_s = bit 4m + s
// of plane b: a transpose of 4x4 bit blocks, 2 ops per plane). The tiled layout stores them
// (core/layout.cuh, slot_form): a register move at K = 4, 5, one AND at K=3 (N_3: five ops);
// only K=2 keeps planes and transposes here (its Decoder reads crumbs instead).
template <int BITS>
__device__ __forceinline__ uint32_t transpose_nibbles(const uint32_t (&p)[BITS], int s) {
  constexpr int kLow = BITS < 4 ? BITS : 4;
  uint32_t v = 0;
#pragma unroll
  for (int b = 0; b < kLow; ++b) {
    const uint32_t sh = b >= s ? (p[b] << (b - s)) : (p[b] >> (s - b));
    v |= sh & (0x11111111u << b);
  }
  return v;
}
template <int BITS>
__device__ __forceinline__ uint32_t nibble_word(const uint32_t (&p)[BITS], int s) {
  constexpr SlotForm kForm = slot_form(BITS);
  if constexpr (kForm == SlotForm::kNibbles || kForm == SlotForm::kNibblesPlane4) {
    return p[s];
  } else if constexpr (kForm == SlotForm::kPackedNibbles) {
    // slot b: N_b in bits 4m..4m+2, bit 4m + b of N_3 in bit 4m + 3
    if (s == 3) return ((p[0] >> 3) & 0x11111111u) | ((p[1] >> 2) & 0x22222222u) | ((p[2] >> 1) & 0x44444444u);
    return p[s % 3] & 0x77777777u;
  } else {
    return transpose_nibbles<BITS>(p, s);
  }
}

// The layout words of one word position for all planes -> index words (the mma.sync kernel).
// BITS <= 4: v[e'] (e' = 0..3) = N_e' holds, in nibble 2q+h, the index of the weight at bit
//   e = 4h + e' of byte q (n8 group q of the word, k16 step parity h).
// BITS == 5: v[e] (e = 0..7) holds in byte q the index of element e of byte q.
template <int BITS>
struct IndexWords {
  static constexpr int kN = BITS <= 4 ? 4 : 8;
  uint32_t v[kN];
  __device__ __forceinline__ void build(const uint32_t (&pl)[BITS]) {
    if constexpr (BITS <= 4) {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = nibble_word<BITS>(pl, e);
    } else {
      // element e of byte q: low four bits in nibble 2q + (e >> 2) of N_(e & 3), bit 4 in bit
      // 8q + e of plane 4 (slot_form kNibblesPlane4)
#pragma unroll
      for (int e = 0; e < 8; ++e)
        v[e] = ((e < 4 ? pl[e & 3] : pl[e & 3] >> 4) & 0x0F0F0F0Fu) | (((pl[4] >> e) & 0x01010101u) << 4);
    }
  }
  // Source lane for the weight at bit e = 4h + ep of byte q; only bits [4:0] matter to shfl
  // and the codebook registers repeat with period 2^BITS, so no mask is needed.
  // (q, h, ep are compile-time constants once the caller's loops are unrolled.)
  __device__ __forceinline__ uint32_t lane_of(int q, int h, int ep) const {
    if constexpr (BITS <= 4) {
      return v[ep] >> (4 * (2 * q + h));
    } else {
      return v[4 * h + ep] >> (8 * q);
    }
  }
};

// The 4 pairs of column q (byte q of the plane words) for one block, from one word of each
// plane. The MMA takes pairs 0,1 in its first k16 step and pairs 2,3 in the second.
// kWideLut (K=3,4): the pair table has wide rows (PairTable::kWideLutBytes) and `lut_addr` is
// the PRMT key (table address & 0xFFFF0000) | 4 lane instead of this lane's replica address.
template <int BITS, typename T, bool kWideLut = false> struct Decoder {
  // K=2: 2 crumb words; K=3,4: nibble words N_0..N_3; K=5: byte-field words E_0..3, O_0..3
  static constexpr int kWords = BITS == 2 ? 2 : BITS == 5 ? 8 : 4;
  uint32_t words[kWords];

  __device__ __forceinline__ void load(const uint32_t (&p)[BITS]) {
    if constexpr (BITS == 2) {
      // 2-bit field i of words[0] = index of element 2i, of words[1] = index of element 2i+1;
      // so nibble 2q of words[0] is the pair (0, 2) of column q, nibble 2q+1 the pair (4, 6)
      words[0] = (p[0] & 0x55555555u) | ((p[1] << 1) & 0xAAAAAAAAu);
      words[1] = ((p[0] >> 1) & 0x55555555u) | (p[1] & 0xAAAAAAAAu);
    } else {
      // N_s (nibble_word): nibble m = index of element 4m + s, so byte q of N_s is the pair
      // (s, s+4) of column q
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint32_t v = nibble_word<BITS>(p, s);
        if constexpr (BITS == 5) {
          // widen to byte fields and add plane 4 as bit 4: E_s byte q = index of element s
          // of column q, O_s byte q = index of element s + 4
          const uint32_t h = (p[4] >> s) & 0x11111111u;  // bit 4m: plane 4 of element 4m + s
          words[s] = (v & 0x0F0F0F0Fu) | ((h << 4) & 0x10101010u);
          words[4 + s] = ((v >> 4) & 0x0F0F0F0Fu) | (h & 0x10101010u);
        } else {
          words[s] = v;
        }
      }
    }
  }

  // K=5: pair j (0..3) of column q in natural k order, as the m16n8k16 A register of k16 step
  // j >> 1, slot 2t (j even) or 2t + 8 (j odd): k = (2t, 2t + 1) + 8 (j & 1) + 16 (j >> 1) inside
  // the 32-block. pair() joins elements (e, e + 4) of the byte, i.e. k and k + 16, which the
  // wgmma kernel must regroup (a PRMT a register); joining (e, e + 1) instead costs the same two
  // shuffles and one PRMT. (K=3,4 would have to rebuild their nibble words for it, two ops a
  // word, which measured no faster.)
  __device__ __forceinline__ uint32_t natural_pair(int q, int j, uint32_t table) const {
    static_assert(BITS == 5, "byte-field words only");
    const int w = 4 * (j >> 1) + 2 * (j & 1);  // E_2i (elements e < 4) or O_2i (e + 4)
    return prmt(shfl_lut(table, words[w] >> (8 * q)), shfl_lut(table, words[w + 1] >> (8 * q)), 0x5410);
  }

  // pair s (0..3) of column q (0..3) as one 32-bit operand register (lo16 = first element)
  __device__ __forceinline__ uint32_t pair(int q, int s, uint32_t lut_addr, uint32_t table) const {
    if constexpr (BITS == 2) {
      // crumb pairs: s = 0: (0,2), 1: (1,3), 2: (4,6), 3: (5,7); one shuffle per pair
      return shfl_lut(table, words[s & 1] >> (8 * q + 4 * (s >> 1)));
    } else if constexpr (BITS == 5) {
      // one shuffle per element (32-entry table = 32 lanes), PRMT joins the pair (s, s+4)
      return prmt(shfl_lut(table, words[s] >> (8 * q)), shfl_lut(table, words[4 + s] >> (8 * q)), 0x5410);
    } else if constexpr (kWideLut) {
      static_assert(kLutReplicas == 32, "wide rows hold 32 replicas");
      // address bytes: [4 lane, byte q of N_s (the entry), the table's bytes 2, 3]
      return lds_u32(prmt(words[s], lut_addr, 0x7604u | (uint32_t(q) << 4)));
    } else {
      // shared-memory pair table, this lane's replica (lut_addr): entry v = byte q of N_s at
      // byte offset 4 kLutReplicas v from it; PRMT extracts the byte, LEA adds it
      const uint32_t v = prmt(words[s], 0u, 0x4440u | uint32_t(q));
      return lds_u32(lut_addr + (v << PairTable<BITS>::kRowShift));
    }
  }
};

}  // namespace kbit
