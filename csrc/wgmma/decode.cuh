// The wgmma kernel's A operand: one plane word of a lane's unit decoded (core/decode.cuh) into the
// register fragments of wgmma's m64 row tiles.
#pragma once
#include "wgmma/ptx.cuh"

namespace kbit {
namespace wg {

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

}  // namespace wg
}  // namespace kbit
