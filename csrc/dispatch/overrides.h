// Plan overrides: what a test or a benchmark may force in the launch plans, passed explicitly to
// the path-forcing op (kbit::gemm_path), the FP8 GEMM's test hook (kbit::gemm_fp8_quantized), the
// grouped MoE GEMM (kbit::moe_gemm_grouped) and the plan ops (kbit::gemv_plan / mma_plan / wgmma_plan / fp8_plan) as one string of comma-separated `key=value` fields. kbit::gemm never takes overrides: its
// plans depend on the shape and the device alone. Host code only, torch-free (the CPU replays in
// tests/cpp parse the same strings).
//
// Keys (integers; booleans are 0 / 1; 0, or -1 where 0 is a value, means "the plan's own choice"):
//   pdl                  0: launch without programmatic dependent launch (sm_90; default 1)
//   pdl_trigger          0: the GEMV at M <= 8 does not let the next kernel launch early (default 1)
//   dequant.chunk_mib    scratch budget of the dequantize + cuBLAS path in MiB (default 256)
//   gemv.warps           4 | 8 | 16 warps per CTA (classic kernels)
//   gemv.slabs           2 | 4 | 15 | 16: x resident in CTAs of that many slabs, where it fits
//   gemv.x_resident      0: never x resident
//   gemv.wide_table      0: the packed pair table, never the wide-row one
//   gemv.x_smem          0: at 8 < M <= 16, x in registers (the kernel of devices without the ring)
//   mma.config           0 | 1 | 2: the tile config (cfg_desc; -1: the plan's)
//   mma.splits           1..64: the split-K factor with a forced config (default 1)
//   wgmma.tile_m         16 | 32 | 64 | 128 | 256 tokens per CTA
//   wgmma.groups         1: no cluster groups; G >= 2: K split over G clusters
//   wgmma.one_per_sm     0 | 1: the 64-token tile built for two / one CTA per SM (-1: the plan's)
//   wgmma.row_split      1 | 2 warpgroups sharing a CTA's slabs at 32-token tiles
//   wgmma.max_splits     1..16: the largest cluster the split choice considers
//   wgmma.split_cost     the reduction cost of a split at 128-token tiles (choose_splits' units;
//                        -1: wgmma_split_cost128)
//   wgmma.wide           1: 512-column CTAs at tiles of <= 64 tokens
//   wgmma.spread         0: never launch with half an SM's shared memory
//   wgmma.y_tma          0: unsplit calls store y element by element, not through TMA
//   wgmma.tall_split     0: 256-token tiles never split along K
//   wgmma.zeroed_counters 0: cluster-group counters zeroed in the workspace, not kept zero
//   moe.one_per_sm       0 | 1: the grouped MoE GEMM's 64-token CTA built for two / one per SM
//                        (-1: the launch's choice, launch_moe_grouped)
//   fp8.tile_m           64 | 128 | 256: the FP8 GEMM's tokens per CTA (with fp8.tile_n: the tile;
//   fp8.tile_n           128 | 256: its columns per CTA     either alone: the other 128)
//   fp8.path             -1 | 0 | 1 | 2: kbit::gemm_fp8's path (fp8::Path): 0 the fused kernel,
//                        1 decode to e4m3 + an FP8 scaled_mm (where one serves the shape, else
//                        the fused kernel), 2 the 16-bit kbit::gemm; -1 the plan's choice
//                        the tiles: 64 x 128, 128 x 128, 256 x 128, 128 x 256
#pragma once
#include <cstdlib>
#include <initializer_list>
#include <string>

namespace kbit {

struct GemvOverrides {
  int warps = 0;            // 0: the plan's
  int slabs = 0;            // 0: the plan's
  bool x_resident = true;
  bool wide_table = true;
  bool x_smem = true;
};

struct MmaOverrides {
  int config = -1;          // -1: the cost model's
  int splits = 1;           // with a forced config
};

struct WgmmaOverrides {
  int tile_m = 0;           // 0: the plan's
  int groups = 0;           // 0: the plan's, 1: none, >= 2: forced
  int one_per_sm = -1;      // -1: the plan's
  int row_split = 0;        // 0: the plan's
  int max_splits = 0;       // 0: the device's largest cluster
  int split_cost = -1;      // -1: wgmma_split_cost128
  bool wide = false;
  bool spread = true;
  bool y_tma = true;
  bool tall_split = true;
  bool zeroed_counters = true;
};

struct Fp8Overrides {
  int tile_m = 0;           // 0 with tile_n 0: the plan's; 0 with tile_n set: 128
  int tile_n = 0;           // 0 with tile_m 0: the plan's; 0 with tile_m set: 128
  int path = -1;            // -1: the plan's; else an fp8::Path (dispatch/fp8_plan.h)
};

struct MoeOverrides {
  int one_per_sm = -1;      // -1: the launch's choice
};
struct PlanOverrides {
  bool pdl = true;
  bool pdl_trigger = true;
  long long dequant_chunk_mib = 0;  // 0: kDequantChunkMib
  GemvOverrides gemv;
  MmaOverrides mma;
  WgmmaOverrides wgmma;
  Fp8Overrides fp8;
  MoeOverrides moe;
};

// Parses `text` ("key=value,key=value", spaces allowed around fields) into *out, starting from
// the defaults. Returns an empty string, or what is wrong (naming the field).
inline std::string parse_overrides(const std::string& text, PlanOverrides* out) {
  *out = PlanOverrides{};
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    std::string field = text.substr(pos, end - pos);
    pos = end + 1;
    const size_t a = field.find_first_not_of(" \t"), b = field.find_last_not_of(" \t");
    if (a == std::string::npos) continue;
    field = field.substr(a, b - a + 1);
    const size_t eq = field.find('=');
    if (eq == std::string::npos) return "override '" + field + "' is not key=value";
    const std::string key = field.substr(0, eq);
    const std::string value = field.substr(eq + 1);
    char* tail = nullptr;
    const long long v = std::strtoll(value.c_str(), &tail, 10);
    if (value.empty() || *tail != '\0') return "override " + key + ": '" + value + "' is not an integer";
    const auto in = [&](long long lo, long long hi) { return v >= lo && v <= hi; };
    const auto one_of = [&](std::initializer_list<long long> allowed) {
      for (const long long x : allowed)
        if (v == x) return true;
      return false;
    };
    const auto flag = [&](bool* f) {
      if (!in(0, 1)) return false;
      *f = v != 0;
      return true;
    };
    bool ok = true;
    if (key == "pdl") ok = flag(&out->pdl);
    else if (key == "pdl_trigger") ok = flag(&out->pdl_trigger);
    else if (key == "dequant.chunk_mib") ok = in(0, 1 << 20) && (out->dequant_chunk_mib = v, true);
    else if (key == "gemv.warps") ok = one_of({0, 4, 8, 16}) && (out->gemv.warps = int(v), true);
    else if (key == "gemv.slabs") ok = one_of({0, 2, 4, 15, 16}) && (out->gemv.slabs = int(v), true);
    else if (key == "gemv.x_resident") ok = flag(&out->gemv.x_resident);
    else if (key == "gemv.wide_table") ok = flag(&out->gemv.wide_table);
    else if (key == "gemv.x_smem") ok = flag(&out->gemv.x_smem);
    else if (key == "mma.config") ok = in(-1, 2) && (out->mma.config = int(v), true);
    else if (key == "mma.splits") ok = in(1, 64) && (out->mma.splits = int(v), true);
    else if (key == "wgmma.tile_m") ok = one_of({0, 16, 32, 64, 128, 256}) && (out->wgmma.tile_m = int(v), true);
    else if (key == "wgmma.groups") ok = in(0, 16) && (out->wgmma.groups = int(v), true);
    else if (key == "wgmma.one_per_sm") ok = in(-1, 1) && (out->wgmma.one_per_sm = int(v), true);
    else if (key == "wgmma.row_split") ok = in(0, 2) && (out->wgmma.row_split = int(v), true);
    else if (key == "wgmma.max_splits") ok = in(0, 16) && (out->wgmma.max_splits = int(v), true);
    else if (key == "wgmma.split_cost") ok = in(-1, 1 << 20) && (out->wgmma.split_cost = int(v), true);
    else if (key == "wgmma.wide") ok = flag(&out->wgmma.wide);
    else if (key == "wgmma.spread") ok = flag(&out->wgmma.spread);
    else if (key == "wgmma.y_tma") ok = flag(&out->wgmma.y_tma);
    else if (key == "wgmma.tall_split") ok = flag(&out->wgmma.tall_split);
    else if (key == "wgmma.zeroed_counters") ok = flag(&out->wgmma.zeroed_counters);
    else if (key == "moe.one_per_sm") ok = in(-1, 1) && (out->moe.one_per_sm = int(v), true);
    else if (key == "fp8.tile_m") ok = one_of({0, 64, 128, 256}) && (out->fp8.tile_m = int(v), true);
    else if (key == "fp8.tile_n") ok = one_of({0, 128, 256}) && (out->fp8.tile_n = int(v), true);
    else if (key == "fp8.path") ok = in(-1, 2) && (out->fp8.path = int(v), true);
    else return "unknown override '" + key + "' (csrc/dispatch/overrides.h lists the keys)";
    if (!ok) return "override " + key + "=" + value + " is out of range (csrc/dispatch/overrides.h)";
  }
  if (out->fp8.tile_n == 256 && out->fp8.tile_m != 0 && out->fp8.tile_m != 128)
    return "overrides fp8.tile_m=" + std::to_string(out->fp8.tile_m) +
           ",fp8.tile_n=256: the FP8 GEMM's tiles are 64 x 128, 128 x 128, 256 x 128 and 128 x 256";
  return "";
}

}  // namespace kbit
