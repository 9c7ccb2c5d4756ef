// kbit::gemm_fp8's plan: its path (fused kernel, decode-first + FP8 GEMM, or the 16-bit kbit::gemm)
// and the fused kernel's CTA tile, from the shape, the SM count and the device's table
// (dispatch/heuristics.h), or forced by the overrides (fp8.path, fp8.tile_m / fp8.tile_n). A pure function: the grid is the same on every call with these shapes (CUDA-graph
// safe, no host sync). Host code only, torch-free.
#pragma once
#include "core/kernel_keys.h"
#include "core/layout.cuh"
#include "dispatch/heuristics.h"
#include "dispatch/overrides.h"

namespace kbit {
namespace fp8 {

// kbit::gemm_fp8's three ways to compute a layer with FP8 activations (the overrides' fp8.path).
enum class Path : int {
  kFused = 0,        // the kernel of `key`: weights decoded in registers, every token tile again
  kDecodeFirst = 1,  // kbit::decode_fp8 writes W as e4m3 once (the fused kernel's rounding), x is
                     // quantized in natural k order, an FP8 GEMM with per-token scales multiplies
  kSixteenBit = 2,   // kbit::gemm with the 16-bit activations: where it is the faster of the three
};

struct Plan {
  Fp8Key key;         // the fused kernel: bit width, output dtype, tile
  int token_tiles;    // its grid x: div_up(m, tile_m)
  int column_groups;  // its grid y: 64-column slabs in groups of tile_n / 64
  Path path;          // what kbit::gemm_fp8 runs
};

// Whether `ctas` CTAs fill `percent` % of the SMs.
inline bool fills(long long ctas, int percent, int num_sms) { return ctas * 100 >= (long long)percent * num_sms; }

// 128 tokens x 256 columns (the wide CTA, one per SM) where those CTAs fill the SMs: the x tile
// serves twice the columns, and the shared-memory fills from L2 are what bound the 128 x 128
// tile at large M. Else 128 x 128 (two per SM) where those fill them, else 64 x 128. 256 x 128
// is forced only.
// The path: decode-first from fp8_decode_min_m tokens where `scaled_mm` says an FP8 GEMM serves
// this shape and dtype, the fused kernel from fp8_fused_min_m, else the 16-bit path: on the H100
// the fused kernel measured slower than the 16-bit kbit::gemm at every M (docs/PERFORMANCE.md),
// so it runs only where forced. A forced decode-first without a scaled_mm runs the fused kernel.
inline Path choose_path(const Heuristics& h, int m, bool scaled_mm, int forced) {
  if (forced >= 0) return forced == 1 && !scaled_mm ? Path::kFused : Path(forced);
  if (scaled_mm && m >= h.fp8_decode_min_m) return Path::kDecodeFirst;
  return m >= h.fp8_fused_min_m ? Path::kFused : Path::kSixteenBit;
}

inline Plan plan(const Heuristics& h, int m, int n, int bits, DType dtype, int num_sms, const Fp8Overrides& o,
                 bool scaled_mm = false) {
  if (num_sms < 1) num_sms = 1;
  Plan p{};
  p.path = choose_path(h, m, scaled_mm, o.path);
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

// What the plan runs, as vllm_kbit.ops.Fp8Plan.kernel names it.
inline std::string describe(const Plan& p) {
  char s[64];
  if (p.path == Path::kDecodeFirst) {
    std::snprintf(s, sizeof s, "decode_fp8<K%d>+scaled_mm<%s>", p.key.bits, dtype_name(p.key.dtype));
    return s;
  }
  if (p.path == Path::kSixteenBit) {
    std::snprintf(s, sizeof s, "gemm<K%d,%s>", p.key.bits, dtype_name(p.key.dtype));
    return s;
  }
  return kbit::describe(p.key);
}

}  // namespace fp8

using Fp8Plan = fp8::Plan;

}  // namespace kbit
