"""FP8 activations (vllm_kbit.fp8): the function the CUDA kernel computes, against an independent
float64 evaluation of its definition; the kernel's k permutation and data flow modelled lane by
lane; the CPU ops; the choice by M, the config field, the converter flag, the serve-time
override through vLLM's hf_overrides, and vLLM's layers on the CPU computing the function."""
import json
import math
import zlib
from pathlib import Path
from unittest import mock

import pytest
import torch

from vllm_kbit import format as kf
from vllm_kbit import fp8, ops
from vllm_kbit.quant import default_codebook

DTYPES = (torch.float16, torch.bfloat16)


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """e4m3 (1-4-3, bias 7, max 448) round-to-nearest-even with saturation, written from the
    format's definition in float64 (not through torch's float8 cast)."""
    v = v.double().clamp(-448.0, 448.0)
    _, e = torch.frexp(v)                                        # |v| = m 2^e, 0.5 <= m < 1
    quantum = torch.ldexp(torch.ones_like(v), (e - 1).clamp_min(-6) - 3)  # 3 mantissa bits; subnormals below 2^-6
    return torch.round(v / quantum) * quantum                    # torch.round: half to even


def direct_activations(x):
    """Step 1 from its definition: (x_q as float64, s_x float32 [M, 1])."""
    amax = x.float().abs().amax(-1, keepdim=True)
    s_x = torch.maximum(amax, torch.tensor(2.0 ** -64)) / torch.tensor(448.0)  # fp32 division
    return e4m3_round(x.float() / s_x), s_x                       # fp32 division, then e4m3


def direct_weight(qweight, absmax, cb, bits, w_exp):
    """Step 3 from its definition, element by element from the checkpoint tensors (float64): the
    kernel's fp16 pair table entry fp16(cb 2^(r+4)) times the fp16 block scale E4M4 / 16,
    rounded to fp16, then to e4m3."""
    n = absmax.shape[0]
    idx = kf.unpack_bitplanes(qweight, bits).long().reshape(n, -1, 32)
    table16 = (cb.double() * 2.0 ** (w_exp + 4)).half().double()
    scale16 = (kf.e4m4_table().double() / 16).half().double()[absmax.long()].unsqueeze(-1)
    assert torch.equal(scale16 * 16, kf.e4m4_table().double()[absmax.long()].unsqueeze(-1))  # exact in fp16
    w16 = (table16[idx] * scale16).reshape(n, -1).half()  # the float64 product is exact: one rounding
    return e4m3_round(w16.double())


def direct_fp8_linear(x, qweight, absmax, cb, bits, w_exp, bias=None):
    """Steps 1-4 in float64: (w_q, y)."""
    x_q, s_x = direct_activations(x)
    w_q = direct_weight(qweight, absmax, cb, bits, w_exp)
    y = (x_q @ w_q.t()) * s_x.double() * 2.0 ** -w_exp
    if bias is not None:
        y = y + bias.double()
    return w_q, y


def random_layer(n, k, bits, gen, std=0.05, cb=None):
    w = torch.randn(n, k, generator=gen) * std
    cb = default_codebook(bits) if cb is None else cb
    q, a = kf.quantize(w, bits, cb)
    return q, a, cb


def test_weight_exponent_is_the_largest_that_fits_up_to_the_cap():
    table = kf.e4m4_table().double()
    capped = 0
    for code in range(1, 256):
        r = fp8.weight_exponent(torch.tensor([[0, code], [code // 2, 1]], dtype=torch.uint8))
        top = table[code].item()
        if top * 2.0 ** (fp8.MAX_WEIGHT_EXP + 1) <= 448.0:  # the kernel's fp16 table caps r
            assert r == fp8.MAX_WEIGHT_EXP, code
            capped += 1
        else:
            assert top * 2.0 ** r <= 448.0 < top * 2.0 ** (r + 1), code
    assert 0 < capped < 255
    # 0.484375 * 2^9 = 248 <= 448 < 496; 31 * 8 = 248, 31 * 16 > 448
    assert fp8.weight_exponent(torch.tensor([[0x70, 0x9F]], dtype=torch.uint8)) == 9
    assert fp8.weight_exponent(torch.tensor([0xFF], dtype=torch.uint8)) == 3
    # 1.75 * 2^8 = 448 exactly: the bound is inclusive
    code = int(kf.encode_e4m4(torch.tensor(1.75)))
    assert kf.decode_e4m4(torch.tensor(code, dtype=torch.uint8)).item() == 1.75
    assert fp8.weight_exponent(torch.tensor([code], dtype=torch.uint8)) == 8
    assert fp8.weight_exponent(torch.zeros(3, 4, dtype=torch.uint8)) == fp8.MAX_WEIGHT_EXP
    with pytest.raises(ValueError, match="absmax must be the uint8 E4M4 codes"):
        fp8.weight_exponent(torch.ones(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="absmax is empty"):
        fp8.weight_exponent(torch.zeros(0, dtype=torch.uint8))


def test_e4m3_rounding_ties_saturation_and_subnormals():
    v = torch.tensor([17.0, 19.0, 1.0625, 1.1875, 460.0, 1e6, -500.0, 2.0 ** -10, 3 * 2.0 ** -11,
                      2.0 ** -6 + 2.0 ** -10, 0.0, -0.0])
    want = [16.0, 20.0, 1.0, 1.25, 448.0, 448.0, -448.0, 0.0, 2.0 ** -9, 2.0 ** -6, 0.0, 0.0]
    assert e4m3_round(v).tolist() == want
    assert fp8.to_e4m3(v).double().tolist() == want


@pytest.mark.parametrize("dtype", DTYPES + (torch.float32,))
def test_quantize_activations_matches_the_definition(dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(str(dtype).encode()))
    x = (torch.randn(37, 96, generator=gen) * torch.logspace(-6, 2, 37).unsqueeze(1)).to(dtype)
    x[3] = 0  # an all-zero token: the floor scale, zeros out
    x[5, 7] = 1e4 if dtype == torch.bfloat16 else 6e4  # one outlier sets its token's scale
    x_q, s_x = fp8.quantize_activations(x)
    ref_q, ref_s = direct_activations(x)
    assert x_q.dtype == torch.float8_e4m3fn and s_x.dtype == torch.float32 and s_x.shape == (37, 1)
    assert torch.equal(s_x, ref_s) and torch.equal(x_q.double(), ref_q)
    assert s_x[3].item() == (torch.tensor(2.0 ** -64) / 448).item() and not x_q[3].double().any()
    nonzero = torch.ones(37, dtype=torch.bool)
    nonzero[3] = False
    assert (x_q.double().abs().amax(-1)[nonzero] == 448.0).all()  # each token's largest maps to 448
    with pytest.raises(ValueError, match="x must be float16, bfloat16 or float32"):
        fp8.quantize_activations(x.double())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
def test_reference_equals_a_direct_float64_evaluation(bits, dtype, bias):
    gen = torch.Generator().manual_seed(zlib.crc32(f"ref-{bits}-{dtype}-{bias}".encode()))
    n, k, m = 72, 160, 29
    # block scales over three decades: small blocks reach e4m3's subnormals
    q, a, cb = random_layer(n, k, bits, gen, std=0.05)
    a = (a.int() - torch.randint(0, 48, a.shape, generator=gen)).clamp(0, 255).to(torch.uint8)
    r = fp8.weight_exponent(a)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    w_q, y_ref = direct_fp8_linear(x, q, a, cb, bits, r, b)
    assert torch.equal(fp8.decode_weight(q, a, cb, bits, r).double(), w_q)
    y = torch.full((m, n), float("nan"), dtype=dtype)
    y[:] = fp8.gemm_fp8_reference(x, q, a, cb, bits, n, k, r, b)
    assert y.dtype == dtype and torch.isfinite(y).all()
    # the same sum in another order: one rounding of the output apart at most
    ulp = torch.finfo(dtype).eps * y_ref.abs().clamp_min(1e-3)
    assert ((y.double() - y_ref).abs() <= ulp).all()
    # and FP8's error against the 16-bit layer is what e4m3 costs (a few %), not a wrong scale
    exact = x.double() @ kf.dequantize(q, a, bits, cb, dtype=torch.float64).t() + (b.double() if bias else 0)
    assert 1e-3 < ((y.double() - exact).norm() / exact.norm()).item() < 0.08


def test_decoded_weight_is_the_kernels_fp16_decode_and_fits_e4m3():
    """One weight per code at the layer's largest scale: w_q is the e4m3 of the fp16 product of
    the fp16 table entry cb 2^(r+4) and E4M4 / 16, and none saturates."""
    bits = 4
    cb = default_codebook(bits)
    idx = torch.arange(32) % 16
    q = kf.pack_bitplanes(idx.to(torch.uint8).reshape(1, 32), bits)
    a = torch.tensor([[kf.encode_e4m4(torch.tensor(0.3))]], dtype=torch.uint8)
    r = fp8.weight_exponent(a)
    w_q = fp8.decode_weight(q, a, cb, bits, r).double()[0]
    top = kf.decode_e4m4(a).double().item() * 2.0 ** r
    assert top <= 448 and w_q.abs().max().item() <= 448
    want = e4m3_round(((cb.double() * 2.0 ** (r + 4)).half().double()[idx] * (top * 2.0 ** -(r + 4))).half().double())
    assert torch.equal(w_q, want)
    with pytest.raises(ValueError, match=r"absmax has shape \(1, 2\)"):
        fp8.decode_weight(q, a.repeat(1, 2), cb, bits, r)


def test_a_layer_of_small_weights_runs_at_the_capped_exponent():
    """max absmax below 448 / 2^12: r stays at the cap (the kernel's fp16 table would overflow
    above it), the weights sit lower in e4m3's range and still follow the definition."""
    gen = torch.Generator().manual_seed(12)
    n, k, bits = 40, 96, 4
    q, a, cb = random_layer(n, k, bits, gen, std=0.004)
    top = kf.decode_e4m4(a.max()).item()
    assert top * 2.0 ** (fp8.MAX_WEIGHT_EXP + 1) <= 448
    r = fp8.weight_exponent(a)
    assert r == fp8.MAX_WEIGHT_EXP
    x = torch.randn(20, k, generator=gen).half()
    w_q, y_ref = direct_fp8_linear(x, q, a, cb, bits, r)
    assert torch.equal(fp8.decode_weight(q, a, cb, bits, r).double(), w_q)
    assert w_q.abs().max().item() <= 224  # below e4m3's top binade, never saturated
    y = fp8.gemm_fp8_reference(x, q, a, cb, bits, n, k, r)
    assert ((y.double() - y_ref).abs() <= torch.finfo(torch.float16).eps * y_ref.abs().clamp_min(1e-3)).all()


@pytest.mark.parametrize("m", [1, 16, 17, 64])
def test_gemm_keeps_16_bit_activations_in_the_gemv_range(m):
    gen = torch.Generator().manual_seed(m)
    n, k, bits = 48, 128, 4
    q, a, cb = random_layer(n, k, bits, gen)
    r = fp8.weight_exponent(a)
    x = torch.randn(2, m, k, generator=gen).to(torch.bfloat16)[0]
    y = fp8.gemm(x.unsqueeze(0), q, a, cb, bits, n, k, r)[0]
    want = (ops.gemm(x, q, a, cb, bits, n, k) if m <= fp8.GEMV_MAX_M
            else fp8.gemm_fp8_reference(x, q, a, cb, bits, n, k, r))
    assert torch.equal(y, want)
    with pytest.raises(ValueError, match="x has 64 features .* k = 128"):
        fp8.gemm(x[:, :64], q, a, cb, bits, n, k, r)


def test_linear_fp8_op_schema_and_fake():
    gen = torch.Generator().manual_seed(5)
    q, a, cb = random_layer(32, 64, 3, gen)
    x = torch.randn(20, 64, generator=gen).to(torch.float16)
    args = (x, q, a, cb, 3, 32, 64, fp8.weight_exponent(a), torch.randn(32, generator=gen).to(torch.float16))
    torch.library.opcheck(torch.ops.kbit.linear_fp8.default, args, test_utils=("test_schema", "test_faketensor"))


def test_kernel_available_follows_the_extension(monkeypatch):
    # without the extension the reference serves (no reason to refuse); with it, only a Hopper
    # build's kernel (kbit::has_fp8) reads its layout
    monkeypatch.setattr(ops, "HAS_CUDA_KERNELS", False)
    assert not fp8.kernel_available() and fp8.unavailable_reason() is None
    monkeypatch.setattr(ops, "HAS_CUDA_KERNELS", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not fp8.kernel_available()
    assert "Hopper" in fp8.unavailable_reason() and "9.0a" in fp8.unavailable_reason()


# ----------------------------------------------------------------------------- the kernel's data flow

def layout_k(t, e):
    # core/layout.cuh: bit e of lane t's byte of a block is the weight at this k of the block
    return 16 * (e >> 2) + 8 * ((e >> 1) & 1) + 2 * t + (e & 1)


def decoder_pairs(bits):
    # core/decode.cuh Decoder::pair: pair s = (first, second) element of the layout byte
    return [(0, 2), (1, 3), (4, 6), (5, 7)] if bits == 2 else [(s, s + 4) for s in range(4)]


@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
def test_k_permutation_matches_the_fragments(bits):
    perm = fp8.k_permutation(bits)
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_act_is_the_natural_quantizer_permuted(dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(f"qa-{dtype}".encode()))
    x = (torch.randn(7, 256, generator=gen) * torch.logspace(-3, 2, 7).unsqueeze(1)).to(dtype)
    x[3] = 0
    for bits in kf.SUPPORTED_BITS:
        xq, s = torch.ops.kbit.quantize_act_fp8(x, bits)
        ref_q, ref_s = direct_activations(x)
        assert xq.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (7,)
        assert torch.equal(s, ref_s.squeeze(1))
        xn = fp8.unpermute(xq, bits)
        assert torch.equal(xn.double(), ref_q)
        perm = torch.tensor(fp8.k_permutation(bits))
        for blk in range(256 // 32):
            cols = slice(32 * blk, 32 * blk + 32)
            assert torch.equal(xq[:, cols].view(torch.uint8), xn[:, cols][:, perm].view(torch.uint8))
    xq, s = torch.ops.kbit.quantize_act_fp8(x, 0)  # natural order: the decode-first path's
    assert torch.equal(xq.double(), ref_q) and torch.equal(s, ref_s.squeeze(1))
    with pytest.raises(ValueError, match="bits"):
        fp8.quantize_act(x, 1)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        fp8.quantize_act(x.float(), 4)
    with pytest.raises(ValueError, match="K % 32 == 0"):
        fp8.quantize_act(x[:, :48], 4)


@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
def test_cpu_ops_compute_the_reference(bits):
    gen = torch.Generator().manual_seed(zlib.crc32(f"ops-{bits}".encode()))
    n, k = 72, 192
    q, a, cb = random_layer(n, k, bits, gen)
    r = fp8.weight_exponent(a)
    x = torch.randn(9, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    w_q, ref = direct_fp8_linear(x, q, a, cb, bits, r, bias)
    y = torch.ops.kbit.gemm_fp8(x, q, a, cb, bits, n, k, r, bias)
    assert y.dtype == torch.bfloat16 and torch.equal(y, fp8.gemm_fp8_reference(x, q, a, cb, bits, n, k, r, bias))
    assert ((y.double() - ref).abs() <= torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)).all()
    xq, s = torch.ops.kbit.quantize_act_fp8(x, bits)
    y2 = torch.ops.kbit.gemm_fp8_quantized(xq, s, q, a, cb, bits, n, k, r, torch.bfloat16, bias)
    assert torch.equal(y, y2)
    assert torch.equal(ops.gemm_fp8(x.unsqueeze(0), q, a, cb, bits, n, k, r, bias)[0], y)
    assert torch.equal(torch.ops.kbit.gemm_fp8_path(x, q, a, cb, bits, n, k, r, bias, "fp8.path=1"), y)
    assert torch.equal(torch.ops.kbit.decode_fp8(q, a, cb, bits, n, k, r).double(), w_q.double())
    # close to the 16-bit layer (e4m3 of x and w: a few percent)
    yf = x.double() @ kf.dequantize(q, a, bits, cb, dtype=torch.float64).t() + bias.double()
    assert ((y.double() - yf).norm() / yf.norm()).item() < 0.1


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(5, 64, dtype=torch.float16)
        y = torch.ops.kbit.gemm_fp8(x, torch.empty(1, dtype=torch.int32), torch.empty(1, dtype=torch.uint8),
                                    torch.empty(16), 4, 96, 64, 0)
        xq, s = torch.ops.kbit.quantize_act_fp8(x, 4)
        y2 = torch.ops.kbit.gemm_fp8_path(x, torch.empty(1, dtype=torch.int32), torch.empty(1, dtype=torch.uint8),
                                          torch.empty(16), 4, 96, 64, 0, None, "fp8.path=1")
        w = torch.ops.kbit.decode_fp8(torch.empty(1, dtype=torch.int32), torch.empty(1, dtype=torch.uint8),
                                      torch.empty(16), 4, 96, 64, 0)
    assert y.shape == (5, 96) and xq.shape == (5, 64) and xq.dtype == torch.float8_e4m3fn and s.shape == (5,)
    assert y2.shape == (5, 96) and w.shape == (96, 64) and w.dtype == torch.float8_e4m3fn


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
    pairs = decoder_pairs(bits)
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


@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
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
    r = fp8.weight_exponent(codes)
    x = torch.randn(m, k, generator=g).to(torch.float16)
    xq, s = fp8.quantize_act(x, bits)
    y_emu = emulate_kernel(packed, absmax_packed, cb, bits, n, k, xq, s, r)
    w_q = fp8.decode_weight(qweight, codes, cb, bits, r)
    ref = fp8.linear_quantized(fp8.unpermute(xq, bits), s.unsqueeze(1), w_q, r)
    assert torch.allclose(y_emu, ref, rtol=1e-12, atol=1e-12)
    # and a wrong permutation would not: x_q in natural order disagrees
    y_bad = emulate_kernel(packed, absmax_packed, cb, bits, n, k, fp8.unpermute(xq, bits), s, r)
    assert not torch.allclose(y_bad, ref, rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------- the setting

def test_check_activations_names_the_field():
    assert fp8.check_activations("auto") == "auto"
    assert fp8.check_activations("fp8") == "fp8"
    for bad in ("FP8", "fp16", "e4m3", True, None, 8):
        with pytest.raises(ValueError, match=r"quantization_config\.activations must be one of 'auto', 'fp8'"):
            fp8.check_activations(bad)


def converted(tmp_path):
    """A tiny random Llama, converted with --activations auto (`a`) and fp8 (`b`)."""
    from vllm_kbit.convert import main
    from vllm_kbit.synthetic import make_random_llama
    src = make_random_llama(tmp_path / "src", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                            num_kv_heads=2, vocab_size=320, seed=1)

    def qc(d):
        return json.loads((d / "config.json").read_text())["quantization_config"]
    assert main([str(src), str(tmp_path / "a"), "--bits", "4", "--device", "cpu"]) == 0
    assert qc(tmp_path / "a")["activations"] == "auto"
    assert main([str(src), str(tmp_path / "b"), "--bits", "4", "--device", "cpu", "--activations", "fp8"]) == 0
    assert qc(tmp_path / "b")["activations"] == "fp8"
    return src


def test_convert_writes_the_activations_field(tmp_path, capsys):
    from vllm_kbit.convert import ConversionError, convert, main
    src = converted(tmp_path)
    assert main([str(src), str(tmp_path / "c"), "--bits", "4", "--activations", "int8"]) != 0
    assert "argument --activations: invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(ConversionError, match="activations must be one of 'auto', 'fp8', got 'e4m3'"):
        convert(src, tmp_path / "c", 4, device="cpu", activations="e4m3")
    assert not (tmp_path / "c").exists()


def test_check_reports_a_models_setting(tmp_path, monkeypatch):
    import io

    from vllm_kbit import check
    converted(tmp_path)
    assert check.model_line(str(tmp_path / "b")) == (f"model {tmp_path / 'b'}: kbit K=4, activations fp8", None)
    assert check.model_line(str(tmp_path / "a"))[0].endswith("kbit K=4, activations auto")
    line, problem = check.model_line(str(tmp_path / "src"))
    assert "not a kbit checkpoint" in line and problem
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    cfg["quantization_config"]["activations"] = "int8"
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    line, problem = check.model_line(str(tmp_path / "b"))
    assert "quantization_config.activations must be one of 'auto', 'fp8', got 'int8'" in problem
    monkeypatch.setattr(check, "_vllm_sees_kbit", lambda: (True, "fake"))
    out = io.StringIO()
    assert check.run(out, model=str(tmp_path / "a")) == 0 and "activations auto" in out.getvalue()
    assert check.run(io.StringIO(), model=str(tmp_path / "b")) == 1


@pytest.mark.parametrize("why", [None, "the FP8 kernel needs a Hopper GPU"])
def test_check_says_what_fp8_layers_run(why, monkeypatch):
    from vllm_kbit import check
    monkeypatch.setattr(fp8, "unavailable_reason", lambda: why)
    line = check.fp8_line()
    assert line.startswith("FP8 activations (")
    if why:
        assert f"16-bit activations instead: {why}" in line
    elif fp8.kernel_available():
        assert "where the plan finds FP8 faster" in line
    else:
        assert "above 16 tokens" in line


pytest.importorskip("vllm")

import vllm_kbit  # noqa: E402

vllm_kbit.register()

from vllm_kbit.config import ACTIVATIONS_OVERRIDE, KbitConfig  # noqa: E402


def _vllm_config_with(hf_config):
    return mock.Mock(model_config=mock.Mock(hf_config=hf_config))


def test_config_field_and_errors():
    base = {"quant_method": "kbit", "bits": 4}
    assert KbitConfig.from_config(base).activations == "auto"  # checkpoints without the field
    assert KbitConfig.from_config({**base, "activations": "fp8"}).activations == "fp8"
    assert KbitConfig().activations == "auto"
    with pytest.raises(ValueError, match=r"quantization_config\.activations must be one of"):
        KbitConfig.from_config({**base, "activations": "float8"})
    assert "activations='fp8'" in repr(KbitConfig.from_config({**base, "activations": "fp8"}))


def test_hf_overrides_reach_the_config(tmp_path):
    """`--hf-overrides '{"kbit_activations": "fp8"}'`: vLLM's get_config applies a flat override
    onto the model's hf_config (a dict-valued one such as quantization_config would replace the
    checkpoint's whole dict); the layers read it there, over quantization_config."""
    from vllm.transformers_utils.config import get_config
    src = converted(tmp_path)
    hf = get_config(str(tmp_path / "a"), trust_remote_code=False, hf_overrides_kw={ACTIVATIONS_OVERRIDE: "fp8"})
    assert getattr(hf, ACTIVATIONS_OVERRIDE) == "fp8"
    cfg = KbitConfig.from_config(hf.quantization_config)  # the checkpoint's own config is intact
    assert cfg.activations == "auto" and cfg.bits == 4
    with mock.patch("vllm_kbit.config.get_current_vllm_config_or_none", return_value=_vllm_config_with(hf)):
        assert cfg.serving_activations() == "fp8"
        assert KbitConfig().serving_activations() == "fp8"  # --quantization kbit on a float model
    plain = get_config(str(src), trust_remote_code=False)
    with mock.patch("vllm_kbit.config.get_current_vllm_config_or_none", return_value=_vllm_config_with(plain)):
        assert KbitConfig.from_config({"quant_method": "kbit", "bits": 4, "activations": "fp8"}).serving_activations() == "fp8"
        assert KbitConfig().serving_activations() == "auto"
    bad = get_config(str(tmp_path / "b"), trust_remote_code=False, hf_overrides_kw={ACTIVATIONS_OVERRIDE: "FP8"})
    with mock.patch("vllm_kbit.config.get_current_vllm_config_or_none", return_value=_vllm_config_with(bad)), \
         pytest.raises(ValueError, match="--hf-overrides kbit_activations must be one of 'auto', 'fp8'"):
        KbitConfig.from_config(bad.quantization_config).serving_activations()
    with mock.patch("vllm_kbit.config.get_current_vllm_config_or_none", return_value=None):
        assert KbitConfig.from_config(bad.quantization_config).serving_activations() == "fp8"


def test_vllm_replaces_a_dict_valued_override_whole(tmp_path):
    """Why the serve-time key is top-level: vLLM's ModelConfig sets a dict-valued hf_override
    (quantization_config is a plain dict in hf_config) in place of the checkpoint's, so a
    partial quantization_config would drop bits and codebook."""
    from vllm.config import ModelConfig
    from vllm.transformers_utils.config import get_config
    converted(tmp_path)
    hf = get_config(str(tmp_path / "a"), trust_remote_code=False)
    ModelConfig._apply_dict_overrides(mock.Mock(), hf, {"quantization_config": {"activations": "fp8"}})
    assert hf.quantization_config == {"activations": "fp8"}


# ----------------------------------------------------------------------------- vLLM layers on the CPU

@pytest.mark.usefixtures("vllm_single_process")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "row"])
def test_layer_with_fp8_activations_computes_the_reference(kind, bits, dtype):
    """On the CPU the layer runs the reference itself (equal bits); on a GPU with the FP8 kernel,
    the kernel within fp32-accumulation error and one output rounding of it."""
    from test_vllm_layers import DEVICE, build, forward, make_config, shards_for
    if DEVICE == "cuda" and not fp8.kernel_available():
        pytest.skip(f"no FP8 kernel here: {fp8.unavailable_reason()}")
    gen = torch.Generator().manual_seed(zlib.crc32(f"fp8-layer-{kind}-{bits}".encode()))
    shards = shards_for(kind, bits, gen)
    cb = kf.default_codebook(bits)  # make_config's
    layer = build(kind, bits, dtype, shards, cfg=make_config(bits, activations="fp8"))
    plain = build(kind, bits, dtype, shards)
    assert layer.kbit_fp8 and not plain.kbit_fp8
    q = torch.cat([s[0] for s in shards.values()])
    a = torch.cat([s[1] for s in shards.values()])
    assert layer.kbit_w_exp == fp8.weight_exponent(a)  # one exponent for the fused layer
    n, k = q.shape[0], a.shape[1] * 32
    for m in (40, 5):
        x = torch.randn(m, k, generator=gen).to(dtype)
        y = forward(layer, x)
        if m <= fp8.GEMV_MAX_M:
            assert torch.equal(y, forward(plain, x)), m
            continue
        want = fp8.gemm_fp8_reference(x, q, a, cb, bits, n, k, layer.kbit_w_exp)
        assert y.dtype == dtype and torch.isfinite(y).all()
        if DEVICE == "cuda" and ops.fp8_plan(m, n, k, bits, dtype).path == ops.Fp8Path.SIXTEEN_BIT:
            assert torch.equal(y, forward(plain, x)), m  # the plan's faster 16-bit path at this M
            continue
        if DEVICE == "cpu":
            assert torch.equal(y, want), m
        else:
            bound = torch.finfo(dtype).eps * want.double().abs() + 1e-4 * want.double().abs().mean()
            assert ((y.double() - want.double()).abs() <= bound).all(), m
    m = 40 if DEVICE == "cpu" else 2048  # an M the GPU plan runs with FP8 activations
    x = torch.randn(m, k, generator=gen).to(dtype)
    assert not torch.equal(forward(layer, x), forward(plain, x))


@pytest.mark.usefixtures("vllm_single_process")
def test_layer_without_the_fp8_kernel_runs_16_bit_activations():
    """A GPU build without the FP8 kernel cannot run the reference on its kernels' layout: the
    layer multiplies 16-bit activations and says so once."""
    from test_vllm_layers import build, make_config, shards_for
    gen = torch.Generator().manual_seed(9)
    shards = shards_for("row", 4, gen)
    with mock.patch("vllm_kbit.fp8.unavailable_reason", return_value="the FP8 kernel needs a Hopper GPU"), \
         mock.patch("vllm_kbit.linear.logger.warning_once") as warn:
        layer = build("row", 4, torch.float16, shards, cfg=make_config(4, activations="fp8"))
    assert not layer.kbit_fp8 and not hasattr(layer, "kbit_w_exp")
    assert "needs a Hopper GPU" in warn.call_args[0][1]


def test_online_and_dummy_configs_accept_the_override():
    """`--quantization kbit` and `--load-format dummy` build KbitConfig() with no fields: the
    serve-time override alone turns FP8 on, at every K."""
    hf = mock.Mock(spec=[])
    setattr(hf, ACTIVATIONS_OVERRIDE, "fp8")
    with mock.patch("vllm_kbit.config.get_current_vllm_config_or_none", return_value=_vllm_config_with(hf)):
        for bits in kf.SUPPORTED_BITS:
            assert KbitConfig(bits=bits).serving_activations() == "fp8"


def test_the_quality_benchmark_simulates_the_same_function():
    """benchmarks/quality.py --fp8 runs fp8.linear on a weight decoded once, accumulating in
    float32: the reference's function up to the accumulation order."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("quality", Path(__file__).resolve().parents[1] / "benchmarks" / "quality.py")
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    gen = torch.Generator().manual_seed(21)
    w = torch.randn(64, 96, generator=gen) * 0.05
    bias = torch.randn(64, generator=gen)
    cb = default_codebook(4)
    x = torch.randn(33, 96, generator=gen)
    y = quality.kbit_fp8_forward(w, 4, cb, "rtn", bias)(x)
    q, a = kf.quantize(w, 4, cb)
    want = fp8.gemm_fp8_reference(x, q, a, cb, 4, 64, 96, fp8.weight_exponent(a), bias)
    torch.testing.assert_close(y.double(), want.double(), rtol=1e-5, atol=1e-5)
    # W8A8: per-channel e4m3 weights; its error is e4m3's, a few %
    exact = x.double() @ w.double().t() + bias.double()
    err = ((quality.w8a8_forward(w, bias)(x).double() - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 0.06 and math.isfinite(err)
