"""Benchmark of the kbit MoE expert GEMM (torch.ops.kbit.moe_gemm, the grouped GEMV over
moe_align_block_size's blocks) on the expert shapes of a few MoE models, and of
torch.ops.kbit.dequantize_experts (the large-batch path's first step) on a whole layer.

Method as bench_gemm.py (its Timer: a 512 MiB write flushes the L2 before every timed call; the
median of CUDA-event times). moe_gemm is reported as microseconds, GB/s of the bytes that must
move (the routed experts' weights and absmax once each, x, y) and % of the copy bandwidth
measured in the same run: at M = 1 the kernel should be bound by those weight bytes.
dequantize_experts as microseconds and GB/s (all experts' kbit bytes read, fp16 written).

  python benchmarks/bench_moe.py                       # every model, M = 1, 4, 16, 64, K = 4
  python benchmarks/bench_moe.py --bits 2,3,4,5 --ms 1,8
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import bench_gemm as bg  # noqa: E402

# name: (experts, top_k, hidden, intermediate); gate_up is [2 I, H], down [H, I]
MODELS = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
BLOCK_M = 16


def align(topk_ids, num_experts):
    try:
        from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
        return moe_align_block_size(topk_ids, BLOCK_M, num_experts)
    except Exception:  # noqa: BLE001 (vLLM without CUDA ops: the tests' pure-torch equivalent)
        import moe_cases
        return moe_cases.align_ref(topk_ids, BLOCK_M, num_experts)


def stacked_experts(num_experts, n, k, bits, seed):
    """Random tiled experts [E, P] / [E, U] (random indices and realistic E4M4 codes)."""
    from vllm_kbit import layout as kl
    g = torch.Generator(device="cuda").manual_seed(seed)
    p, u = kl.packed_numel(n, k, bits), kl.absmax_numel(n, k)
    packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (num_experts, p), generator=g, device="cuda", dtype=torch.int32)
    absmax = torch.randint(0x70, 0xA0, (num_experts, u), generator=g, device="cuda", dtype=torch.int32)
    return packed, absmax.to(torch.uint8), p * 4 + u


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--bits", default="4")
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    args = ap.parse_args()
    from vllm_kbit import format as kf
    from vllm_kbit import ops
    assert ops.HAS_CUDA_KERNELS, "needs the built vllm_kbit._C"
    dtype = getattr(torch, args.dtype)
    timer = bg.Timer()
    copy_gbs = bg.copy_bandwidth(timer)
    bg.log(f"# {torch.cuda.get_device_name()}  commit {bg.git_commit()}  copy bandwidth {copy_gbs:.0f} GB/s  "
           f"{args.dtype}  block_m {BLOCK_M}")
    bg.log(f"{'model':18} {'proj':8} {'K':>2} {'M':>4} {'experts':>7} {'us':>8} {'GB/s':>7} {'%copy':>6}")
    for name in args.models.split(","):
        num_experts, top_k, hidden, inter = MODELS[name]
        for bits in [int(b) for b in args.bits.split(",")]:
            cb = kf.normal_float_codebook(bits, "cuda")
            for proj, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
                packed, absmax, expert_bytes = stacked_experts(num_experts, n, k, bits, seed=bits + n)
                for m in [int(v) for v in args.ms.split(",")]:
                    g = torch.Generator(device="cuda").manual_seed(m)
                    logits = torch.randn(m, num_experts, generator=g, device="cuda")
                    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
                    sorted_ids, expert_ids, ntpp = align(ids.to(torch.int32), num_experts)
                    # gate_up reads the tokens' rows (top_k pairs a row); down one row a pair, top_k = 1
                    rows, tk = (m, top_k) if proj == "gate_up" else (m * top_k, 1)
                    x = torch.randn(rows, k, device="cuda", dtype=dtype)
                    w = weights.float() if proj == "down" else None

                    def call():
                        return torch.ops.kbit.moe_gemm(x, packed, absmax, cb, bits, n, k, sorted_ids, expert_ids,
                                                       ntpp, BLOCK_M, tk, w)

                    us = timer(call)
                    routed = int(ids.unique().numel())
                    moved = routed * expert_bytes + x.numel() * 2 + m * top_k * n * 2
                    gbs = moved / (us * 1e-6) / 1e9
                    bg.log(f"{name:18} {proj:8} {bits:>2} {m:>4} {routed:>7} {us:>8.1f} {gbs:>7.0f} "
                           f"{100 * gbs / copy_gbs:>5.1f}%")
                us = timer(lambda: torch.ops.kbit.dequantize_experts(packed, absmax, cb, bits, n, k, dtype))
                moved = num_experts * (expert_bytes + n * k * 2)
                bg.log(f"{name:18} {proj:8} {bits:>2} dequantize_experts (all {num_experts}) {us:>8.1f} us "
                       f"{moved / (us * 1e-6) / 1e9:>7.0f} GB/s")
                del packed, absmax


if __name__ == "__main__":
    main()
