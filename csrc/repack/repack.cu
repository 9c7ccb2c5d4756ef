// Repack: checkpoint layout (format.py) -> the tiled layout of core/layout.cuh.
// Runs once per weight at load time; it is a pure gather, so it favours plain index math over
// speed (one thread per output word; reads hit L2 because the 4 lanes of a column group and
// the neighbouring words read the same source words).
#include <cstdint>

#include "core/layout.cuh"
#include "dispatch/launchers.h"

namespace kbit {
namespace {

// The 8 bits of one (column, block, plane, lane) byte. Source word `src` holds bit i of the
// 32 elements of the block; the byte's bit e is element
//   i(e) = 16*(e>>2) + 8*((e>>1)&1) + 2*t + (e&1)
// so after shifting by 2t the wanted bits sit at 0,1 | 8,9 | 16,17 | 24,25.
__device__ __forceinline__ uint32_t gather_byte(uint32_t src, int t) {
  const uint32_t s = src >> (2 * t);
  return (s & 0x3u) | ((s >> 6) & 0xCu) | ((s >> 12) & 0x30u) | ((s >> 18) & 0xC0u);
}

// Word w of plane b of one lane (g, t) of a unit: the bytes of its 4 n8 groups.
__device__ __forceinline__ uint32_t plane_word(const uint32_t* __restrict__ qweight, int n, int nb, int bits, int nu,
                                               int jb, int g, int t, int w, int b) {
  uint32_t out = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int c = nu * kUnitN + 8 * (4 * (w & 1) + q) + g;
    if (c < n) {
      const uint32_t src = __ldg(qweight + (long long)c * nb * bits + (long long)jb * bits + b);
      out |= gather_byte(src, t) << (8 * q);
    }
  }
  return out;
}

// Nibble word N_s of planes 0..min(bits, 4) - 1: bit 4m + p of N_s = bit 4m + s of plane p.
__device__ __forceinline__ uint32_t nibble_word_of(const uint32_t* __restrict__ qweight, int n, int nb, int bits,
                                                   int nu, int jb, int g, int t, int w, int s) {
  uint32_t v = 0;
  for (int p = 0; p < (bits < 4 ? bits : 4); ++p) {
    const uint32_t pw = plane_word(qweight, n, nb, bits, nu, jb, g, t, w, p);
    const uint32_t sh = p >= s ? (pw << (p - s)) : (pw >> (s - p));
    v |= sh & (0x11111111u << p);
  }
  return v;
}

// One thread per packed word: word index = ((unit * bits + b) * 32 + lane) * 4 + w. Slot b
// holds what slot_form(bits) says (core/layout.cuh).
__global__ void repack_packed_kernel(const uint32_t* __restrict__ qweight, uint32_t* __restrict__ packed,
                                     int n, int k, int bits, long long total_words) {
  const int ku_count = k_units(k);
  const int nb = k / kBlock;  // blocks per row in the checkpoint
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total_words;
       idx += (long long)gridDim.x * blockDim.x) {
    const int w = int(idx & 3);
    const int lane = int((idx >> 2) & 31);
    const long long r = idx >> 7;  // unit * bits + b
    const int b = int(r % bits);
    const long long unit = r / bits;
    const int ku = int(unit % ku_count);
    const int nu = int(unit / ku_count);
    const int g = lane >> 2, t = lane & 3;
    const int jb = 2 * ku + (w >> 1);  // block index along K
    uint32_t out = 0;
    if (jb < nb) {
      switch (slot_form(bits)) {
        case SlotForm::kPlanes: out = plane_word(qweight, n, nb, bits, nu, jb, g, t, w, b); break;
        case SlotForm::kNibbles: out = nibble_word_of(qweight, n, nb, bits, nu, jb, g, t, w, b); break;
        case SlotForm::kNibblesPlane4:
          out = b < 4 ? nibble_word_of(qweight, n, nb, bits, nu, jb, g, t, w, b)
                      : plane_word(qweight, n, nb, bits, nu, jb, g, t, w, b);
          break;
        case SlotForm::kPackedNibbles:  // N_b, and bit 4m + b of N_3 in bit 4m + 3
          out = nibble_word_of(qweight, n, nb, bits, nu, jb, g, t, w, b) |
                (((nibble_word_of(qweight, n, nb, bits, nu, jb, g, t, w, 3) >> b) & 0x11111111u) << 3);
          break;
      }
    }
    packed[idx] = out;
  }
}

// One thread per 4 absmax bytes: word index = unit * 32 + g * 4 + w, byte q of it.
__global__ void repack_absmax_kernel(const uint8_t* __restrict__ absmax, uint32_t* __restrict__ absmax_packed,
                                     int n, int k, long long total_words) {
  const int ku_count = k_units(k);
  const int nb = k / kBlock;
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total_words;
       idx += (long long)gridDim.x * blockDim.x) {
    const int w = int(idx & 3);
    const int g = int((idx >> 2) & 7);
    const long long unit = idx >> 5;
    const int ku = int(unit % ku_count);
    const int nu = int(unit / ku_count);
    const int jb = 2 * ku + (w >> 1);
    uint32_t out = 0;
    if (jb < nb) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int c = nu * kUnitN + 8 * (4 * (w & 1) + q) + g;
        if (c < n) out |= uint32_t(__ldg(absmax + (long long)c * nb + jb)) << (8 * q);
      }
    }
    absmax_packed[idx] = out;
  }
}

int grid_for(long long work, int threads) {
  const long long blocks = (work + threads - 1) / threads;
  return int(blocks < (1 << 20) ? (blocks > 0 ? blocks : 1) : (1 << 20));  // grid-stride beyond
}

}  // namespace

static_assert(kUnitAbsmaxBytes == 32 * 4, "absmax of a unit is 32 words: [8 g][4 w] of 4 bytes");

cudaError_t launch_repack(const uint32_t* qweight, const uint8_t* absmax, uint32_t* packed,
                          uint8_t* absmax_packed, int n, int k, int bits, cudaStream_t stream) {
  if (n <= 0 || k <= 0 || k % kBlock != 0 || bits < 2 || bits > 5) return cudaErrorInvalidValue;
  const long long units = (long long)n_units(n) * k_units(k);
  const long long words = units * unit_words(bits);
  const long long abs_words = units * (kUnitAbsmaxBytes / 4);
  constexpr int kThreads = 256;
  repack_packed_kernel<<<grid_for(words, kThreads), kThreads, 0, stream>>>(qweight, packed, n, k, bits, words);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  repack_absmax_kernel<<<grid_for(abs_words, kThreads), kThreads, 0, stream>>>(
      absmax, reinterpret_cast<uint32_t*>(absmax_packed), n, k, abs_words);
  return cudaGetLastError();
}

}  // namespace kbit
