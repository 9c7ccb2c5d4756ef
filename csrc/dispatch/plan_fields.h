// The plan ops' fields (kbit::gemv_plan / mma_plan / wgmma_plan / fp8_plan): each plan as (name,
// value) pairs, its kernel's key first. The binding returns the values; vllm_kbit/ops.py names
// them in the same order (GemvPlan, MmaPlan, WgmmaPlan, Fp8Plan), which
// tests/test_plan_overrides.py checks against these pairs, value by value, on plans built here
// (tests/cpp/plan_fields_test.cu).
// Host code only, torch-free.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "core/kernel_keys.h"
#include "dispatch/fp8_plan.h"
#include "dispatch/gemv_plan.h"
#include "dispatch/mma_plan.h"
#include "dispatch/wgmma_plan.h"

namespace kbit {

using PlanFields = std::vector<std::pair<const char*, int64_t>>;

// DType as the plan ops report it: 0 fp16, 1 bf16, 2 fp32.
inline int64_t dtype_code(DType d) { return d == DType::kHalf ? 0 : d == DType::kBFloat16 ? 1 : 2; }

// The GEMV plan, then the device's cluster capacity (clusters1..8: clusters of s one-per-SM CTAs
// it runs at once; 0 without clusters).
inline PlanFields gemv_plan_fields(const GemvPlan& p, const gemv::Clusters& cl) {
  PlanFields f = {{"bits", p.key.bits},         {"dtype", dtype_code(p.key.dtype)},
                  {"mt", p.key.mt},             {"warps", p.key.warps},
                  {"wide", p.key.wide},         {"x_smem", p.key.x_smem},
                  {"slabs", p.key.slabs},       {"splits", p.splits},
                  {"chunk", p.chunk},           {"pdl", p.pdl},
                  {"pdl_trigger", p.pdl_trigger}};
  static const char* const names[gemv::kMaxSplits + 1] = {"",          "clusters1", "clusters2", "clusters3", "clusters4",
                                                          "clusters5", "clusters6", "clusters7", "clusters8"};
  for (int s = 1; s <= gemv::kMaxSplits; ++s) f.push_back({names[s], cl.n[s]});
  return f;
}

inline PlanFields mma_plan_fields(const MmaPlan& p) {
  const mma::CfgDesc d = mma::cfg_desc(p.key.cfg);
  return {{"bits", p.key.bits},
          {"dtype", dtype_code(p.key.dtype)},
          {"config", p.key.cfg},
          {"tile_m", d.tile_m},
          {"tile_n", d.tile_n},
          {"splits", p.splits},
          {"k_tiles_per_split", p.kt_per_split},
          {"items", p.items},
          {"grid", p.grid},
          {"workspace_bytes", int64_t(mma::workspace_bytes(p))}};
}

inline PlanFields wgmma_plan_fields(const WgmmaPlan& p) {
  return {{"bits", p.key.bits},
          {"dtype", dtype_code(p.key.dtype)},
          {"tile_m", p.key.tile_m},
          {"columns", p.key.columns},
          {"row_split", p.key.row_split},
          {"built_per_sm", p.key.built_per_sm},
          {"split_tall", p.key.split_tall},
          {"splits", p.splits},
          {"groups", p.groups},
          {"grid_x", p.grid_x()},
          {"token_tiles", p.token_tiles},
          {"column_groups", p.column_groups},
          {"launch_per_sm", p.launch_per_sm},
          {"chunk", p.chunk},
          {"spread", p.spread},
          {"y_tma", p.y_tma},
          {"pdl", p.pdl}};
}

inline PlanFields fp8_plan_fields(const Fp8Plan& p) {
  return {{"bits", p.key.bits},
          {"dtype", dtype_code(p.key.dtype)},
          {"tile_m", p.key.tile_m},
          {"tile_n", p.key.tile_n},
          {"token_tiles", p.token_tiles},
          {"column_groups", p.column_groups},
          {"path", static_cast<int64_t>(p.path)}};
}

inline std::vector<int64_t> field_values(const PlanFields& f) {
  std::vector<int64_t> v;
  for (const auto& e : f) v.push_back(e.second);
  return v;
}

}  // namespace kbit
