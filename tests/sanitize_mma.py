"""Small tensor-core GEMM runs for compute-sanitizer (not a pytest file).

    compute-sanitizer --tool memcheck  python3 tests/sanitize_mma.py
    compute-sanitizer --tool racecheck python3 tests/sanitize_mma.py
    compute-sanitizer --tool initcheck python3 tests/sanitize_mma.py

The kernel hands pipeline stages between warps with cp.async.wait_group + __syncthreads, which
racecheck proves hazard-free.

Covers all three tile configs, split-K (workspace, counters, last-arriver reduction), the
M / N / K tails (rows past M, a partial 64-column unit, a CTA tile past the last unit,
K % 64 == 32), bias, fp16 and bf16, and K = 2..5. Shapes are tiny so the tools finish in
seconds. Exits non-zero if a result is off (the sanitizer reports its own errors).
"""
import sys

import torch

import gemm_cases  # tests/ is this script's directory, so on sys.path
from gemm_cases import sanitize_case
from vllm_kbit import ops  # (registers the ops, loads vllm_kbit._C)

CASES = [  # m, n, k, bits, dtype, bias, forced (config, splits) (None: the heuristic's plan)
    (5, 200, 96, 3, torch.float16, True, None),         # cfg 0, N tail inside a unit, K % 64 == 32
    (33, 130, 4128, 4, torch.bfloat16, False, None),    # cfg 0, split-K over 65 K-tiles
    (64, 64, 2048, 2, torch.float16, True, None),       # split-K, one unit: CTA tile past the last unit
    (100, 200, 1056, 5, torch.bfloat16, True, (1, 3)),   # cfg 1 + split-K, rows past M
    (100, 200, 1056, 4, torch.float16, False, (1, 1)),   # cfg 1, no split
    (130, 300, 320, 5, torch.bfloat16, True, None),     # cfg 2, rows past M in the second m-tile
    (257, 520, 1024, 4, torch.float16, False, None),    # cfg 2 / split-K on 3 m-tiles
]


def main():
    bad = 0
    for m, n, k, bits, dtype, bias, force in CASES:
        gemm_cases.OVERRIDES.clear()
        if force:
            gemm_cases.OVERRIDES.update({"mma.config": force[0], "mma.splits": force[1]})
        ok, err = sanitize_case(2, m, n, k, bits, dtype, bias)
        plan = ops.mma_plan(m, n, k, bits, gemm_cases.overrides(), dtype)
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} m={m} n={n} k={k} bits={bits} {dtype} {plan.kernel} "
              f"splits={plan.splits} relerr={err:.2e}", flush=True)
    torch.cuda.synchronize()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
