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


def emulate_kernel(packed, absmax_packed, cb, bits, n, k, xq, scale, w_exp):
    """The FP8 GEMM's data flow, lane by lane, in float64 (csrc/wgmma_fp8/fp8_kernel.cuh): each
    lane's plane words of the tiled layout (layout.repack_ref), the decoder's pairs, the packing
    into the 8-bit A fragment, the row -> column map of the epilogue, and the kernel's x_q."""
    from vllm_kbit import layout as kl
    nu_n, ku_n = kl.n_units(n), kl.k_units(k)
    slots = (packed.long() & 0xFFFFFFFF).view(nu_n, ku_n, bits, 32, 4)
    planes = kl.slots_to_planes(slots, bits)                              # [nu, ku, bits, lane, word]
    codes = absmax_packed.view(nu_n, ku_n, 8, 4, 4)                       # [nu, ku, g, word, q]
    table = (cb.double() * 2.0 ** (w_exp + 4)).to(torch.float16)
    # every (E4M4 code, index) weight as the kernel rounds it: fp16 table x fp16 scale, then e4m3
    s16 = (kf.decode_e4m4(torch.arange(256, dtype=torch.int64).to(torch.uint8)) / 16).to(torch.float16)
    wtab = (s16.unsqueeze(1) * table.unsqueeze(0)).to(torch.float8_e4m3fn).double().tolist()
    planes, codes = planes.tolist(), codes.tolist()
    pairs = [(0, 2), (1, 3), (4, 6), (5, 7)] if bits == 2 else [(s, s + 4) for s in range(4)]
    m = xq.shape[0]
    xqp = torch.zeros(m, ku_n * 64, dtype=torch.float64)
    xqp[:, :k] = xq.double()
    w_frag = torch.zeros(nu_n * 64, ku_n * 64, dtype=torch.float64)      # [column, x_q position]
    for nu in range(nu_n):
        for ku in range(ku_n):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for wi in range(4):
                    kb, h = wi >> 1, wi & 1
                    for q in range(4):
                        col = nu * 64 + 8 * (4 * h + q) + g       # n8 group 4h + q (core/layout.cuh)
                        # the epilogue's map: row tile 2h + qp, rows g (q = 2qp) / g + 8 (q = 2qp + 1)
                        assert col == nu * 64 + 16 * (2 * h + q // 2) + 8 * (q % 2) + g
                        wrow = wtab[codes[nu][ku][g][wi][q]]
                        words = [planes[nu][ku][b][lane][wi] for b in range(bits)]

                        def weight(e):
                            return wrow[sum(((words[b] >> (8 * q + e)) & 1) << b for b in range(bits))]
                        # registers 0 (positions 4t..4t+3) and 2 (16+4t..): pairs 0, 1 and 2, 3, lo byte first
                        for reg, (pa, pb) in enumerate([(0, 1), (2, 3)]):
                            for i, e in enumerate((pairs[pa][0], pairs[pa][1], pairs[pb][0], pairs[pb][1])):
                                w_frag[col, ku * 64 + kb * 32 + 16 * reg + 4 * t + i] = weight(e)
    acc = xqp @ w_frag.t()
    return acc[:, :n] * scale.double().unsqueeze(1) * 2.0 ** -w_exp


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_emulated_kernel_matches_reference(bits):
    # the lane-level model of the kernel on the real tiled layout agrees with the reference:
    # the k permutation, the pair packing and the row -> column map are consistent
    from vllm_kbit import layout as kl
    g = torch.Generator().manual_seed(10 + bits)
    n, k, m = 80, 96, 5                                      # a partial unit along N and along K
    idx = torch.randint(0, 1 << bits, (n, k), generator=g).to(torch.uint8)
    codes = torch.randint(0x70, 0xA0, (n, k // 32), generator=g).to(torch.uint8)
    qweight = kf.pack_bitplanes(idx, bits)
    packed, absmax_packed = kl.repack_ref(qweight, codes, bits)
    cb = kf.normal_float_codebook(bits)
    r = fp8_act.weight_exponent(codes)
    x = torch.randn(m, k, generator=g).to(torch.float16)
    xq, s = fp8_act.quantize_act(x, bits)
    y_emu = emulate_kernel(packed, absmax_packed, cb, bits, n, k, xq, s, r)
    w_q = fp8_act.weight_e4m3(qweight, codes, bits, cb, r)
    ref = fp8_act.gemm_from_quantized(fp8_act.unpermute(xq, bits), s, w_q, r, None, torch.float64)
    assert torch.allclose(y_emu, ref, rtol=1e-12, atol=1e-12)
    # and a wrong permutation would not: x_q in natural order disagrees
    y_bad = emulate_kernel(packed, absmax_packed, cb, bits, n, k, fp8_act.unpermute(xq, bits), s, r)
    assert not torch.allclose(y_bad, ref, rtol=1e-3, atol=1e-3)
