"""FP8 (e4m3) activations for kbit layers: the function the FP8 path computes, in one place.

For x[M, K] and a kbit weight W[N, K] (codebook indices, E4M4 block absmax, codebook cb), the
CUDA kernel (csrc/wgmma_fp8/) computes, and the float64 reference here evaluates:
  1. per-token dynamic activation scale: s_x[m] = max(max_k |x[m, k]|, AMAX_FLOOR) / 448 in
     fp32, x_q[m, k] = e4m3(x[m, k] / s_x[m]) (fp32 division, then one rounding to nearest
     even, saturating at +-448);
  2. the layer's weight exponent r (weight_exponent, once at load time): the largest integer
     with max_block_absmax * 2^r <= 448, at most MAX_WEIGHT_EXP, so every decoded weight times
     2^r lies in e4m3's range (|cb| <= 1);
  3. each weight as the kernel decodes it: its fp16 pair table holds fp16(cb * 2^(r + 4)), the
     block scale is E4M4 / 16 in fp16 (exact), their product is rounded once to fp16, then to
     e4m3: w_q = e4m3(fp16(fp16(cb[idx] * 2^(r + 4)) * E4M4 / 16));
  4. y[m, n] = (sum_k x_q[m, k] w_q[n, k]) * s_x[m] * 2^-r (+ bias), cast to x's dtype; the
     kernel accumulates in fp32, the reference in float64.
The kernel's x_q has k permuted inside each 32-block (k_permutation) so that each lane's decoded
weights meet their x without moving data across lanes: `quantize_act` returns that order (the
reference of kbit::quantize_act_fp8), `unpermute` undoes it.

The 16-bit GEMV keeps serving M <= GEMV_MAX_M: `gemm` (the op kbit::linear_fp8) chooses by M.
Above it, kbit::gemm_fp8's plan (csrc/dispatch/fp8_plan.h) takes one of three ways per call:
the fused kernel, decode-first (kbit::decode_fp8 writes W as e4m3 with step 3's rounding once,
x is quantized in natural k order, an FP8 GEMM multiplies: the same function up to the fp32
summation order), or the 16-bit kbit::gemm where that measures faster.
"""
from __future__ import annotations

import math

import torch

from vllm_kbit import format as kf
from vllm_kbit import ops

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# s_x stays a normal fp32 for an all-zero token (the kernel's fast math flushes subnormals), so
# that token quantizes to zeros rather than 0 / 0.
AMAX_FLOOR = 2.0 ** -64
# The kernel's pair table holds fp16(cb * 2^(r + 4)): r <= 11 keeps it finite (|cb| <= 1).
MAX_WEIGHT_EXP = 11
MIN_WEIGHT_EXP = -24
# The GEMV range (M <= 16) keeps 16-bit activations; larger M runs the FP8 tensor-core path.
GEMV_MAX_M = 16


# quantization_config.activations: "auto" multiplies in the model's dtype (fp16 / bf16), as
# --kv-cache-dtype auto means; "fp8": e4m3 activations with per-token dynamic scales on the
# tensor-core paths (this module).
ACTIVATIONS = ("auto", "fp8")


def check_activations(value, where: str = "quantization_config.activations") -> str:
    """The activations setting, or a ValueError naming `where`. Every K may run FP8: at K=5,
    the finest codebook, e4m3 costs about what it costs at K=4 (docs/FP8.md)."""
    if value not in ACTIVATIONS:
        raise ValueError(f"kbit: {where} must be one of {', '.join(map(repr, ACTIVATIONS))}, got {value!r}")
    return value


# ----------------------------------------------------------------------------- the function

def weight_exponent(absmax: torch.Tensor) -> int:
    """r for a layer's E4M4 absmax codes (uint8, any layout: only their maximum counts): the
    largest integer with max_absmax * 2^r <= 448, at most MAX_WEIGHT_EXP (a layer of zero
    blocks gets MAX_WEIGHT_EXP)."""
    if absmax.dtype != torch.uint8:
        raise ValueError(f"kbit fp8: absmax must be the uint8 E4M4 codes, got {absmax.dtype}")
    if absmax.numel() == 0:
        raise ValueError("kbit fp8: absmax is empty")
    top = float(kf.e4m4_table()[int(absmax.max())])  # the table is increasing in the code
    if top == 0.0:
        return MAX_WEIGHT_EXP
    _, exponent = math.frexp(E4M3_MAX / top)  # E4M3_MAX / top = mantissa * 2^exponent, 0.5 <= mantissa < 1
    r = exponent - 1
    while math.ldexp(top, r + 1) <= E4M3_MAX:  # guards the division's rounding at an exact power of two
        r += 1
    while math.ldexp(top, r) > E4M3_MAX:
        r -= 1
    return max(MIN_WEIGHT_EXP, min(MAX_WEIGHT_EXP, r))


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest even e4m3, saturating at +-448 (e4m3fn has no infinity)."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x[..., K] -> (x_q e4m3 [..., K] in natural k order, s_x float32 [..., 1]): step 1. x is
    fp16 / bf16 as the kernel takes it; float32 (the quality benchmark's model) follows the same
    fp32 arithmetic."""
    if not x.dtype.is_floating_point or x.dtype == torch.float64:
        raise ValueError(f"kbit fp8: x must be float16, bfloat16 or float32, got {x.dtype}")
    x32 = x.float()
    amax = x32.abs().amax(-1, keepdim=True) if x.shape[-1] else x32.new_zeros((*x.shape[:-1], 1))
    # a tensor divisor: torch turns division by a Python scalar into a multiplication by its
    # reciprocal on CUDA, which rounds differently from the kernel's (and step 1's) division
    scale = amax.clamp_min(AMAX_FLOOR) / torch.full_like(amax, E4M3_MAX)
    return to_e4m3(x32 / scale), scale


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
    return (torch.arange(k // kf.BLOCK_SIZE, device=device).unsqueeze(1) * kf.BLOCK_SIZE + perm).reshape(-1)


def quantize_act(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kbit::quantize_act_fp8's reference: (x_q e4m3 [M, K] in the kernel's k order for `bits`,
    or in natural order for bits = 0 (the decode-first path's), s_x float32 [M])."""
    if bits != 0:
        kf.check_bits(bits)
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"kbit::quantize_act_fp8: x must be float16 or bfloat16, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] % kf.BLOCK_SIZE:
        raise ValueError(f"kbit::quantize_act_fp8: x must be [M, K] with K % 32 == 0, got {tuple(x.shape)}")
    q, scale = quantize_activations(x)
    if bits == 0:
        return q, scale.squeeze(1)
    return q[:, _block_index(x.shape[1], bits, x.device)].contiguous(), scale.squeeze(1)


def unpermute(xq: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's x_q back in natural k order."""
    out = torch.empty_like(xq)
    out[:, _block_index(xq.shape[1], bits, xq.device)] = xq
    return out


def decode_weight(packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, bits: int,
                  w_exp: int) -> torch.Tensor:
    """w_q [N, K] (float8_e4m3fn, W times 2^w_exp) from the checkpoint layout (where the kernels
    are not loaded, `repack` leaves it as is), rounded as the kernel rounds it (step 3)."""
    idx = kf.unpack_bitplanes(packed, bits).long()
    if absmax.shape != (idx.shape[0], idx.shape[1] // kf.BLOCK_SIZE):
        raise ValueError(f"kbit fp8: absmax has shape {tuple(absmax.shape)}, the weight's {tuple(idx.shape)} "
                         f"needs [{idx.shape[0]}, {idx.shape[1] // kf.BLOCK_SIZE}] (checkpoint layout)")
    table = (codebook.to(packed.device, torch.float32) * 2.0 ** (w_exp + 4)).to(torch.float16)
    scale = (kf.decode_e4m4(absmax) / 16).to(torch.float16)  # exact: the kernel's fp16 view of the code
    w16 = table[idx] * scale.repeat_interleave(kf.BLOCK_SIZE, dim=1)  # one fp16 rounding
    return to_e4m3(w16)


def linear_quantized(x_q: torch.Tensor, s_x: torch.Tensor, w_q: torch.Tensor, w_exp: int,
                     bias: torch.Tensor | None = None, work: torch.dtype = torch.float64) -> torch.Tensor:
    """Step 4 for x_q[..., K] in natural k order, s_x [..., 1], w_q[N, K]: y[..., N] in `work`
    (float64 for the reference; float32 is the kernel's accumulation and faster), not cast."""
    acc = x_q.to(work) @ w_q.to(work).t()
    y = acc * s_x.to(work) * math.ldexp(1.0, -w_exp)
    return y + bias.to(work) if bias is not None else y


def linear(x: torch.Tensor, w_q: torch.Tensor, w_exp: int, bias: torch.Tensor | None = None,
           work: torch.dtype = torch.float64) -> torch.Tensor:
    """Steps 1 and 4 for a decoded e4m3 weight w_q[N, K]: y[..., N] in x's dtype."""
    x_q, s_x = quantize_activations(x)
    return linear_quantized(x_q, s_x, w_q, w_exp, bias, work).to(x.dtype)


def gemm_fp8_reference(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
                       bits: int, n: int, k: int, w_exp: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8-activation layer function (steps 1-4) in float64 on the checkpoint layout
    (packed [n, k/32*bits], absmax [n, k/32]), for x[..., k] -> y[..., n]: kbit::gemm_fp8's
    reference."""
    ops.check_features(x, k, "gemm_fp8")
    w_q = decode_weight(packed, absmax, codebook, bits, w_exp)
    if w_q.shape != (n, k):
        raise ValueError(f"kbit gemm_fp8: the weight decodes to {tuple(w_q.shape)}, the layer expects ({n}, {k})")
    return linear(x, w_q, w_exp, bias)


# ----------------------------------------------------------------------------- where it runs

def kernel_available() -> bool:
    """Whether this process runs the CUDA FP8 kernel: the extension is loaded (its
    fp8_binding.cpp registers kbit::gemm_fp8, quantize_act_fp8 and gemm_fp8_quantized for CUDA)
    and kbit::has_fp8 (ops.has_fp8) says its sm_90a code is built and the GPU is a Hopper
    (compute capability 9.0), the condition the FP8 kernel checks before it launches."""
    return ops.HAS_CUDA_KERNELS and torch.cuda.is_available() and ops.has_fp8()


def unavailable_reason() -> str | None:
    """Why kbit layers of this process cannot run FP8 activations, or None. The reference serves
    where the CUDA kernels are not loaded (it reads the checkpoint layout, which `repack` keeps
    there); where they are, only the FP8 kernel reads their layout."""
    if not ops.HAS_CUDA_KERNELS or kernel_available():
        return None
    return "the FP8 kernel needs a Hopper GPU (compute capability 9.0) and a build with TORCH_CUDA_ARCH_LIST 9.0a"


@torch.library.custom_op("kbit::linear_fp8", mutates_args=())
def _linear_fp8(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, bits: int,
                n: int, k: int, w_exp: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    # One op, so the choice by M happens when it runs, not when torch.compile traces the model
    # (vLLM compiles one graph for every batch size). kbit::gemm_fp8 is the CUDA kernel where
    # the extension is loaded, the reference above elsewhere.
    if x.shape[0] <= GEMV_MAX_M:
        return torch.ops.kbit.gemm(x, packed, absmax, codebook, bits, n, k, bias)
    return torch.ops.kbit.gemm_fp8(x, packed, absmax, codebook, bits, n, k, w_exp, bias)


@_linear_fp8.register_fake
def _linear_fp8_fake(x, packed, absmax, codebook, bits, n, k, w_exp, bias=None):
    return x.new_empty((x.shape[0], n))


def gemm(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, bits: int,
         n: int, k: int, w_exp: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A kbit layer with FP8 activations, x[..., k] -> y[..., n]: the 16-bit GEMV for M <= 16
    rows (GEMV_MAX_M), the FP8 function above it (the CUDA kernel where built, else the
    reference)."""
    return ops.over_tokens(torch.ops.kbit.linear_fp8, x, n, k, packed, absmax, codebook, bits, n, k, w_exp, bias,
                           name="gemm_fp8")
