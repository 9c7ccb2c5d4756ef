"""One GEMV launch per (bits, M) on a large shape, for `ncu` (see scripts/gpu_check.sh):

  ncu --clock-control none -k regex:gemv_kernel --section SpeedOfLight --section WarpStateStats \\
      --section SchedulerStats python3 benchmarks/profile_gemv.py 57344x8192 4:1 2:1
"""
import sys

import torch

from vllm_kbit import format as kf
from vllm_kbit import layout as kl
from vllm_kbit import ops

n, k = (int(v) for v in sys.argv[1].split("x"))
for spec in sys.argv[2:]:
    bits, m = (int(v) for v in spec.split(":"))
    packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (kl.packed_numel(n, k, bits),), device="cuda", dtype=torch.int32)
    ap = torch.randint(0x30, 0x90, (kl.absmax_numel(n, k),), device="cuda", dtype=torch.int32).to(torch.uint8)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    torch.ops.kbit.gemm_path(x, packed, ap, kf.normal_float_codebook(bits, "cuda"), bits, n, k, None, ops.Path.GEMV, 0)
torch.cuda.synchronize()
