"""CPU tests of the MoE op contract: the pure-torch moe_align_block_size of the tests (moe_cases)
and the PyTorch reference of kbit::moe_gemm / kbit::dequantize_experts (vllm_kbit/ops.py), which
on the CPU reads each expert's checkpoint tensors (repack is the identity there)."""
import pytest
import torch

from vllm_kbit import format as kf
from vllm_kbit import ops  # noqa: F401  (registers torch.ops.kbit)

import kernel_check as kc
import moe_cases as mc


@pytest.mark.parametrize("block_m", [1, 5, 16])
@pytest.mark.parametrize("m,num_experts,top_k", [(1, 7, 2), (3, 128, 8), (64, 7, 2), (5, 4, 1)])
def test_align_ref_contract(block_m, m, num_experts, top_k):
    ids, _ = mc.routing(m, num_experts, top_k, "cpu", seed=m + block_m)
    sorted_ids, expert_ids, ntpp = mc.align_ref(ids, block_m, num_experts)
    num_pairs, end = ids.numel(), int(ntpp[0])
    assert end % block_m == 0 and end <= sorted_ids.numel()
    assert expert_ids.numel() == -(-sorted_ids.numel() // block_m)
    head = sorted_ids[:end].long()
    real = head[head < num_pairs]
    assert torch.equal(real.sort().values, torch.arange(num_pairs)), "every pair exactly once"
    assert bool((head[head >= num_pairs] == num_pairs).all()), "padding id is num_pairs"
    flat = ids.reshape(-1).long()
    for b in range(end // block_m):
        blk = head[b * block_m:(b + 1) * block_m]
        blk = blk[blk < num_pairs]
        assert blk.numel() > 0, "no block without a pair"
        assert bool((flat[blk] == expert_ids[b]).all()), "a block holds one expert's pairs"


def _experts(num_experts, n, k, bits):
    return mc.make_experts(num_experts, n, k, bits, "cpu", seed=bits)


@pytest.mark.parametrize("bits", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_moe_gemm_reference(bits, dtype):
    num_experts, n, k, top_k = 7, 72, 96, 2
    qweight, absmax, cb, w64 = _experts(num_experts, n, k, bits)
    for m, block_m, weighted in [(1, 16, True), (3, 5, False), (16, 16, True)]:
        ids, weights = mc.routing(m, num_experts, top_k, "cpu", seed=m)
        x = torch.randn(m, k).to(dtype)
        sorted_ids, expert_ids, ntpp = mc.align_ref(ids, block_m, num_experts)
        tw = weights if weighted else None
        y = torch.ops.kbit.moe_gemm(x, qweight, absmax, cb, bits, n, k, sorted_ids, expert_ids, ntpp,
                                    block_m, top_k, tw)
        assert y.shape == (m * top_k, n) and y.dtype == dtype
        kc.assert_close(y, mc.moe_expected(x, ids, tw, w64, top_k), dtype, f"m={m} block_m={block_m}")


def test_moe_gemm_reference_expert_parallel_and_down():
    """Experts off this rank (expert_ids -1) leave their rows 0; the down projection's call
    (x one row a pair, top_k = 1, the [M, top_k] weights flat) reuses the same sorted ids."""
    bits, dtype, n, k, top_k, m, block_m = 3, torch.float16, 64, 64, 2, 9, 4
    global_experts = 7
    expert_map = torch.tensor([0, -1, 1, -1, 2, 3, -1], dtype=torch.int32)
    qweight, absmax, cb, w64 = _experts(4, n, k, bits)
    ids, weights = mc.routing(m, global_experts, top_k, "cpu", seed=5)
    sorted_ids, expert_ids, ntpp = mc.align_ref(ids, block_m, global_experts, expert_map)
    x = torch.randn(m, k).to(dtype)
    y = torch.ops.kbit.moe_gemm(x, qweight, absmax, cb, bits, n, k, sorted_ids, expert_ids, ntpp, block_m, top_k)
    ref = mc.moe_expected(x, ids, None, w64, top_k, expert_map)
    off = expert_map[ids.reshape(-1).long()] < 0
    assert bool(off.any()) and bool((y[off] == 0).all())
    kc.assert_close(y, ref, dtype, "up")
    x2 = torch.randn(m * top_k, k).to(dtype)
    y2 = torch.ops.kbit.moe_gemm(x2, qweight, absmax, cb, bits, n, k, sorted_ids, expert_ids, ntpp, block_m, 1,
                                 weights)
    ref2 = mc.moe_expected(x2, ids.reshape(-1, 1), weights, w64, 1, expert_map)
    assert bool((y2[off] == 0).all())
    kc.assert_close(y2, ref2, dtype, "down")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequantize_experts_reference(dtype):
    bits, n, k = 4, 40, 64
    qweight, absmax, cb, _ = _experts(3, n, k, bits)
    w = torch.ops.kbit.dequantize_experts(qweight, absmax, cb, bits, n, k, dtype)
    assert w.shape == (3, n, k) and w.dtype == dtype
    for e in range(3):
        assert torch.equal(w[e], kf.dequantize(qweight[e], absmax[e], bits, cb, dtype=dtype))


def test_moe_ops_schema_and_fake():
    """The schemas and fake kernels agree with the reference (opcheck), and moe_gemm traces
    into a compiled graph as one opaque op."""
    bits, n, k, top_k, block_m = 2, 64, 64, 2, 16
    qweight, absmax, cb, _ = _experts(3, n, k, bits)
    ids, weights = mc.routing(4, 3, top_k, "cpu", seed=0)
    aligned = mc.align_ref(ids, block_m, 3)
    x = torch.randn(4, k).to(torch.bfloat16)
    args = (qweight, absmax, cb, bits, n, k, *aligned, block_m, top_k, weights)
    torch.library.opcheck(torch.ops.kbit.moe_gemm.default, (x, *args), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.kbit.dequantize_experts.default, (qweight, absmax, cb, bits, n, k, torch.float16),
                          test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda t: torch.ops.kbit.moe_gemm(t, *args), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.ops.kbit.moe_gemm(x, *args))
