"""Small workload for compute-sanitizer (memcheck / racecheck): repack, quantize, dequantize
and the GEMV path (every split-K factor) on small, awkward shapes. Prints one line per step;
exits non-zero on a wrong result. Not a pytest file:

    compute-sanitizer --tool memcheck python3 tests/sanitize_small.py [OVERRIDES]

OVERRIDES (optional): plan overrides for every GEMV call, e.g. gemv.slabs=15 (x resident, one warp
per slab: what the plan runs for 28672x4096 from M = 1 at K = 3, 4), keys in csrc/dispatch/overrides.h."""
import sys

import torch

from vllm_kbit import format as kf
from vllm_kbit import layout as kl
from vllm_kbit import ops

import kernel_check as kc  # tests/ is this script's directory, so on sys.path

assert torch.cuda.is_available() and ops.HAS_CUDA_KERNELS, "needs a GPU and vllm_kbit._C"
dev = "cuda"
OV = sys.argv[1] if len(sys.argv) > 1 else ""
ok = True
for bits in (2, 3, 4, 5):
    for n, k in ((72, 96), (130, 160)):
        w = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.1
        cb = kf.normal_float_codebook(bits, dev)
        q, a = torch.ops.kbit.quantize(w, cb, bits)
        q_ref, a_ref = kf.quantize(w, bits, cb)
        ok &= torch.equal(q, q_ref) and torch.equal(a, a_ref)
        packed, ap = torch.ops.kbit.repack(q, a, bits)
        rp, ra = kl.repack_ref(q, a, bits)
        ok &= torch.equal(packed, rp) and torch.equal(ap, ra)
        wd = torch.ops.kbit.dequantize_tiled(packed, ap, cb, bits, n, k, torch.float16)
        ok &= torch.equal(wd, kf.dequantize(q, a, bits, cb, dtype=torch.float16))
        w64 = kf.dequantize(q, a, bits, cb, dtype=torch.float64)
        for m in (1, 9, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            bias = torch.randn(n, device=dev, dtype=torch.float16)
            ref = kc.matmul(x, w64, bias)
            for splits in (1, 2, 3):
                y = torch.ops.kbit.gemm_path(x, packed, ap, cb, bits, n, k, bias, ops.Path.GEMV, splits, OV)
                ok &= kc.compare(y, ref) is None
        print(f"bits={bits} n={n} k={k}: {'ok' if ok else 'FAIL'}", flush=True)
# clusters of four along K (with OVERRIDES gemv.slabs=15 or 16: x resident, one warp per slab, the
# plan of 28672x4096 from M = 1 at K = 3, 4, M = 11 at K=5), on a K range long enough for four splits
n, k = 200, 2080
g = torch.Generator(device=dev).manual_seed(0)
for bits in (4, 5):
    q = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 32 * bits), generator=g, device=dev, dtype=torch.int32)
    a = torch.randint(0x28, 0xA8, (n, k // 32), generator=g, device=dev, dtype=torch.int32).to(torch.uint8)
    cb = kf.normal_float_codebook(bits, dev)
    packed, ap = torch.ops.kbit.repack(q, a, bits)
    w64 = kf.dequantize(q, a, bits, cb, dtype=torch.float64)
    for m in (4, 9, 16):  # one n8 tile of x, two
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        y = torch.ops.kbit.gemm_path(x, packed, ap, cb, bits, n, k, None, ops.Path.GEMV, 4, OV)
        ok &= kc.compare(y, kc.matmul(x, w64)) is None
    print(f"bits={bits} n={n} k={k} splits=4: {'ok' if ok else 'FAIL'}", flush=True)
torch.cuda.synchronize()
print("sanitize_small:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
