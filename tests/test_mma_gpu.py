"""Tensor-core kbit GEMM (csrc/mma/mma_kernel.cuh) on the GPU, through torch.ops.kbit.gemm_path(path=2).

The checks (tests/gemm_cases.py): repack + kernel against a float64 matmul of the dequantized
weight, NaN-poisoned outputs, two runs with fresh x each; the split-K cases are also rerun
with the same x and compared bitwise (the reduction sums the k-chunks in a fixed order, so
results are bitwise deterministic).
The grid is sampled to stay well under 2 minutes on an H200: every M on one odd shape,
subsets elsewhere; kbit::mma_plan asserts that both split-K and no-split plans are hit.
"""
import pytest
import torch

import gemm_cases
from vllm_kbit import ops
from gemm_cases import weight

pytestmark = pytest.mark.gpu

MMA_PATH = ops.Path.MMA
ALL_M = [17, 31, 32, 33, 48, 64, 127, 128, 255, 256, 512, 1000, 1024, 4096]


if not gemm_cases.have("has_mma"):
    pytest.skip("needs a CUDA GPU and vllm_kbit._C with the tensor-core kernel", allow_module_level=True)


def run(x, packed, absmax, cb, bits, n, k, bias=None):
    return gemm_cases.run(MMA_PATH, x, packed, absmax, cb, bits, n, k, bias)


def plan(m, n, k, bits):
    p = ops.mma_plan(m, n, k, bits, gemm_cases.overrides())
    return dict(cfg=p.config, tile_m=p.tile_m, tile_n=p.tile_n, splits=p.splits, kps=p.k_tiles_per_split,
                items=p.items, grid=p.grid, ws=p.workspace_bytes, kernel=p.kernel)


def check(m, n, k, bits, dtype, bias=False, tiny=False, x_scale=1.0):
    return gemm_cases.check(MMA_PATH, m, n, k, bits, dtype, bias, tiny, x_scale,
                            describe=lambda: f"plan={plan(m, n, k, bits)}")


@pytest.mark.parametrize("m", ALL_M)
def test_all_m_odd_shape(m):
    # N = 4104: not a multiple of 64/256 (a partial 64-column unit and a partial CTA tile);
    # K = 4128 = 32 * 129: the last K-tile holds one 32-block (x zero-filled past K).
    check(m, 4104, 4128, 4, torch.float16, bias=(m % 2 == 1))


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bits_dtypes(bits, dtype):
    for m in (33, 256):
        check(m, 4104, 4128, bits, dtype, bias=True)
    check(127, 200, 96, bits, dtype, bias=True)   # tiny N (one CTA, 4 units) and K = 3 blocks
    check(1000, 4096, 4096, bits, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_subnormal_scales(dtype):
    # Every block's absmax is an E4M4 subnormal (exponent field 0): a kernel that flushed
    # subnormal scales would return zeros. x is scaled up so y stays well inside fp16 range.
    check(48, 1000, 2080, 4, dtype, tiny=True, x_scale=256.0)


@pytest.mark.parametrize("cfg,splits", [(0, 1), (0, 3), (1, 1), (1, 3), (2, 1), (2, 3)])
def test_forced_configs(cfg, splits, monkeypatch):
    # Every tile config with and without split-K, whatever the heuristic would pick
    # (forced through the plan overrides mma.config / mma.splits; mma_plan reports them).
    # M = 100: a row tail in the last m-tile of every config; N = 1000, K = 4128 (65 K-tiles,
    # the last one half empty; with 3 splits the chunks are 22, 22, 21).
    monkeypatch.setitem(gemm_cases.OVERRIDES, "mma.config", cfg)
    monkeypatch.setitem(gemm_cases.OVERRIDES, "mma.splits", splits)
    p = plan(100, 1000, 4128, 3)
    assert (p["cfg"], p["splits"]) == (cfg, splits)
    for bits, dtype in ((3, torch.float16), (5, torch.bfloat16)):
        check(100, 1000, 4128, bits, dtype, bias=True)


def test_split_k_plans_are_exercised():
    assert plan(64, 4096, 4096, 4)["splits"] > 1
    assert plan(33, 4104, 4128, 3)["splits"] > 1       # odd K-tile count, uneven last chunk
    assert plan(4096, 4104, 4128, 4)["splits"] == 1
    assert plan(1000, 4096, 4096, 4)["cfg"] == 2


@pytest.mark.parametrize("m,n,k,bits,dtype", [
    (64, 4096, 4096, 4, torch.float16),      # split-K
    (33, 4104, 4128, 3, torch.bfloat16),     # split-K, odd K-tiles
    (512, 4104, 4128, 5, torch.float16),
    (4096, 4104, 4128, 2, torch.bfloat16),   # no split, many tiles per CTA
])
def test_deterministic(m, n, k, bits, dtype):
    outs, (packed, absmax, cb, b) = check(m, n, k, bits, dtype, bias=True)
    for x, y in outs:
        y2 = run(x, packed, absmax, cb, bits, n, k, b)
        assert torch.equal(y.view(torch.int16), y2.view(torch.int16)), "not bitwise deterministic"


def test_auto_path_matches_forced():
    # kbit::gemm's own dispatch gives the same bits as the forced MMA path where it names that
    # path (between the GEMV limit and the dequantize + cuBLAS threshold, on builds without wgmma).
    m, n, k, bits = 100, 1000, 2048, 4
    packed, absmax, cb, w = weight(n, k, bits)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    if torch.ops.kbit.auto_path(m, n, k, bits, torch.float16) != MMA_PATH:
        pytest.skip("another path serves this M here (the wgmma kernel on Hopper builds)")
    y_auto = torch.ops.kbit.gemm(x, packed, absmax, cb, bits, n, k, None)
    y_mma = run(x, packed, absmax, cb, bits, n, k)
    assert torch.equal(y_auto, y_mma)


def test_cuda_graph_capture():
    gemm_cases.check_graph_capture(MMA_PATH, m=64, n=4096, k=4096, bits=4)  # split-K: workspace + on-stream counter memset
