"""FP8-activation kbit GEMM (csrc/wgmma_fp8/, Hopper sm_90a) on the GPU: kbit::quantize_act_fp8,
kbit::gemm_fp8_quantized (each CTA tile forced through the plan overrides fp8.tile_m / fp8.tile_n,
and the plan's choice), kbit::gemm_fp8 and its three paths (fp8.path: the fused kernel,
decode-first with kbit::decode_fp8, the 16-bit kbit::gemm),
against vllm_kbit/fp8.py's float64 function of the same e4m3 operands (tests/fp8_cases.py:
the quantizer bit for bit, the GEMM per element within the fp32-accumulation bound, outputs
NaN-poisoned first). Every K x output dtype x tile, odd M, N not a multiple of the column tile,
K with an odd count of 64-k units. Skips off Hopper or on a build without 9.0a.
"""
import pytest
import torch

import gemm_cases
from fp8_cases import check, check_decode_first, random_weight
from vllm_kbit import fp8, ops

pytestmark = pytest.mark.gpu

if not gemm_cases.have("has_wgmma"):
    pytest.skip("needs an sm_90 GPU and vllm_kbit._C built for 9.0a", allow_module_level=True)

BITS = [2, 3, 4, 5]
DTYPES = [torch.float16, torch.bfloat16]
TILES = [(64, 128), (128, 128), (256, 128), (128, 256)]  # the CTA tiles, tokens x columns
SHAPES = [  # m, n, k
    (17, 200, 320),      # one partial token tile, a slab past N, 5 k-units (odd: last K-tile half empty)
    (100, 1000, 2080),   # K % 64 == 32
    (257, 136, 4096),    # three token tiles at 128, a partial second column group (and slabs past N)
    (1000, 520, 1024),
]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_fp8(bits, dtype, tile, shape):
    m, n, k = shape
    check(m, n, k, bits, dtype, bias=(m % 2 == 1), tile=tile)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_fp8_kernel_choice(bits, dtype):
    tiles = []
    for m in (64, 1024, 2200):  # the plan's choice on 132 SMs: 64 x 128, 128 x 128, 128 x 256
        check(m, 4096, 1024, bits, dtype, bias=True, seed=m)
        plan = ops.fp8_plan(m, 4096, 1024, bits, dtype)
        assert plan.token_tiles == -(-m // plan.tile_m) and plan.column_groups == -(-4096 // plan.tile_n), plan
        tiles.append((plan.tile_m, plan.tile_n))
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert tiles == [(64, 128), (128, 128), (128, 256)], tiles


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(17, 208, 320), (300, 1024, 2080), (64, 200, 512)],
                         ids=lambda s: "x".join(map(str, s)))
def test_decode_first(bits, dtype, shape):
    # vLLM's CUTLASS scaled_mm where vLLM's extension loads (fp16 and bf16), else torch's (bf16)
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C.cutlass_scaled_mm)
    except ImportError:
        if dtype == torch.float16:
            pytest.skip("no FP8 GEMM with fp16 output without vLLM")
    m, n, k = shape
    check_decode_first(m, n, k, bits, dtype, bias=(m % 2 == 1))


def test_path_plan():
    # dispatch/fp8_plan.h with the H100 / H200 tables: the 16-bit kbit::gemm below
    # fp8_decode_min_m tokens, decode-first from there where an FP8 GEMM serves the shape
    P = ops.Fp8Path
    for m, want in ((17, P.SIXTEEN_BIT), (512, P.SIXTEEN_BIT), (1024, P.DECODE_FIRST), (4096, P.DECODE_FIRST)):
        assert ops.fp8_plan(m, 4096, 4096, 4, torch.bfloat16).path == want, m
    assert ops.fp8_plan(4096, 4104, 4096, 4, torch.bfloat16).path == P.SIXTEEN_BIT  # n % 16: no FP8 GEMM
    forced = ops.fp8_plan(512, 4096, 4096, 4, torch.bfloat16, {"fp8.path": 1})
    assert forced.path == P.DECODE_FIRST and forced.kernel.startswith("decode_fp8<K4>")
    assert ops.fp8_plan(512, 4104, 4096, 4, torch.bfloat16, {"fp8.path": 1}).path == P.FUSED
    assert ops.fp8_plan(4096, 4096, 4096, 4, torch.bfloat16, {"fp8.path": 0}).path == P.FUSED
    # the 16-bit path is kbit::gemm, bit for bit
    _, e4m4, packed, absmax, cb = random_weight(256, 512, 3, 5)
    x = torch.randn(100, 512, device="cuda").half()
    y = torch.ops.kbit.gemm_fp8_path(x, packed, absmax, cb, 3, 256, 512, fp8.weight_exponent(e4m4), None, "fp8.path=2")
    assert torch.equal(y, torch.ops.kbit.gemm(x, packed, absmax, cb, 3, 256, 512, None))


def test_scales_and_zero_rows():
    # rows of very different magnitude and an all-zero row: per-token scales, no 0 / 0
    x_scale = torch.logspace(-6, 3, 33, device="cuda").unsqueeze(1)
    for dtype in DTYPES:
        y = check(33, 264, 512, 4, dtype, x_scale=x_scale)
        assert torch.isfinite(y).all()
    x = torch.zeros(5, 256, device="cuda", dtype=torch.float16)
    x[1] = torch.randn(256, device="cuda").half() * 1e-3
    xq, s = torch.ops.kbit.quantize_act_fp8(x, 3)
    xq_ref, s_ref = fp8.quantize_act(x, 3)
    assert torch.equal(s, s_ref) and torch.equal(xq.view(torch.uint8), xq_ref.view(torch.uint8))
    assert (xq[0].view(torch.uint8) == 0).all()


def test_cuda_graph():
    n, k, bits = 520, 2048, 4
    qweight, e4m4, packed, absmax, cb = random_weight(n, k, bits, 7)
    w_exp = fp8.weight_exponent(e4m4)
    x = torch.randn(200, k, device="cuda").half()
    try:
        import vllm._custom_ops  # noqa: F401  (the decode-first path's fp16 FP8 GEMM)
    except ImportError:
        pass
    for path in ops.Fp8Path:  # each path the plan can take, captured and replayed
        def op():
            return torch.ops.kbit.gemm_fp8_path(x, packed, absmax, cb, bits, n, k, w_exp, None, f"fp8.path={int(path)}")
        graph, y = gemm_cases.capture_graph(op)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            gemm_cases.replay_poisoned(graph, y)
            assert torch.equal(y, op()), path


def test_errors():
    n, k, bits = 128, 256, 4
    _, e4m4, packed, absmax, cb = random_weight(n, k, bits, 3)
    x = torch.randn(8, k, device="cuda").half()
    with pytest.raises(RuntimeError, match="w_exp"):
        torch.ops.kbit.gemm_fp8(x, packed, absmax, cb, bits, n, k, fp8.MAX_WEIGHT_EXP + 1)
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.kbit.gemm_fp8(x, packed[:-1], absmax, cb, bits, n, k, 0)
    xq, s = torch.ops.kbit.quantize_act_fp8(x, bits)
    with pytest.raises(RuntimeError, match="x_q"):
        torch.ops.kbit.gemm_fp8_quantized(xq.view(torch.uint8), s, packed, absmax, cb, bits, n, k, 0, torch.float16)
    with pytest.raises(RuntimeError, match="fp8.tile_m=96"):
        torch.ops.kbit.gemm_fp8_quantized(xq, s, packed, absmax, cb, bits, n, k, 0, torch.float16, None,
                                          "fp8.tile_m=96")
    with pytest.raises(RuntimeError, match="fp8.tile_n=256"):
        torch.ops.kbit.gemm_fp8_quantized(xq, s, packed, absmax, cb, bits, n, k, 0, torch.float16, None,
                                          "fp8.tile_m=256,fp8.tile_n=256")
    with pytest.raises(RuntimeError, match="unknown override"):
        torch.ops.kbit.gemm_fp8_quantized(xq, s, packed, absmax, cb, bits, n, k, 0, torch.float16, None, "fp8.tile=1")
