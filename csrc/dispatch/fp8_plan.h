// The FP8-activation GEMM's launch plan (wgmma_fp8/): whether the weights are decoded first (then
// an FP8 GEMM), else the fused kernel's CTA tile, from the shape, the SM count and the device's
// table (dispatch/heuristics.h), or forced by the overrides (fp8.decode_first, fp8.tile_m /
// fp8.tile_n). A pure function: the grid is the same on every call with these shapes (CUDA-graph
// safe, no host sync). Host code only, torch-free.
#pragma once
#include "core/kernel_keys.h"
#include "core/layout.cuh"
#include "dispatch/heuristics.h"
#include "dispatch/overrides.h"

namespace kbit {
namespace fp8 {

struct Plan {
  Fp8Key key;         // the kernel: bit width, output dtype, tile
  int token_tiles;    // grid x: div_up(m, tile_m)
  int column_groups;  // grid y: 64-column slabs in groups of tile_n / 64
  // Instead of the kernel: kbit::decode_fp8 writes W as e4m3 once (the same rounding), x is
  // quantized in natural k order, and an FP8 GEMM with per-token scales multiplies them. From
  // fp8_decode_min_m tokens the fused kernel's decode, repeated for every token tile, costs
  // more than one pass that writes a byte a weight.
  bool decode_first;
};

// Whether `ctas` CTAs fill `percent` % of the SMs.
inline bool fills(long long ctas, int percent, int num_sms) { return ctas * 100 >= (long long)percent * num_sms; }

// 128 tokens x 256 columns (the wide CTA, one per SM) where those CTAs fill the SMs: the x tile
// serves twice the columns, and the shared-memory fills from L2 are what bound the 128 x 128
// tile at large M. Else 128 x 128 (two per SM) where those fill them, else 64 x 128. 256 x 128
// is forced only.
// decode_first only where `scaled_mm` says an FP8 GEMM is at hand for this shape and dtype.
inline Plan plan(const Heuristics& h, int m, int n, int bits, DType dtype, int num_sms, const Fp8Overrides& o,
                 bool scaled_mm = false) {
  if (num_sms < 1) num_sms = 1;
  Plan p{};
  p.decode_first = scaled_mm && (o.decode_first == -1 ? m >= h.fp8_decode_min_m : o.decode_first == 1);
  p.key.bits = bits;
  p.key.dtype = dtype;
  if (o.tile_m != 0 || o.tile_n != 0) {
    p.key.tile_m = o.tile_m != 0 ? o.tile_m : 128;
    p.key.tile_n = o.tile_n != 0 ? o.tile_n : 128;
  } else {
    const long long tiles128 = div_up(m, 128), groups128 = div_up(n_units(n), 2), groups256 = div_up(n_units(n), 4);
    if (fills(tiles128 * groups256, h.fp8_wide_fill_percent, num_sms)) {
      p.key.tile_m = 128, p.key.tile_n = 256;
    } else if (fills(tiles128 * groups128, h.fp8_tile128_fill_percent, num_sms)) {
      p.key.tile_m = 128, p.key.tile_n = 128;
    } else {
      p.key.tile_m = 64, p.key.tile_n = 128;
    }
  }
  p.token_tiles = div_up(m, p.key.tile_m);
  p.column_groups = div_up(n_units(n), p.key.tile_n / kUnitN);
  return p;
}

}  // namespace fp8

using Fp8Plan = fp8::Plan;

}  // namespace kbit
