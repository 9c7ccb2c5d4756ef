"""Shared checks of the FP8-activation kbit GEMM (test_fp8_gpu.py, sanitize_fp8.py).

Weights are random codebook indices and E4M4 codes in the checkpoint layout, tiled by
kbit::repack. The kernel's activation quantizer must match vllm_kbit.fp8.quantize_act bit for bit;
the GEMM is checked against vllm_kbit.fp8's float64 function of the same e4m3 operands, per element:
|y - ref| <= 2^-10 * sum_k |x_q w_q| * s_x 2^-r (the accumulation) plus the output's rounding.
Hopper's FP8 MMA keeps fewer bits than fp32 while it accumulates (the fused kernel's wgmma, and
the fast-accumulation CUTLASS kernels of vLLM's scaled_mm that the decode-first path calls):
measured on an H100 up to about twice 2^-12 * sum_k |x_q w_q| at K = 2080, so the bound allows
four times that. One wrong 32-block moves an element by ~|x_q w_q| * sqrt(32), still far beyond
the first term for the K used here (each case checks that its bound sees one wrong block).
"""
import torch

from vllm_kbit import format as kf
from vllm_kbit import fp8
from vllm_kbit import ops

import gemm_cases
from gemm_cases import poison

ACC_EPS = 2.0 ** -10
OUT_EPS = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def random_weight(n, k, bits, seed, codes=(0x70, 0xA0)):
    """(qweight, absmax codes) in the checkpoint layout, (packed, absmax) tiled, codebook."""
    idx, e4m4 = gemm_cases.random_codes(n, k, bits, seed, codes)
    qweight = kf.pack_bitplanes(idx, bits)
    packed, absmax = torch.ops.kbit.repack(qweight, e4m4, bits)
    return qweight, e4m4, packed, absmax, kf.normal_float_codebook(bits, "cuda")


def reference(xq, scale, qweight, e4m4, cb, bits, w_exp, bias):
    """(ref float64, bound float64) for the kernel's x_q and s_x."""
    xn = fp8.unpermute(xq, bits)
    w_q = fp8.decode_weight(qweight, e4m4, cb, bits, w_exp)
    ref = fp8.linear_quantized(xn, scale.unsqueeze(1), w_q, w_exp, bias)
    mag = (xn.double().abs() @ w_q.double().abs().t()) * scale.double().unsqueeze(1) * 2.0 ** -w_exp
    return ref, xn, w_q, mag


def within(y, ref, mag, dtype):
    err = (y.double() - ref).abs()
    bound = ACC_EPS * mag + OUT_EPS[dtype] * ref.abs() * 1.001 + 1e-30
    return err <= bound, err, bound


def tile_overrides(tile):
    """The plan overrides that force the CTA tile (tokens, columns); (0, 0): the plan's choice."""
    return "" if tile == (0, 0) else ops.plan_overrides({"fp8.tile_m": tile[0], "fp8.tile_n": tile[1]})


def check(m, n, k, bits, dtype, bias=False, tile=(0, 0), x_scale=1.0, seed=0, fused=True):
    """Quantizer bit for bit, GEMM per element (with the tile forced unless (0, 0)); returns y."""
    qweight, e4m4, packed, absmax, cb = random_weight(n, k, bits, 1000 * bits + n + 7 * k + seed)
    w_exp = fp8.weight_exponent(e4m4)
    b = (torch.randn(n, device="cuda") * 0.5).to(dtype) if bias else None
    x = (torch.randn(m, k, device="cuda") * x_scale).to(dtype)
    where = f"m={m} n={n} k={k} bits={bits} {dtype} bias={bias} tile={tile}"

    xq, scale = torch.ops.kbit.quantize_act_fp8(x, bits)
    xq_ref, scale_ref = fp8.quantize_act(x, bits)
    assert torch.equal(scale, scale_ref), f"s_x differs from the reference {where}"
    mism = (xq.view(torch.uint8) != xq_ref.view(torch.uint8)).sum().item()
    assert mism == 0, f"{mism} x_q bytes differ from the reference {where}"

    overrides = tile_overrides(tile)
    plan = ops.fp8_plan(m, n, k, bits, dtype, overrides)  # the kernel the call below runs
    assert (plan.bits, plan.dtype) == (bits, 0 if dtype == torch.float16 else 1), (plan, where)
    assert tile == (0, 0) or (plan.tile_m, plan.tile_n) == tile, (plan, where)
    poison(m, n, dtype)
    y = torch.ops.kbit.gemm_fp8_quantized(xq, scale, packed, absmax, cb, bits, n, k, w_exp, dtype, b, overrides)
    assert torch.isfinite(y).all(), f"non-finite output (unwritten?) {where}"
    ref, xn, w_q, mag = reference(xq, scale, qweight, e4m4, cb, bits, w_exp, b)
    ok, err, bound = within(y, ref, mag, dtype)
    if not ok.all():
        i = int((~ok).nonzero()[0, 0]), int((~ok).nonzero()[0, 1])
        raise AssertionError(f"{int((~ok).sum())} elements off {where}; first {i}: y={y[i].item()} "
                             f"ref={ref[i].item()} err={err[i].item():.3e} bound={bound[i].item():.3e}")
    if fused:
        poison(m, n, dtype)
        y2 = torch.ops.kbit.gemm_fp8(x, packed, absmax, cb, bits, n, k, w_exp, b)
        path = ops.fp8_plan(m, n, k, bits, dtype).path
        if path == ops.Fp8Path.SIXTEEN_BIT:  # the plan's 16-bit path: kbit::gemm's bits
            assert torch.equal(y2, torch.ops.kbit.gemm(x, packed, absmax, cb, bits, n, k, b)), where
        elif path == ops.Fp8Path.DECODE_FIRST:  # another GEMM: the same bound, not the same bits
            assert torch.isfinite(y2).all() and within(y2, ref, mag, dtype)[0].all(), f"gemm_fp8 (decode first) off {where}"
        elif tile == (0, 0):
            assert torch.equal(y, y2), f"gemm_fp8 differs from quantize + gemm_fp8_quantized {where}"
        else:
            assert torch.isfinite(y2).all() and within(y2, ref, mag, dtype)[0].all(), f"gemm_fp8 off {where}"
    # the bound is tight enough to see one wrong block: negate one block of one weight row
    wb = w_q.double().clone()
    wb[n // 2, 32 * ((k // 32) // 2): 32 * ((k // 32) // 2) + 32] *= -1
    bad = (xn.double() @ wb.t()) * scale.double().unsqueeze(1) * 2.0 ** -w_exp
    if b is not None:
        bad = bad + b.double()
    assert not within(bad.to(dtype), ref, mag, dtype)[0][:, n // 2].all(), f"bound blind to one wrong block {where}"
    return y


def check_decode_first(m, n, k, bits, dtype, bias=False, seed=0):
    """The decode-first path (kbit::gemm_fp8_path with fp8.path=1): kbit::decode_fp8 bit for
    bit against fp8.decode_weight, the natural-order quantizer bit for bit, the GEMM per element.
    Where no FP8 GEMM serves the shape (n % 16 != 0) the plan falls back to the fused kernel."""
    qweight, e4m4, packed, absmax, cb = random_weight(n, k, bits, 3000 * bits + n + 7 * k + seed)
    w_exp = fp8.weight_exponent(e4m4)
    b = (torch.randn(n, device="cuda") * 0.5).to(dtype) if bias else None
    x = torch.randn(m, k, device="cuda").to(dtype)
    where = f"decode-first m={m} n={n} k={k} bits={bits} {dtype} bias={bias}"

    torch.empty(n * k, dtype=torch.uint8, device="cuda").fill_(0x7F)  # e4m3 NaN where unwritten
    w_q = torch.ops.kbit.decode_fp8(packed, absmax, cb, bits, n, k, w_exp)
    w_ref = fp8.decode_weight(qweight, e4m4, cb, bits, w_exp)
    mism = (w_q.view(torch.uint8) != w_ref.view(torch.uint8)).sum().item()
    assert mism == 0, f"{mism} decoded e4m3 weights differ from fp8.decode_weight {where}"
    xq, scale = torch.ops.kbit.quantize_act_fp8(x, 0)
    xq_ref, scale_ref = fp8.quantize_act(x, 0)
    assert torch.equal(scale, scale_ref) and torch.equal(xq.view(torch.uint8), xq_ref.view(torch.uint8)), where

    overrides = ops.plan_overrides({"fp8.path": int(ops.Fp8Path.DECODE_FIRST)})
    plan = ops.fp8_plan(m, n, k, bits, dtype, overrides)
    want = ops.Fp8Path.DECODE_FIRST if n % 16 == 0 else ops.Fp8Path.FUSED
    assert plan.path == want, (plan, where)
    poison(m, n, dtype)
    y = torch.ops.kbit.gemm_fp8_path(x, packed, absmax, cb, bits, n, k, w_exp, b, overrides)
    assert torch.isfinite(y).all(), f"non-finite output (unwritten?) {where}"
    ref = fp8.linear_quantized(xq_ref, scale_ref.unsqueeze(1), w_ref, w_exp, b)
    mag = (xq_ref.double().abs() @ w_ref.double().abs().t()) * scale_ref.double().unsqueeze(1) * 2.0 ** -w_exp
    ok, err, bound = within(y, ref, mag, dtype)
    if not ok.all():
        i = int((~ok).nonzero()[0, 0]), int((~ok).nonzero()[0, 1])
        raise AssertionError(f"{int((~ok).sum())} elements off {where}; first {i}: y={y[i].item()} "
                             f"ref={ref[i].item()} err={err[i].item():.3e} bound={bound[i].item():.3e}")
    return y
