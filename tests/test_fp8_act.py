"""FP8-activation reference (vllm_kbit/fp8_act.py) on the CPU: the kernel's k permutation, the
weight exponent, the quantizer and the GEMM reference, and the CPU ops."""
import pytest
import torch

from vllm_kbit import format as kf
from vllm_kbit import fp8_act, ops  # noqa: F401  (ops registers the schemas)


def layout_k(t, e):
    # core/layout.cuh: bit e of lane t's byte of a block is the weight at this k of the block
    return 16 * (e >> 2) + 8 * ((e >> 1) & 1) + 2 * t + (e & 1)


def decoder_pairs(bits):
    # core/decode.cuh Decoder::pair: pair s = (first, second) element of the layout byte
    return [(0, 2), (1, 3), (4, 6), (5, 7)] if bits == 2 else [(s, s + 4) for s in range(4)]


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_k_permutation_matches_the_fragments(bits):
    perm = fp8_act.k_permutation(bits)
    assert sorted(perm) == list(range(32))  # a permutation of the block
    # the 8-bit wgmma A fragment (m64nNk32): lane t's register 0 holds k positions 4t..4t+3 of
    # row g, register 2 positions 16+4t..16+4t+3; the kernel packs pairs 0, 1 (lo, hi bytes) into
    # register 0 and pairs 2, 3 into register 2, so x_q position p must hold the layout k of the
    # weight in that byte
    pairs = decoder_pairs(bits)
    for t in range(4):
        for reg, (pa, pb) in enumerate([(0, 1), (2, 3)]):
            elems = [pairs[pa][0], pairs[pa][1], pairs[pb][0], pairs[pb][1]]
            for i, e in enumerate(elems):
                assert perm[16 * reg + 4 * t + i] == layout_k(t, e)
    # every element of every lane lands once
    assert sorted(layout_k(t, e) for t in range(4) for e in range(8)) == list(range(32))


def test_weight_exponent():
    codes = torch.tensor([[0x70, 0x9F]], dtype=torch.uint8)  # max absmax 2^-2 * 1.9375 = 0.484375
    r = fp8_act.weight_exponent(codes)
    assert 0.484375 * 2 ** r <= 448 < 0.484375 * 2 ** (r + 1) and r == 9
    assert fp8_act.weight_exponent(torch.tensor([0xFF], dtype=torch.uint8)) == 3  # 31 * 8 = 248, 31 * 16 > 448
    assert fp8_act.weight_exponent(torch.tensor([0x01], dtype=torch.uint8)) == fp8_act.MAX_WEIGHT_EXP
    assert fp8_act.weight_exponent(torch.zeros(3, dtype=torch.uint8)) == fp8_act.MAX_WEIGHT_EXP
    # exactly 448 / 2^r: 448 = 2^8 * 1.75 -> E4M4 1.75 * 2^e
    code = torch.tensor([(11 << 4) | 12], dtype=torch.uint8)  # 1.75 * 2^0
    assert fp8_act.weight_exponent(code) == 8
    with pytest.raises(ValueError, match="uint8"):
        fp8_act.weight_exponent(torch.ones(3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantize_act(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 256, generator=g) * torch.logspace(-3, 2, 7).unsqueeze(1)).to(dtype)
    x[3] = 0
    xq, s = fp8_act.quantize_act(x, 4)
    assert xq.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    xn = fp8_act.unpermute(xq, 4)
    amax = x.float().abs().amax(1)
    assert torch.equal(s[[0, 1, 2, 4, 5, 6]], (amax / 448)[[0, 1, 2, 4, 5, 6]])
    assert (xn.float().abs().amax(1)[[0, 1, 2, 4, 5, 6]] == 448).all()  # each row's max maps to 448
    assert (xn[3].float() == 0).all() and s[3] > 0
    rel = (xn.float() * s.unsqueeze(1) - x.float()).abs() / x.float().abs().clamp(min=1e-30)
    big = x.float().abs() >= s.unsqueeze(1) * 2 ** -6  # e4m3 normals: half an ulp of 3 mantissa bits
    assert (rel[big] <= 2 ** -4 * 1.0001).all()
    perm = torch.tensor(fp8_act.k_permutation(4))
    assert torch.equal(xq[:, 32:64].view(torch.uint8), xn[:, 32:64][:, perm].view(torch.uint8))


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_gemm_reference(bits):
    g = torch.Generator().manual_seed(bits)
    n, k = 72, 192
    w = torch.randn(n, k, generator=g) * 0.05
    cb = kf.normal_float_codebook(bits)
    q, a = kf.quantize(w, bits, cb)
    r = fp8_act.weight_exponent(a)
    w_q = fp8_act.weight_e4m3(q, a, bits, cb, r)
    w_deq = kf.dequantize(q, a, bits, cb, dtype=torch.float64)
    # the e4m3 weights are the decoded weights to e4m3's precision (normals: 2^-4 relative)
    wq = w_q.double() * 2.0 ** -r
    normal = w_deq.abs() * 2 ** r >= 2 ** -6
    assert ((wq - w_deq).abs()[normal] <= w_deq.abs()[normal] * 2 ** -4 * 1.01).all()
    x = torch.randn(9, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    y = torch.ops.kbit.gemm_fp8(x, q, a, cb, bits, n, k, r, bias)
    xn, s = fp8_act.quantize_act_natural(x)
    ref = (xn.double() @ w_q.double().t()) * s.double().unsqueeze(1) * 2.0 ** -r + bias.double()
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref.to(torch.bfloat16))
    xq, s2 = torch.ops.kbit.quantize_act_fp8(x, bits)
    y2 = torch.ops.kbit.gemm_fp8_quantized(xq, s2, q, a, cb, bits, n, k, r, torch.bfloat16, bias)
    assert torch.equal(y, y2)
    # close to the fp16-activation layer (e4m3 of x and w: a few percent)
    yf = x.double() @ w_deq.t() + bias.double()
    assert ((y.double() - yf).norm() / yf.norm()).item() < 0.1


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(5, 64, dtype=torch.float16)
        y = torch.ops.kbit.gemm_fp8(x, torch.empty(1, dtype=torch.int32), torch.empty(1, dtype=torch.uint8),
                                    torch.empty(16), 4, 96, 64, 0)
        xq, s = torch.ops.kbit.quantize_act_fp8(x, 4)
    assert y.shape == (5, 96) and xq.shape == (5, 64) and xq.dtype == torch.float8_e4m3fn and s.shape == (5,)
