"""Small wgmma GEMM runs for compute-sanitizer (not a pytest file).

    compute-sanitizer --tool memcheck  python3 tests/sanitize_wgmma.py
    compute-sanitizer --tool racecheck python3 tests/sanitize_wgmma.py

Covers the token tiles (16, 32, 64, 128, 256), one and two warpgroups per CTA (row split), the
producer warpgroup and the wide pair table (tile 128, and tile 64 built for one CTA per SM),
split-K clusters (forced 1, 2, 3, 8, 16 and the plan's) and cluster groups meeting in the global
workspace, unsplit y stores through shared memory and TMA (N % 8 == 0) or per element, the
M / N / K tails (rows past M, slabs past N, K % 64 == 32), bias, fp16 and bf16, K = 2..5.
Shapes are tiny so the tools finish in seconds. Exits non-zero if a result is off (the
sanitizer reports its own errors). Exits 0 with a note where the wgmma path is unavailable.
"""
import sys

import torch

import gemm_cases  # tests/ is this script's directory, so on sys.path
from gemm_cases import sanitize_case
from vllm_kbit import ops  # (registers the ops, loads vllm_kbit._C)

CASES = [  # m, n, k, bits, dtype, bias, splits (0: the plan's)[, wgmma.one_per_sm[, .groups[, .tile_m]]]
    (17, 200, 96, 3, torch.float16, True, 0),         # tile 32 (two warpgroups), slabs past N, K % 64 == 32
    (16, 130, 4128, 4, torch.bfloat16, False, 3),     # tile 16, 3-CTA cluster, uneven chunks
    (64, 64, 2048, 2, torch.float16, True, 8),        # tile 64, 8-CTA cluster, one slab
    (100, 300, 1056, 5, torch.bfloat16, True, 1),     # one 128-token tile, rows past M (N % 8 != 0: element stores)
    (40, 520, 1024, 4, torch.float16, False, 0),
    (24, 200, 8192, 3, torch.float16, True, 1),       # tile 32, one warpgroup (128 K-tiles per CTA), TMA y store
    (100, 300, 4128, 4, torch.float16, True, 3),      # tile 128: producer warpgroup + wide table, 3-CTA cluster
    (130, 520, 2048, 3, torch.bfloat16, False, 0),    # two 128-token tiles, wide table, the plan's split
    (72, 200, 1024, 2, torch.float16, True, 2),       # tile 128 at K=2: producer, replicated table
    (48, 130, 2048, 4, torch.bfloat16, True, 16),     # tile 64, 16-CTA cluster (non-portable size)
    (129, 72, 2048, 5, torch.float16, False, 16),     # tile 128: producer + 16-CTA cluster
    (64, 520, 4128, 4, torch.bfloat16, True, 0, "1"),   # tile 64 one per SM: producer + wide table
    (40, 200, 2048, 5, torch.float16, False, 3, "1"),   # tile 64 one per SM, K=5 (no table), 3-CTA cluster
    (200, 520, 2048, 4, torch.float16, True, 2, "-1", "2"),   # tile 128: two clusters of 2 through the workspace
    (48, 300, 4128, 3, torch.bfloat16, False, 1, "-1", "3"),  # tile 64 one per SM: three clusters of 1
    (48, 300, 4128, 4, torch.float16, True, 2, "0", "2"),     # tile 64, two per SM (no producer): two clusters of 2
    # unsplit, N % 8 == 0: y through stmatrix into shared memory, then TMA stores
    (100, 264, 1056, 4, torch.bfloat16, True, 1),     # tile 128 (producer), rows past M, a partial slab
    (13, 200, 1024, 2, torch.float16, True, 1),       # tile 16, one warpgroup
    (64, 264, 2048, 3, torch.float16, False, 1, "1"),  # tile 64 one per SM
    (40, 264, 2048, 5, torch.bfloat16, True, 1, "0"),  # tile 64 two per SM (no producer)
    # 256-token tiles (128 columns, unsplit), forced
    (300, 264, 1056, 4, torch.float16, True, 0, "-1", "0", "256"),    # two tiles, rows past M, TMA y store
    (17, 200, 2048, 3, torch.bfloat16, False, 0, "-1", "0", "256"),   # one tile, a slab past N
    (260, 300, 1024, 5, torch.bfloat16, True, 1, "-1", "0", "256"),   # N % 8 != 0: element stores
    (257, 130, 2048, 2, torch.float16, True, 0, "-1", "0", "256"),    # a second tile of one row
    # 256-token tiles split along K (one cluster, the partials reduced through DSMEM)
    (300, 264, 1056, 4, torch.bfloat16, True, 3, "-1", "0", "256"),   # two tiles, uneven chunks
    (200, 1004, 2048, 5, torch.float16, False, 2, "-1", "0", "256"),  # a slab partly past N
    # forced groups: 128-token tiles (with 17 K-tiles the plan's split leaves G = 1)
    (300, 264, 1056, 4, torch.bfloat16, True, 0, "-1", "2", "256"),
]


def main():
    if not torch.ops.kbit.has_wgmma():
        print("wgmma path not available on this build / device: nothing to check")
        return
    bad = 0
    for m, n, k, bits, dtype, bias, splits, *one in CASES:
        gemm_cases.OVERRIDES.clear()  # (-1, 0: the plan's own)
        gemm_cases.OVERRIDES.update(zip(("wgmma.one_per_sm", "wgmma.groups", "wgmma.tile_m"), map(int, one)))
        ok, err = sanitize_case(4, m, n, k, bits, dtype, bias, splits)
        plan = ops.wgmma_plan(m, n, k, bits, dtype, splits, gemm_cases.overrides())
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} m={m} n={n} k={k} bits={bits} {dtype} {plan.kernel} "
              f"splits={plan.splits} groups={plan.groups} relerr={err:.2e}", flush=True)
    torch.cuda.synchronize()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
