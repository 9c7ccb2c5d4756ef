// CPU replay of the wgmma kernel's split-K choice at 128-token tiles (kbit_wgmma.cuh,
// choose_splits with kSplitCost128), built and run by tests/test_wgmma_plan.py with nvcc as
// host code. Reads "n k m" lines on stdin and prints "n k m splits" for each, with the H200's
// occupancy at 227 KB CTAs (one per SM; cudaOccupancyMaxActiveClusters measured for s = 1..16,
// benchmarks/results/wgmma_decode_wg_probe_9f74899.json's session, docs/MMA.md), through
// plan_split as plan_t. Optional argv[1]: the split cost (KBIT_WGMMA_SPLIT_COST).
#include <cstdio>
#include <cstdlib>

#include "kbit_wgmma.cuh"

using namespace kbit;
using namespace kbit::wg;

int main(int argc, char** argv) {
  constexpr int kH200Sms = 132;
  const int resident[kMaxSplits + 1] = {0, 132, 66, 39, 30, 22, 17, 15, 15, 9, 7, 7, 7, 7, 7, 7, 7};
  Occupancy occ;
  occ.per_sm = 1;
  occ.spread_bytes = 232448;
  occ.max_splits = kMaxSplits;
  for (int s = 1; s <= kMaxSplits; ++s) occ.clusters[s][0] = occ.clusters[s][1] = resident[s];
  const int cost = argc > 1 ? std::atoi(argv[1]) : kSplitCost128;
  int n, k, m;
  while (std::scanf("%d %d %d", &n, &k, &m) == 3) {
    const long long tiles = (long long)div_up(n_units(n), 256 / kUnitN) * div_up(m, 128);
    int chunk = 0;
    std::printf("%d %d %d %d\n", n, k, m, plan_split(tiles, k_units(k), kH200Sms, occ, cost, 0, &chunk));
  }
  return 0;
}
