"""FP8 (e4m3) activations for kbit layers: the function the FP8 GEMM computes, in float64.

For x[M, K] (fp16 / bf16) and a kbit weight W[N, K] (checkpoint layout: codebook indices,
E4M4 absmax codes), the FP8-activation path computes
  1. s_x[m] = max(max_k |x[m, k]|, AMAX_FLOOR) / 448 (fp32),
     x_q[m, k] = e4m3_rn_satfinite(x[m, k] / s_x[m])      (fp32 division, then one rounding);
  2. the layer's weight exponent r (weight_exponent): every decoded weight times 2^r lies in
     e4m3's range;
  3. each weight as the kernel decodes it: the fp16 pair table holds fp16(cb * 2^(r + 4)), the
     block scale is the exact fp16 E4M4 / 16, their fp16 product is rounded to e4m3:
     w_q = e4m3(fp16(fp16(cb[idx] * 2^(r+4)) * E4M4 / 16));
  4. y[m, n] = (sum_k x_q[m, k] w_q[n, k]) * s_x[m] * 2^-r (+ bias), cast to x's dtype.
The kernel (csrc/wgmma_fp8/) accumulates in fp32; the reference below sums in float64.

The kernel's x_q has k permuted inside each 32-block (k_permutation) so that each lane's
decoded weights meet their x without moving data across lanes; `quantize_act` returns that
order, `unpermute` undoes it.
"""
from __future__ import annotations

import math

import torch

from vllm_kbit import format as kf

E4M3_MAX = 448.0
# s_x stays a normal fp32 for an all-zero row (the kernel's fast math flushes subnormals).
AMAX_FLOOR = 2.0 ** -64
# The pair table holds fp16(cb * 2^(r + 4)): r <= 11 keeps it finite (|cb| <= 1).
MAX_WEIGHT_EXP = 11
MIN_WEIGHT_EXP = -24


def weight_exponent(absmax: torch.Tensor) -> int:
    """r = floor(log2(448 / max block absmax)), at most MAX_WEIGHT_EXP: the largest power of two
    that keeps every weight (|w| <= its block's absmax, |cb| <= 1) within e4m3's 448.
    `absmax`: the layer's E4M4 codes (either layout: only their maximum matters)."""
    if absmax.dtype != torch.uint8:
        raise ValueError(f"weight_exponent: absmax must be the uint8 E4M4 codes, got {absmax.dtype}")
    if absmax.numel() == 0:
        raise ValueError("weight_exponent: absmax is empty")
    amax = float(kf.decode_e4m4(absmax.max().reshape(1).cpu()).item())
    if amax == 0.0:
        return MAX_WEIGHT_EXP
    r = math.floor(math.log2(E4M3_MAX / amax))
    while amax * 2.0 ** (r + 1) <= E4M3_MAX:  # exact in float64: powers of two times E4M4 values
        r += 1
    while amax * 2.0 ** r > E4M3_MAX:
        r -= 1
    return max(MIN_WEIGHT_EXP, min(MAX_WEIGHT_EXP, r))


def _fragment_element(bits: int, p: int) -> int:
    """Element e (bit e of the layout byte) whose weight the 8-bit A fragment's position p of a
    32-block (p = 16 half + 4 t + i: byte i of register 2 half of lane t) holds: the decoder's
    pairs (e, e + 4) (K = 3..5) or (0, 2), (1, 3), (4, 6), (5, 7) (K = 2), pairs 0, 1 in register 0
    and 2, 3 in register 2, each pair's first element in the lower byte."""
    half, i = p >> 4, p & 3
    pair, hi = 2 * half + (i >> 1), i & 1
    if bits == 2:
        return (pair >> 1) * 4 + (pair & 1) + 2 * hi
    return pair + 4 * hi


def k_permutation(bits: int) -> list[int]:
    """perm[p] = the k (inside a 32-block) whose x the kernel's x_q holds at position p."""
    kf.check_bits(bits)
    perm = []
    for p in range(32):
        t, e = (p >> 2) & 3, _fragment_element(bits, p)
        perm.append(16 * (e >> 2) + 8 * ((e >> 1) & 1) + 2 * t + (e & 1))
    return perm


def _block_index(k: int, bits: int, device) -> torch.Tensor:
    perm = torch.tensor(k_permutation(bits), dtype=torch.long, device=device)
    return (torch.arange(k // 32, device=device).unsqueeze(1) * 32 + perm).reshape(-1)


def quantize_act_natural(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q e4m3 [M, K] in natural k order, s_x float32 [M]) per step 1."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"quantize_act: x must be float16 or bfloat16, got {x.dtype}")
    xf = x.float()
    amax = xf.abs().amax(dim=1) if x.shape[1] else torch.zeros(x.shape[0], device=x.device)
    # a tensor divisor: torch turns division by a Python scalar into a multiplication by its
    # reciprocal on CUDA, which rounds differently from the kernel's (and step 1's) division
    scale = torch.clamp(amax, min=AMAX_FLOOR) / torch.full_like(amax, E4M3_MAX)
    q = torch.clamp(xf / scale.unsqueeze(1), -E4M3_MAX, E4M3_MAX)  # satfinite (rounds to +-448 anyway)
    return q.to(torch.float8_e4m3fn), scale


def quantize_act(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kbit::quantize_act_fp8's reference: x_q in the kernel's k order for `bits`, s_x."""
    if x.dim() != 2 or x.shape[1] % 32:
        raise ValueError(f"quantize_act: x must be [M, K] with K % 32 == 0, got {tuple(x.shape)}")
    q, scale = quantize_act_natural(x)
    return q[:, _block_index(x.shape[1], bits, x.device)].contiguous(), scale


def unpermute(xq: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's x_q back in natural k order."""
    k = xq.shape[1]
    out = torch.empty_like(xq)
    out[:, _block_index(k, bits, xq.device)] = xq
    return out


def weight_e4m3(qweight: torch.Tensor, absmax: torch.Tensor, bits: int, codebook: torch.Tensor,
                w_exp: int) -> torch.Tensor:
    """w_q [N, K] (float8_e4m3fn, times 2^w_exp) from the checkpoint layout, rounded as the kernel
    rounds (step 3)."""
    idx = kf.unpack_bitplanes(qweight, bits).long()
    table = (codebook.float().to(qweight.device) * 2.0 ** (w_exp + 4)).to(torch.float16)
    scale = (kf.decode_e4m4(absmax) / 16).to(torch.float16)  # exact
    w16 = table[idx] * scale.repeat_interleave(kf.BLOCK_SIZE, dim=1)  # one fp16 rounding (exact fp32 product)
    return w16.to(torch.float8_e4m3fn)


def gemm_from_quantized(xq_natural: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_exp: int,
                        bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Step 4 in float64 (y in float64, before the cast)."""
    acc = xq_natural.double() @ w_q.double().t()
    y = acc * x_scale.double().unsqueeze(1) * 2.0 ** -w_exp
    return y + bias.double() if bias is not None else y


def gemm_ref(x, qweight, absmax, codebook, bits, n, k, w_exp, bias=None):
    """kbit::gemm_fp8's reference on the checkpoint layout (qweight [n, k/32*bits], absmax [n, k/32])."""
    xq, scale = quantize_act_natural(x)
    w_q = weight_e4m3(qweight, absmax, bits, codebook, w_exp)
    return gemm_from_quantized(xq, scale, w_q, w_exp, bias, x.dtype).to(x.dtype)
