"""Small FP8-activation GEMM runs for compute-sanitizer (not a pytest file).

    compute-sanitizer --tool memcheck  python3 tests/sanitize_fp8.py
    compute-sanitizer --tool racecheck python3 tests/sanitize_fp8.py
    compute-sanitizer --tool synccheck python3 tests/sanitize_fp8.py

Covers the four CTA tiles (tall and wide: two consumer warpgroups; wide: a producer warpgroup), K = 2..5, fp16 and bf16, bias, rows past M, slabs past N, an odd count
of 64-k units (the last K-tile half empty), K % 64 == 32, more K-tiles than pipeline stages.
Exits non-zero if a result is off; 0 with a note where the kernel is unavailable.
"""
import sys

import torch

import gemm_cases  # tests/ is this script's directory, so on sys.path
from fp8_cases import check

CASES = [  # m, n, k, bits, dtype, bias, (tile_m, tile_n)
    (17, 200, 320, 2, torch.float16, True, (64, 128)),
    (100, 136, 1056, 3, torch.bfloat16, False, (128, 128)),
    (129, 64, 2048, 4, torch.float16, True, (128, 128)),
    (40, 300, 1024, 5, torch.bfloat16, True, (64, 128)),
    (200, 130, 4096, 4, torch.bfloat16, False, (0, 0)),
    (300, 200, 2080, 3, torch.float16, True, (256, 128)),   # the tall CTA: two warpgroups, rows past M
    (150, 330, 2080, 4, torch.bfloat16, True, (128, 256)),  # the wide CTA: producer warpgroup, slabs past N
]

if __name__ == "__main__":
    if not gemm_cases.have("has_wgmma"):
        print("FP8 GEMM unavailable (needs sm_90 and a 9.0a build): nothing to check")
        sys.exit(0)
    for m, n, k, bits, dtype, bias, tile in CASES:
        check(m, n, k, bits, dtype, bias=bias, tile=tile, fused=False)
        print(f"ok m={m} n={n} k={k} bits={bits} {dtype} bias={bias} tile={tile}", flush=True)
    torch.cuda.synchronize()
    print("all ok")
