// CPU check of the GEMV launch plan (csrc/dispatch/gemv_plan.h), built and run by
// tests/test_gemv_plan.py with nvcc: host code only, no GPU needed. Two kinds of checks:
//   * the choices the H200 measurements chose (132 SMs; benchmarks/results, csrc/dispatch/gemv_plan.h
//     says which run): Llama-3-8B's four decode layers, an lm_head, Llama-3-70B's gate_up,
//     Phi-3-mini's qkv;
//   * invariants over a sweep of shapes, M and K that every launch relies on (split range,
//     resident K ranges that fit shared memory, the single-wave clusters of four, counted as
//     the device holds them, not as SMs / 4).
#include <cstdio>

#include <set>
#include <string>
#include <tuple>

#include "dispatch/gemv_plan.h"
#include "dispatch/heuristics.h"
#include "dispatch/overrides.h"

using namespace kbit;
using namespace kbit::gemv;

static int checks = 0, failures = 0;
#define EXPECT(cond, ...)                                         \
  do {                                                            \
    ++checks;                                                     \
    if (!(cond)) {                                                \
      ++failures;                                                 \
      std::printf("FAIL line %d: %s: ", __LINE__, #cond);         \
      std::printf(__VA_ARGS__);                                   \
      std::printf("\n");                                          \
    }                                                             \
  } while (0)

constexpr int kH200Sms = 132;
// cudaOccupancyMaxActiveClusters of one-per-SM CTAs in clusters of 1..8 on the H200 (the device
// gives these: tests/test_kernels_gpu.py, test_gemv_plan_on_device)
constexpr Clusters kH200Clusters = {{0, 132, 66, 39, 30, 22, 17, 15, 15}};

// the sweep's other SM counts: GPCs of 18 SMs (the H200's largest) and a remainder
static Clusters clusters_of(int sms) {
  if (sms == kH200Sms) return kH200Clusters;
  Clusters c = {};
  for (int s = 1; s <= kMaxSplits; ++s) c.n[s] = sms / 18 * (18 / s) + sms % 18 / s;
  return c;
}

static Plan plan(int m, int n, int k, int bits, bool resident_ok = true, int sms = kH200Sms) {
  return choose_plan(kH200Heuristics, m, n_units(n), k_units(k), bits, sms, clusters_of(sms), resident_ok);
}
// The kernels plan_gemv_on may name, as the H200 gives them: every one built and fitting its
// shared memory (227 KB); the wide-table kernels built where gemv_kernel.cuh builds them (K = 3, 4,
// one CTA per SM; not the K=4 16-warp ring kernel; not x resident in 2 slabs), the x-resident
// ones holding 72 / 144 units of K (44 / 88 beside the wide table).
static const GemvKernelFacts* h200_facts(const GemvKey& key) {
  static GemvKernelFacts packed[2], wide[2];
  for (int mt = 1; mt <= 2; ++mt) {
    packed[mt - 1] = {200 * 1024, xr_max_units(mt)};
    wide[mt - 1] = {227 * 1024, mt == 2 ? 44 : 88};
  }
  if (!key.wide) return &packed[key.mt - 1];
  const bool lut = key.bits == 3 || key.bits == 4;
  const bool built = key.slabs > 0 ? key.slabs != 2
                                   : key.warps != kNarrowWarps && !(key.mt == 1 && key.warps == kWarps) &&
                                         !(key.bits == 4 && key.mt == 2 && key.warps == kWideWarps);
  return lut && built ? &wide[key.mt - 1] : nullptr;
}
static GemvPlan plan_on(int m, int n, int k, int bits, const GemvTarget& t, int splits, const GemvOverrides& o) {
  return plan_gemv_on(m, n, k, bits, DType::kHalf, t, splits, o, h200_facts);
}

// the kernels the plans above named: printed for tests/test_gemv_plan.py, which checks that
// csrc/generate_instantiations.py builds each of them
static std::set<std::tuple<int, int, int, int, int, int>> keys_seen;
static void note_key(const GemvKey& k) { keys_seen.insert({k.bits, k.mt, k.warps, k.wide, k.x_smem, k.slabs}); }

static void expect_plan(int m, int n, int k, int bits, int splits, int warps, int slabs) {
  const Plan p = plan(m, n, k, bits);
  EXPECT(p.splits == splits && p.warps == warps && p.slabs == slabs,
         "%dx%d M=%d K=%d: got S=%d warps=%d G=%d, want S=%d warps=%d G=%d", n, k, m, bits, p.splits, p.warps,
         p.slabs, splits, warps, slabs);
}

int main() {
  for (int bits = 2; bits <= 5; ++bits) {
    for (int m = 1; m <= kGemvMaxM; ++m) {
      // 8B qkv / o / down: one-slab 16-warp CTAs, x never resident (forcing it was slower at
      // every slab count and split, docs/DESIGN.md)
      expect_plan(m, 6144, 4096, bits, 1, kWideWarps, 0);
      expect_plan(m, 4096, 4096, bits, 2, kWideWarps, 0);
      expect_plan(m, 4096, 14336, bits, 2, kWideWarps, 0);
      // an lm_head (128256x4096): x resident in 16-slab CTAs at every M
      expect_plan(m, 128256, 4096, bits, 1, kWideWarps, 16);
      // Phi-3-mini's qkv (9216x3072, 144 slabs, 48 units): 4-warp CTAs at S = 3, 4 units a warp
      // (gemv_narrow_min_units; 0.84-0.90x the time of x resident at G = 2, S = 1)
      expect_plan(m, 9216, 3072, bits, 3, kNarrowWarps, 0);
    }
    // 8B gate_up (28672x4096, 448 slabs): four 4-warp CTAs per SM up to M = 5 (at K = 3, 4 none),
    // then x resident: 15-slab CTAs (30 clusters of four, where 16 slabs made 28) from M = 1 at
    // K = 3, 4; at K=5 4-slab CTAs, 15-slab ones from M = 11; at K = 2 4-slab CTAs
    for (int m = 1; m <= 5; ++m) {
      if (bits == 3 || bits == 4) expect_plan(m, 28672, 4096, bits, 4, kXrFillSlabs, kXrFillSlabs);
      else expect_plan(m, 28672, 4096, bits, 1, kNarrowWarps, 0);
    }
    for (int m = 6; m <= 10; ++m) {
      if (bits == 3 || bits == 4) expect_plan(m, 28672, 4096, bits, 4, kXrFillSlabs, kXrFillSlabs);
      else expect_plan(m, 28672, 4096, bits, 1, kWideWarps, 4);
    }
    for (int m = 11; m <= 16; ++m) {
      if (bits >= 3) expect_plan(m, 28672, 4096, bits, 4, kXrFillSlabs, kXrFillSlabs);
      else expect_plan(m, 28672, 4096, bits, 1, kWideWarps, 4);
    }
    // 30720 columns (480 slabs): 16-slab clusters of four fill the 30 exactly; 32768 (512 slabs)
    // would make 32 of 16 slabs, two waves on the H200 (the wave check counts clusters, not SMs)
    for (int m = 11; m <= 16; ++m) {
      if (bits >= 3) expect_plan(m, 30720, 4096, bits, 4, kWideWarps, 16);
      EXPECT(plan(m, 32768, 4096, bits).splits != 4, "32768x4096 M=%d K=%d: 32 clusters of four", m, bits);
    }
    // 70B gate_up (57344x8192): 8-warp CTAs at M = 1, then x resident in 16-slab pairs
    expect_plan(1, 57344, 8192, bits, 1, kWarps, 0);
    for (int m = 2; m <= 16; ++m) expect_plan(m, 57344, 8192, bits, 2, kWideWarps, 16);
    // small models' one-per-SM layers: the largest split whose clusters all fit (Clusters), not
    // NU * S <= SMs: Llama-3.2-1B's o / down (2048 columns, 32 slabs) S = 3, not 4 (32 clusters of
    // four: two waves); Qwen2.5-1.5B's (1536, 24 slabs) S = 4, not 5 (22 clusters of five at most)
    for (int m = 1; m <= 16; ++m) {
      expect_plan(m, 2048, 2048, bits, 3, kWideWarps, 0);
      expect_plan(m, 2048, 8192, bits, 3, kWideWarps, 0);
      expect_plan(m, 1536, 1536, bits, 4, kWideWarps, 0);
      expect_plan(m, 1536, 8960, bits, 4, kWideWarps, 0);
    }
    // K = 3, 4 at M <= 5: x-resident clusters of four only where they fill >= 80% of the SMs
    // (27648x5120: 29 clusters, 116 CTAs; 22016x4096: 23 clusters, 92 CTAs, keeps 4-warp CTAs)
    if (bits == 3 || bits == 4) {
      for (int m = 1; m <= 5; ++m) {
        expect_plan(m, 27648, 5120, bits, 4, kXrFillSlabs, kXrFillSlabs);
        expect_plan(m, 22016, 4096, bits, 1, kNarrowWarps, 0);
        expect_plan(m, 18944, 3584, bits, 1, kNarrowWarps, 0);
      }
    }
    // a device without the resident layout (or the override gemv.x_resident=0): never resident
    for (int m = 1; m <= 16; ++m) EXPECT(plan(m, 28672, 4096, bits, false).slabs == 0, "M=%d", m);
  }

  // invariants
  const int ns[] = {64, 72, 200, 1000, 4096, 4104, 6144, 8192, 12800, 14336, 18944, 22016, 27648, 28672,
                    37888, 57344, 128256, 152064, 256000};
  const int ks[] = {32, 96, 1056, 2080, 3584, 4096, 5120, 8192, 14336, 18944, 28672};
  for (const int sms : {108, 132, 144}) {
    for (const int n : ns) {
      for (const int k : ks) {
        for (int bits = 2; bits <= 5; ++bits) {
          for (int m = 1; m <= kGemvMaxM; ++m) {
            const Plan p = plan(m, n, k, bits, true, sms);
            const int nu = n_units(n), ku = k_units(k);
            EXPECT(p.splits >= 1 && p.splits <= kMaxSplits && p.splits <= ku, "%dx%d M=%d: S=%d", n, k, m, p.splits);
            EXPECT(p.warps == kNarrowWarps || p.warps == kWarps || p.warps == kWideWarps ||
                       (p.slabs == kXrFillSlabs && p.warps == kXrFillSlabs), "warps %d", p.warps);
            if (m > kGemvOneTileM) EXPECT(p.warps != kWarps, "%dx%d M=%d: 8-warp CTAs hold x in registers", n, k, m);
            if (p.slabs == 0 && p.warps == kWideWarps && p.splits > 1)  // one CTA per SM: a split in one wave
              EXPECT(nu <= clusters_of(sms).n[p.splits], "%dx%d M=%d: %d clusters of %d", n, k, m, nu, p.splits);
            if (p.slabs > 0) {
              const int chunk = div_up(ku, p.splits);
              EXPECT(p.slabs == 2 || p.slabs == 4 || p.slabs == kXrFillSlabs || p.slabs == 16, "G=%d", p.slabs);
              EXPECT(p.warps == xr_warps(p.slabs), "resident CTAs of %d slabs have %d warps", p.slabs, p.warps);
              EXPECT(chunk <= xr_max_units(m > kGemvOneTileM ? 2 : 1), "%dx%d M=%d: K range %d units", n, k, m, chunk);
              EXPECT(div_up(ku, chunk) == p.splits, "%dx%d M=%d: an empty split", n, k, m);
              EXPECT(p.splits <= 2 || (p.splits == 4 && xr_warps(p.slabs) == p.slabs && bits >= kH200Heuristics.gemv_s4_min_bits &&
                                       chunk >= kH200Heuristics.gemv_s4_min_units && div_up(nu, p.slabs) <= clusters_of(sms).n[4]),
                     "%dx%d M=%d K=%d: S=%d G=%d outside the measured clusters", n, k, m, bits, p.splits, p.slabs);
              // 15 slabs only where 16 would make fewer clusters
              EXPECT(p.slabs != kXrFillSlabs || (p.splits == 4 && div_up(nu, 15) > div_up(nu, 16)),
                     "%dx%d M=%d: G=15 with S=%d", n, k, m, p.splits);
            }
          }
        }
      }
    }
  }
  // the call's plan (plan_gemv_on): without overrides, the planner's; with them, what they force
  GemvTarget h200;
  h200.num_sms = kH200Sms;
  h200.clusters = true;
  h200.smem_optin = 227 * 1024;
  h200.cluster_capacity = kH200Clusters;
  h200.heuristics = &kH200Heuristics;
  for (int bits = 2; bits <= 5; ++bits) {
    for (int m = 1; m <= kGemvMaxM; ++m) {
      for (const int n : {4096, 6144, 28672, 128256}) {
        const Plan want = plan(m, n, 4096, bits);
        const GemvPlan got = plan_on(m, n, 4096, bits, h200, 0, GemvOverrides{});
        note_key(got.key);
        EXPECT(got.splits == want.splits && got.warps() == want.warps && got.slabs() == want.slabs,
               "%dx4096 M=%d K=%d: plan_gemv_on differs from choose_plan", n, m, bits);
        // the key: this call's bit width, tile and x placement; the wide table wherever it is built
        const GemvKey& key = got.key;
        EXPECT(key.bits == bits && key.mt == (m > kGemvOneTileM ? 2 : 1), "key of M=%d K=%d", m, bits);
        EXPECT(key.x_smem == (key.slabs > 0 || m > kGemvOneTileM), "%dx4096 M=%d: x placement", n, m);
        EXPECT(got.chunk == div_up(k_units(4096), got.splits), "chunk");
        GemvKey wide = key;
        wide.wide = true;
        const GemvKernelFacts* wf = h200_facts(wide);
        EXPECT(key.wide == (wf != nullptr && (key.slabs == 0 || got.chunk <= wf->xr_units)),
               "%dx4096 M=%d K=%d: the wide table where it is built and fits", n, m, bits);
        GemvOverrides packed;
        packed.wide_table = false;
        EXPECT(!plan_on(m, n, 4096, bits, h200, 0, packed).key.wide, "gemv.wide_table=0");
        GemvOverrides xreg;
        xreg.x_smem = false;
        xreg.x_resident = false;
        const GemvPlan r = plan_on(m, n, 4096, bits, h200, 0, xreg);
        note_key(r.key);
        if (m > kGemvOneTileM)
          EXPECT(!r.key.x_smem && r.key.warps == kWarps, "gemv.x_smem=0: the 8-warp register kernel, M=%d", m);
      }
      // a device that cannot give a CTA the x ring (sm_86 / sm_89: 99 KB): the register kernel,
      // never x resident, never the wide table
      GemvTarget small = h200;
      small.smem_optin = 99 * 1024;
      const GemvPlan sp = plan_on(m, 28672, 4096, bits, small, 0, GemvOverrides{});
      note_key(sp.key);
      EXPECT(sp.key.slabs == 0 && !sp.key.wide && (m <= kGemvOneTileM || (!sp.key.x_smem && sp.key.warps == kWarps)),
             "99 KB device, M=%d K=%d", m, bits);
      GemvOverrides off;
      off.x_resident = false;
      EXPECT(plan_on(m, 128256, 4096, bits, h200, 0, off).slabs() == 0, "gemv.x_resident=0, M=%d", m);
      GemvOverrides g4;
      g4.slabs = 4;
      EXPECT(plan_on(m, 28672, 4096, bits, h200, 0, g4).slabs() == 4, "gemv.slabs=4, M=%d", m);
      EXPECT(plan_on(m, 28672, 4096, bits, h200, 2, g4).splits == 2, "a forced split stays, M=%d", m);
      GemvTarget old = h200;  // no clusters (below sm_90): S = 1, never resident
      old.clusters = false;
      const GemvPlan p = plan_on(m, 4096, 14336, bits, old, 3, GemvOverrides{});
      EXPECT(p.splits == 1 && p.slabs() == 0, "no clusters: S=%d G=%d", p.splits, p.slabs());
    }
  }

  // the device's table (heuristics.h): H100 and H200 by compute capability 9.0 and memory size,
  // everything else the generic one
  {
    const auto facts = [](const char* name, int major, int minor, int sms, long long gib) {
      DeviceFacts d;
      d.name = name;
      d.major = major;
      d.minor = minor;
      d.num_sms = sms;
      d.l2_bytes = 50LL << 20;
      d.global_mem_bytes = gib << 30;
      return d;
    };
    EXPECT(&choose_heuristics(facts("NVIDIA H100 80GB HBM3", 9, 0, 132, 79)) == &kH100Heuristics, "H100 SXM");
    EXPECT(&choose_heuristics(facts("NVIDIA H100 PCIe", 9, 0, 114, 79)) == &kH100Heuristics, "H100 PCIe");
    EXPECT(&choose_heuristics(facts("NVIDIA H200", 9, 0, 132, 140)) == &kH200Heuristics, "H200");
    EXPECT(&choose_heuristics(facts("NVIDIA A100-SXM4-80GB", 8, 0, 108, 79)) == &kGenericHeuristics, "A100");
    EXPECT(&choose_heuristics(facts("NVIDIA L40S", 8, 9, 142, 44)) == &kGenericHeuristics, "L40S");
  }

  // plan overrides: the strings the ops take
  {
    PlanOverrides o;
    EXPECT(parse_overrides("", &o).empty() && o.gemv.wide_table && o.wgmma.groups == 0, "empty string: defaults");
    EXPECT(parse_overrides(" gemv.slabs=15, wgmma.tile_m=256 ,pdl=0,mma.config=1,mma.splits=3", &o).empty(),
           "a valid string");
    EXPECT(o.gemv.slabs == 15 && o.wgmma.tile_m == 256 && !o.pdl && o.mma.config == 1 && o.mma.splits == 3,
           "parsed fields");
    EXPECT(parse_overrides("gemv.slabs=15", &o).empty() && o.wgmma.tile_m == 0 && o.pdl, "each parse starts afresh");
    EXPECT(parse_overrides("wgmma.tile=256", &o).find("unknown override 'wgmma.tile'") != std::string::npos,
           "an unknown key is named");
    EXPECT(!parse_overrides("wgmma.tile_m=100", &o).empty(), "a tile that is not built");
    EXPECT(!parse_overrides("gemv.wide_table=2", &o).empty(), "a flag is 0 or 1");
    EXPECT(!parse_overrides("pdl", &o).empty() && !parse_overrides("pdl=x", &o).empty(), "key=integer only");
    EXPECT(parse_overrides("fp8.tile_n=256", &o).empty() && o.fp8.tile_m == 0 && o.fp8.tile_n == 256,
           "the FP8 wide tile (tile_m: 128)");
    EXPECT(parse_overrides("fp8.tile_m=256,fp8.tile_n=128", &o).empty() && o.fp8.tile_m == 256, "the FP8 tall tile");
    EXPECT(parse_overrides("fp8.tile_m=256,fp8.tile_n=256", &o).find("fp8.tile_n=256") != std::string::npos,
           "an FP8 tile that is not built is named");
    EXPECT(!parse_overrides("fp8.tile_m=96", &o).empty(), "an FP8 tile_m that is not built");
  }
  for (const auto& k : keys_seen)
    std::printf("key %d %d %d %d %d %d\n", std::get<0>(k), std::get<1>(k), std::get<2>(k), std::get<3>(k),
                std::get<4>(k), std::get<5>(k));
  std::printf("gemv_plan_test: %d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
