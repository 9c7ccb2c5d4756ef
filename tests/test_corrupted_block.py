"""The kernel tests' comparison (kernel_check) catches one wrong block: for every path, one
32-weight block of one row of the packed weight with its planes flipped, and separately one
E4M4 absmax code two exponents off, must make the comparison against the uncorrupted float64
reference fail, in that row's output column alone; the uncorrupted weight must pass.

Runs on the CPU against the PyTorch reference of the ops (kbit::gemm, kbit::moe_gemm,
kbit::dequantize_experts on CPU tensors; repack is the identity there), so CI proves the
comparison fails on one bad block; and, marked gpu, against each CUDA path: GEMV, mma.sync,
wgmma, dequantize + cuBLAS (kbit::gemm_path), the MoE GEMV, the stacked dequantize. K = 14336
(Llama-3-8B's down projection, where the bound is loosest), 16 rows of x (kernel_check's
module doc gives the odds: a miss has probability < 1e-9).
"""
import pytest
import torch

from vllm_kbit import format as kf
from vllm_kbit import ops

import kernel_check as kc
import moe_cases as mc

HAVE_KERNELS = torch.cuda.is_available() and ops.HAS_CUDA_KERNELS
BITS = [2, 3, 4, 5]
DTYPES = [torch.float16, torch.bfloat16]
CORRUPTIONS = ["clean", "planes", "code"]
K = 14336
M = 16
# kbit::gemm_path's path ids (csrc/dispatch/path_rule.h)
PATH_GEMV, PATH_MMA, PATH_DEQUANT, PATH_WGMMA = 1, 2, 3, 4


def _weight(n, k, bits, device):
    """A random checkpoint-layout weight (random indices, E4M4 codes 2^-4 .. 2^-1) with the
    default codebook, and its float64 value."""
    idx = torch.randint(0, 1 << bits, (n, k), device=device, dtype=torch.uint8)
    absmax = torch.randint(0x70, 0xA0, (n, k // 32), device=device, dtype=torch.uint8)
    cb = kf.default_codebook(bits, device)
    qweight = kf.pack_bitplanes(idx, bits)
    return qweight, absmax, cb, kf.dequantize(qweight, absmax, bits, cb, dtype=torch.float64)


def _corrupt(kind, qweight, absmax, bits, row, block):
    if kind == "planes":
        return kc.flip_planes(qweight, bits, row, block), absmax
    if kind == "code":
        return qweight, kc.bump_code(absmax, row, block)
    return qweight, absmax


def _assert_verdict(kind, y, ref, dtype, row, where):
    """clean: the comparison passes; corrupted: it fails, in output column `row` alone."""
    problem = kc.compare(y, ref, dtype)
    if kind == "clean":
        assert problem is None, f"{problem} {where}"
        return
    assert problem is not None, f"one wrong block ({kind}, W row {row}) passed the comparison {where}"
    cols = kc.outside(y, ref, dtype).reshape(-1, y.shape[-1]).any(0).nonzero().flatten().tolist()
    assert cols == [row], f"failing columns {cols[:8]}, expected [{row}] {where}"


def _dense(device, path, bits, dtype, kind, n):
    qweight, absmax, cb, w64 = _weight(n, K, bits, device)
    row, block = int(torch.randint(n, ())), int(torch.randint(K // 32, ()))
    q, a = _corrupt(kind, qweight, absmax, bits, row, block)
    x = torch.randn(M, K, device=device).to(dtype)
    if device == "cpu":
        y = torch.ops.kbit.gemm(x, q, a, cb, bits, n, K)
    else:
        packed, ap = ops.repack(q, a, bits)
        y = torch.ops.kbit.gemm_path(x, packed, ap, cb, bits, n, K, None, path, 0, "")
    _assert_verdict(kind, y, kc.matmul(x, w64), dtype, row, f"path={path} bits={bits} {dtype} block={block}")


def _moe(device, bits, dtype, kind, num_experts, n):
    qs, as_, cb = [], [], kf.default_codebook(bits, device)
    for _ in range(num_experts):
        q, a, _, _ = _weight(n, K, bits, device)
        qs.append(q)
        as_.append(a)
    qweight, absmax = torch.stack(qs), torch.stack(as_)
    w64 = torch.stack([kf.dequantize(qweight[e], absmax[e], bits, cb, dtype=torch.float64) for e in range(num_experts)])
    bad = int(torch.randint(num_experts, ()))
    row, block = int(torch.randint(n, ())), int(torch.randint(K // 32, ()))
    q, a = qweight.clone(), absmax.clone()
    q[bad], a[bad] = _corrupt(kind, qweight[bad], absmax[bad], bits, row, block)
    if device != "cpu":
        q, a = mc.stack_tiled(q, a, bits)
    where = f"bits={bits} {dtype} expert={bad} block={block}"
    # every token's first choice is the corrupted expert, its second another one
    other = (bad + 1 + torch.randint(num_experts - 1, (M,), device=device)) % num_experts
    ids = torch.stack([torch.full_like(other, bad), other], 1).to(torch.int32)
    weights = torch.softmax(torch.randn(M, 2, device=device), -1)
    x = torch.randn(M, K, device=device).to(dtype)
    aligned = mc.align_ref(ids, 16, num_experts) if device == "cpu" else mc.align(ids, 16, num_experts)
    y = torch.ops.kbit.moe_gemm(x, q, a, cb, bits, n, K, *aligned, 16, 2, weights)
    ref = mc.moe_expected(x, ids, weights, w64, 2)
    _assert_verdict(kind, y[0::2], kc.Reference(*(t[0::2] for t in ref)), dtype, row, "moe_gemm " + where)
    problem = kc.compare(y[1::2], kc.Reference(*(t[1::2] for t in ref)), dtype)
    assert problem is None, f"the other experts' rows: {problem} moe_gemm {where}"
    w = torch.ops.kbit.dequantize_experts(q, a, cb, bits, n, K, dtype)
    ref_w = kc.weights(w64)
    problem = kc.compare(w, ref_w, dtype)
    if kind == "clean":
        assert problem is None, f"{problem} dequantize_experts {where}"
    else:
        wrong = kc.outside(w, ref_w, dtype).nonzero()
        assert wrong.numel() > 0, f"one wrong block ({kind}) passed the comparison dequantize_experts {where}"
        assert bool((wrong[:, 0] == bad).all() & (wrong[:, 1] == row).all() & (wrong[:, 2] // 32 == block).all()), \
            f"failing elements outside the corrupted block: {wrong[:4].tolist()} dequantize_experts {where}"


# ----------------------------------------------------------------------------- CPU: the reference ops

@pytest.mark.parametrize("kind", CORRUPTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_reference_gemm_one_bad_block(bits, dtype, kind):
    _dense("cpu", None, bits, dtype, kind, n=64)


@pytest.mark.parametrize("kind", CORRUPTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_reference_moe_one_bad_block(bits, dtype, kind):
    _moe("cpu", bits, dtype, kind, num_experts=2, n=32)


# ----------------------------------------------------------------------------- GPU: every kernel path

def _gpu_paths():
    paths = [PATH_GEMV, PATH_DEQUANT]
    if not HAVE_KERNELS:
        return paths
    paths += [PATH_MMA] if torch.ops.kbit.has_mma() else []
    paths += [PATH_WGMMA] if torch.ops.kbit.has_wgmma() else []
    return paths


needs_kernels = pytest.mark.skipif(not HAVE_KERNELS, reason="needs a CUDA GPU and the built vllm_kbit._C")


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("kind", CORRUPTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("path", _gpu_paths())
def test_kernel_one_bad_block(path, bits, dtype, kind):
    """4096 x 14336, M = 16, through each path forced (GEMV up to M = 16, the tensor-core ones
    and dequantize + cuBLAS at any M)."""
    _dense("cuda", path, bits, dtype, kind, n=4096)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("kind", CORRUPTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_moe_kernels_one_bad_block(bits, dtype, kind):
    _moe("cuda", bits, dtype, kind, num_experts=8, n=1024)

