"""Small wgmma GEMM runs for compute-sanitizer (not a pytest file).

    compute-sanitizer --tool memcheck  python3 tests/sanitize_wgmma.py
    compute-sanitizer --tool racecheck python3 tests/sanitize_wgmma.py

Covers the three token tiles (16, 32, 64), split-K clusters (forced 1, 3, 8 and the plan's),
the M / N / K tails (rows past M, slabs past N, K % 64 == 32), bias, fp16 and bf16, K = 2..5.
Shapes are tiny so the tools finish in seconds. Exits non-zero if a result is off (the
sanitizer reports its own errors). Exits 0 with a note where the wgmma path is unavailable.
"""
import sys

import torch

from vllm_kbit import format as kf
from vllm_kbit import ops  # noqa: F401  (registers the ops, loads vllm_kbit._C)

CASES = [  # m, n, k, bits, dtype, bias, splits (0: the plan's)
    (17, 200, 96, 3, torch.float16, True, 0),         # tile 32, slabs past N, K % 64 == 32
    (16, 130, 4128, 4, torch.bfloat16, False, 3),     # tile 16, 3-CTA cluster, uneven chunks
    (64, 64, 2048, 2, torch.float16, True, 8),        # tile 64, 8-CTA cluster, one slab
    (100, 300, 1056, 5, torch.bfloat16, True, 1),     # two token tiles, rows past M
    (40, 520, 1024, 4, torch.float16, False, 0),
]


def main():
    if not torch.ops.kbit.has_wgmma():
        print("wgmma path not available on this build / device: nothing to check")
        return
    bad = 0
    for m, n, k, bits, dtype, bias, splits in CASES:
        g = torch.Generator(device="cuda").manual_seed(m + n + k + bits)
        idx = torch.randint(0, 1 << bits, (n, k), generator=g, device="cuda").to(torch.uint8)
        codes = torch.randint(0x70, 0xA0, (n, k // 32), generator=g, device="cuda").to(torch.uint8)
        packed, absmax = torch.ops.kbit.repack(kf.pack_bitplanes(idx, bits), codes, bits)
        cb = kf.normal_float_codebook(bits, "cuda")
        w = cb.double()[idx.long()] * kf.decode_e4m4(codes).double().repeat_interleave(32, dim=1)
        x = torch.randn(m, k, device="cuda").to(dtype)
        b = torch.randn(n, device="cuda").to(dtype) if bias else None
        y = torch.ops.kbit.gemm_path(x, packed, absmax, cb, bits, n, k, b, 4, splits)
        ref = x.double() @ w.t() + (b.double() if bias else 0)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        plan = torch.ops.kbit.wgmma_plan(m, n, k, bits, dtype, splits)[:2]
        ok = bool(torch.isfinite(y).all()) and err < (2e-3 if dtype == torch.float16 else 1e-2)
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} m={m} n={n} k={k} bits={bits} {dtype} tile_m={plan[0]} "
              f"splits={plan[1]} relerr={err:.2e}", flush=True)
    torch.cuda.synchronize()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
