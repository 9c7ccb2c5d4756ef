// One key per compiled kernel: a planner (dispatch/) returns a key, the generated selector of its
// family (<family>/<family>_kernels.h, written by csrc/generate_instantiations.py) maps the key to
// the one instantiation it names, and the launcher launches that, deciding nothing. Every field is
// a template argument of the kernel: two keys that differ name two different kernels. The launch
// parameters that are not template arguments (grid, split, cluster groups, TMA stores, PDL) are
// the plan's (dispatch/*_plan.h). Host code only, torch-free; the binding reports keys as the
// plan ops' fields and `describe` prints them (vllm_kbit.check, the benchmarks).
#pragma once
#include <cstdio>
#include <string>

#include "core/device.h"

namespace kbit {

inline const char* dtype_name(DType d) {
  return d == DType::kHalf ? "f16" : d == DType::kBFloat16 ? "bf16" : d == DType::kFloat32 ? "f32" : "e4m3";
}

// gemv/gemv_kernel.cuh: gemv_kernel<bits, mt, T, warps, wide, x_smem, slabs>.
struct GemvKey {
  int bits = 4;
  DType dtype = DType::kHalf;
  int mt = 1;            // n8 tiles of x rows: 1 (M <= 8) or 2 (8 < M <= 16)
  int warps = 8;         // warps per CTA
  bool wide = false;     // the wide-row pair table (K = 3, 4)
  bool x_smem = false;   // x through shared memory (the per-warp ring, or resident)
  int slabs = 0;         // > 0: x resident, CTAs of that many 64-column slabs
};

// mma/mma_kernel.cuh: kbit_mma_kernel<T, bits, tile config cfg (mma_config.h)>.
struct MmaKey {
  int bits = 4;
  DType dtype = DType::kHalf;
  int cfg = 1;
};

// wgmma/kernel.cuh: wgmma_kernel<bits, tile_m, columns, row_split, built_per_sm, T, split_tall>.
struct WgmmaKey {
  int bits = 4;
  DType dtype = DType::kHalf;
  int tile_m = 128;      // tokens per CTA (wgmma N)
  int columns = 256;     // columns per CTA
  int row_split = 2;     // warpgroups sharing the CTA's slabs
  int built_per_sm = 1;  // CTAs per SM the kernel is built for (its stages)
  bool split_tall = false;  // the 256-token CTA's split-K build
};

// moe/moe_gemv_kernel.cuh: moe_gemv_kernel<bits, T>.
struct MoeKey {
  int bits = 4;
  DType dtype = DType::kHalf;
};

// moe/grouped_kernel.cuh: moe_grouped_kernel<bits, tile_m, built_per_sm, T> (the grouped wgmma MoE
// GEMM, sm_90a).
struct MoeGroupedKey {
  int bits = 4;
  DType dtype = DType::kHalf;
  int tile_m = 128;      // tokens per CTA: the block_m of the sorted ids it takes (64, 128, 256)
  int built_per_sm = 1;  // CTAs per SM the kernel is built for: 1 (a producer warpgroup) or 2 (at 64)
};

// wgmma_fp8/fp8_kernel.cuh: gemm_kernel<bits, tile_m, tile_n, T> (FP8 activations, sm_90a).
struct Fp8Key {
  int bits = 4;
  DType dtype = DType::kHalf;  // of the output (x's): f16 or bf16
  int tile_m = 128;            // tokens per CTA (wgmma N): 64, 128 or 256
  int tile_n = 128;            // columns per CTA: 128, or 256 (the wide CTA, 128 tokens)
};

// repack/dequant_kernel.cuh: dequant_kernel<T, bits, stacked>.
struct DequantKey {
  int bits = 4;
  DType dtype = DType::kHalf;  // of the output: f16, bf16, f32 or e4m3 (kbit::decode_fp8)
  bool stacked = false;        // experts [E, n, k] in one launch
};

// repack/quant_kernel.cuh: quantize_kernel<T, bits>.
struct QuantKey {
  int bits = 4;
  DType dtype = DType::kHalf;  // of the input W: f16, bf16 or f32
};

inline std::string describe(const GemvKey& k) {
  char s[96];
  std::snprintf(s, sizeof s, "gemv<K%d,%s,mt%d,w%d,%s,%s,g%d>", k.bits, dtype_name(k.dtype), k.mt, k.warps,
                k.wide ? "wide" : "packed", k.x_smem ? "xsmem" : "xreg", k.slabs);
  return s;
}
inline std::string describe(const MmaKey& k) {
  char s[64];
  std::snprintf(s, sizeof s, "mma<K%d,%s,cfg%d>", k.bits, dtype_name(k.dtype), k.cfg);
  return s;
}
inline std::string describe(const WgmmaKey& k) {
  char s[96];
  std::snprintf(s, sizeof s, "wgmma<K%d,%s,mt%d,cn%d,r%d,cps%d%s>", k.bits, dtype_name(k.dtype), k.tile_m, k.columns,
                k.row_split, k.built_per_sm, k.split_tall ? ",split_tall" : "");
  return s;
}
inline std::string describe(const MoeKey& k) {
  char s[48];
  std::snprintf(s, sizeof s, "moe_gemv<K%d,%s>", k.bits, dtype_name(k.dtype));
  return s;
}
inline std::string describe(const MoeGroupedKey& k) {
  char s[48];
  std::snprintf(s, sizeof s, "moe_grouped<K%d,%s,mt%d,cps%d>", k.bits, dtype_name(k.dtype), k.tile_m, k.built_per_sm);
  return s;
}
inline std::string describe(const Fp8Key& k) {
  char s[64];
  std::snprintf(s, sizeof s, "fp8<K%d,%s,mt%d,cn%d>", k.bits, dtype_name(k.dtype), k.tile_m, k.tile_n);
  return s;
}
inline std::string describe(const DequantKey& k) {
  char s[64];
  std::snprintf(s, sizeof s, "dequantize<K%d,%s%s>", k.bits, dtype_name(k.dtype), k.stacked ? ",stacked" : "");
  return s;
}
inline std::string describe(const QuantKey& k) {
  char s[48];
  std::snprintf(s, sizeof s, "quantize<K%d,%s>", k.bits, dtype_name(k.dtype));
  return s;
}

}  // namespace kbit
