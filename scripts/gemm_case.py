"""Run one kbit GEMM case (the op's own path choice) six times, for a profiler to pick one launch:

  ncu --clock-control none -k regex:gemv_kernel -s 3 -c 1 --metrics ... python3 scripts/gemm_case.py N K M BITS
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_gemm as bg  # noqa: E402  (the benchmark's random kbit weights)
from vllm_kbit import ops  # noqa: E402,F401  (registers torch.ops.kbit)

n, k, m, bits = (int(a) for a in sys.argv[1:5])
run, _ = bg.kbit_method(n, k, bits, 0)
x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
for _ in range(6):
    run(x)
torch.cuda.synchronize()
