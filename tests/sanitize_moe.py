"""Small workload for compute-sanitizer (memcheck / racecheck) of the MoE expert kernels:
kbit::moe_gemm at every bit width, one and two n8 tiles of real rows, padding shuffled into
blocks, experts off this rank, the down projection's call, the sorted ids' misleading tail past
num_tokens_post_padded (moe_cases.align_ref), and kbit::dequantize_experts; where the build and
GPU have it (Hopper), kbit::moe_gemm_grouped at every build (block_m 64 one and two CTAs per SM,
128, 256), plain and with the fused gated activation. Prints one line per
step; exits non-zero on a wrong result. Not a pytest file (run: python tests/sanitize_moe.py
from the repository root)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_check as kc  # noqa: E402
import moe_cases as mc  # noqa: E402
from vllm_kbit import format as kf  # noqa: E402
from vllm_kbit import ops  # noqa: E402

assert torch.cuda.is_available() and ops.HAS_CUDA_KERNELS, "needs a GPU and vllm_kbit._C"
dev = "cuda"
ok = True
global_experts, top_k, n, k = 5, 2, 72, 96
expert_map = torch.tensor([0, 1, -1, 2, 3], dtype=torch.int32, device=dev)
for bits in (2, 3, 4, 5):
    qweight, absmax, cb, w64 = mc.make_experts(4, n, k, bits, dev, seed=bits)
    packed, ap = mc.stack_tiled(qweight, absmax, bits)
    for dtype in (torch.float16, torch.bfloat16):
        for m, block_m in ((1, 16), (12, 16), (12, 5)):  # 12 tokens x 2 / 4 local experts: blocks of > 8 rows
            ids, weights = mc.routing(m, global_experts, top_k, dev, seed=m + bits)
            sorted_ids, expert_ids, ntpp = mc.align_ref(ids, block_m, global_experts, expert_map)
            off = expert_map[ids.reshape(-1).long()] < 0
            # shuffle each block so padding also sits before real ids
            end = int(ntpp[0])
            head = sorted_ids[:end].view(-1, block_m)
            sorted_ids[:end] = torch.gather(head, 1, torch.argsort(torch.rand(head.shape, device=dev), 1)).reshape(-1)
            x = torch.randn(m, k, device=dev).to(dtype)
            y = torch.ops.kbit.moe_gemm(x, packed, ap, cb, bits, n, k, sorted_ids, expert_ids, ntpp, block_m, top_k,
                                        weights)
            ref = mc.moe_expected(x, ids, weights, w64, top_k, expert_map)
            ok &= bool(torch.isfinite(y).all()) and bool((y[off] == 0).all())
            ok &= kc.compare(y, ref, dtype) is None
            # one codebook per expert (here all equal): the same bits as the shared one
            per_expert = cb.expand(packed.shape[0], -1).contiguous()
            ok &= torch.equal(y, torch.ops.kbit.moe_gemm(x, packed, ap, per_expert, bits, n, k, sorted_ids,
                                                         expert_ids, ntpp, block_m, top_k, weights))
            x2 = torch.randn(m * top_k, k, device=dev).to(dtype)  # the down projection's call
            y2 = torch.ops.kbit.moe_gemm(x2, packed, ap, cb, bits, n, k, sorted_ids, expert_ids, ntpp, block_m, 1,
                                         None)
            ref2 = mc.moe_expected(x2, ids.reshape(-1, 1), None, w64, 1, expert_map)
            ok &= bool((y2[off] == 0).all()) and kc.compare(y2, ref2, dtype) is None
        w = torch.ops.kbit.dequantize_experts(packed, ap, cb, bits, n, k, dtype)
        ok &= all(torch.equal(w[e], kf.dequantize(qweight[e], absmax[e], bits, cb, dtype=dtype)) for e in range(4))
        ok &= torch.equal(w, torch.ops.kbit.dequantize_experts(packed, ap, cb.expand(4, -1).contiguous(), bits, n, k,
                                                               dtype))
    print(f"bits={bits}: {'ok' if ok else 'FAIL'}", flush=True)
if ops.has_moe_grouped():
    n2 = 256  # gate and up halves of two 64-column units each (one gated column group)
    for bits in (2, 3, 4, 5):
        qweight, absmax, cb, w64 = mc.make_experts(4, n2, k, bits, dev, seed=10 + bits)
        packed, ap = mc.stack_tiled(qweight, absmax, bits)
        for dtype in (torch.float16, torch.bfloat16):
            for block_m, m, o in ((64, 40, "moe.one_per_sm=1"), (64, 40, "moe.one_per_sm=0" if bits > 2 else ""),
                                  (128, 150, ""), (256, 300, "")):
                ids, weights = mc.routing(m, global_experts, top_k, dev, seed=m + bits)
                aligned = mc.align_ref(ids, block_m, global_experts, expert_map)
                off = expert_map[ids.reshape(-1).long()] < 0
                x = torch.randn(m, k, device=dev).to(dtype)
                y = torch.ops.kbit.moe_gemm_grouped(x, packed, ap, cb, bits, n2, k, *aligned, block_m, top_k, weights,
                                                    0, True, o)
                ref = mc.moe_expected(x, ids, weights, w64, top_k, expert_map)
                ok &= bool(torch.isfinite(y).all()) and bool((y[off] == 0).all())
                ok &= kc.compare(y, ref, dtype) is None
                a = torch.ops.kbit.moe_gemm_grouped(x, packed, ap, cb, bits, n2, k, *aligned, block_m, top_k, None,
                                                    1, False, o)
                bad = mc.activation_outside(a, x, ids, None, w64, top_k, 1, dtype, expert_map)
                ok &= not bool(bad[~off].any())
        print(f"grouped bits={bits}: {'ok' if ok else 'FAIL'}", flush=True)
torch.cuda.synchronize()
print("sanitize_moe:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
