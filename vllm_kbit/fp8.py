"""FP8 activations for kbit layers: the function the FP8 path computes, in one place.

For x[M, K] (fp16 / bf16) and a kbit weight W[N, K] (codes, E4M4 block absmax, codebook cb):
  1. per-token dynamic activation scale, as vLLM's per-token `scaled_fp8_quant`:
     s_x[m] = max(max_k |x[m, k]| / 448, MIN_SCALE) in fp32, x_q = e4m3(x / s_x) (fp32 division,
     round to nearest even, saturating at +-448);
  2. a per-tensor power-of-two weight exponent, chosen at load time from the absmax codes:
     r = the largest integer with max_block_absmax * 2^r <= 448 (|cb| <= 1, so every decoded
     weight times 2^r fits e4m3);
  3. the decoded weight rounded as the kernels' fp16 decode rounds it: the codebook as its fp16
     pair table holds it, times the block scale and 2^r, rounded once to fp16, then to e4m3:
     w_q = e4m3(fp16(fp16(cb[idx]) * absmax * 2^r));
  4. y = (sum_k x_q * w_q) * s_x * 2^-r, accumulated in fp32 (the reference: float64), + bias,
     cast to x's dtype.

`gemm_fp8_reference` evaluates 1-4 with torch.float8_e4m3fn casts for the e4m3 rounding and a
float64 sum; `gemm` runs the CUDA op where the extension has it, the reference elsewhere.
"""
from __future__ import annotations

import math

import torch

from vllm_kbit import format as kf
from vllm_kbit import ops

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# vLLM's floor for a dynamic FP8 scale (an all-zero token gets this scale, not 0)
MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)
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


def weight_exponent(absmax: torch.Tensor) -> int:
    """r for a layer's E4M4 absmax codes (uint8, any layout: only their maximum counts): the
    largest integer with max_absmax * 2^r <= 448. A layer of zero blocks gets 0."""
    if absmax.dtype != torch.uint8:
        raise ValueError(f"kbit fp8: absmax must be the uint8 E4M4 codes, got {absmax.dtype}")
    if absmax.numel() == 0 or int(absmax.max()) == 0:
        return 0
    top = float(kf.e4m4_table()[int(absmax.max())])  # the table is increasing in the code
    mantissa, exponent = math.frexp(E4M3_MAX / top)  # E4M3_MAX / top = mantissa * 2^exponent, 0.5 <= mantissa < 1
    r = exponent - 1
    while math.ldexp(top, r + 1) <= E4M3_MAX:  # guards the division's rounding at an exact power of two
        r += 1
    while math.ldexp(top, r) > E4M3_MAX:
        r -= 1
    return r


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest even e4m3, saturating at +-448 (e4m3fn has no infinity)."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x[..., K] -> (x_q e4m3 [..., K], s_x float32 [..., 1]): step 1."""
    x32 = x.float()
    scale = (x32.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(MIN_SCALE)
    return to_e4m3(x32 / scale), scale


def decode_weight(packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, bits: int,
                  w_exp: int) -> torch.Tensor:
    """The e4m3 weight W_q[N, K] = W * 2^w_exp as the FP8 path rounds it (step 3), from the
    checkpoint layout (where the kernels are not loaded, `repack` leaves it as is)."""
    cb16 = codebook.to(packed.device, torch.float16).double()
    # fp16 codebook x E4M4 scale x 2^r: at most 11 + 5 significant bits, exact in float64
    w = kf.dequantize(packed, absmax, bits, cb16, dtype=torch.float64)
    return to_e4m3((w * 2.0 ** w_exp).to(torch.float16))


def linear(x: torch.Tensor, w_q: torch.Tensor, w_exp: int, bias: torch.Tensor | None = None,
           work: torch.dtype = torch.float64) -> torch.Tensor:
    """Steps 1 and 4 for a decoded e4m3 weight w_q[N, K]: y[..., N] in x's dtype. `work` is the
    accumulation dtype (float64 for the reference; float32 is the kernels' and is faster)."""
    x_q, s_x = quantize_activations(x)
    acc = x_q.to(work) @ w_q.to(work).t()
    y = acc * s_x.to(work) * math.ldexp(1.0, -w_exp)
    if bias is not None:
        y = y + bias.to(work)
    return y.float().to(x.dtype)


def gemm_fp8_reference(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
                       bits: int, n: int, k: int, w_exp: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8-activation layer function (steps 1-4) in float64, for x[..., k] -> y[..., n]."""
    if x.shape[-1] != k:
        raise ValueError(f"kbit gemm_fp8: x has {x.shape[-1]} features in its last dim, the layer expects k = {k}")
    w_q = decode_weight(packed, absmax, codebook, bits, w_exp)
    if w_q.shape != (n, k):
        raise ValueError(f"kbit gemm_fp8: the weight decodes to {tuple(w_q.shape)}, the layer expects ({n}, {k})")
    return linear(x, w_q, w_exp, bias)


def kernel_available() -> bool:
    """Whether this process has the CUDA FP8 kernel: `ops.gemm_fp8` in a build with the Hopper
    (sm_90a) kernels, on a Hopper GPU."""
    return ops.HAS_CUDA_KERNELS and hasattr(ops, "gemm_fp8") and bool(torch.ops.kbit.has_wgmma())


def unavailable_reason() -> str | None:
    """Why kbit layers of this process cannot run FP8 activations, or None. The reference serves
    where the CUDA kernels are not loaded (it reads the checkpoint layout, which `repack` keeps
    there); where they are, only the FP8 kernel reads their layout."""
    if not ops.HAS_CUDA_KERNELS or kernel_available():
        return None
    if not hasattr(ops, "gemm_fp8"):
        return "this vllm_kbit has no FP8 kernel"
    return "the FP8 kernel needs a Hopper GPU (compute capability 9.0) and a build with TORCH_CUDA_ARCH_LIST 9.0a"


@torch.library.custom_op("kbit::linear_fp8", mutates_args=())
def _linear_fp8(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, bits: int,
                n: int, k: int, w_exp: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    # One op, so the choice by M happens when it runs, not when torch.compile traces the model
    # (vLLM compiles one graph for every batch size).
    if x.shape[0] <= GEMV_MAX_M:
        return torch.ops.kbit.gemm(x, packed, absmax, codebook, bits, n, k, bias)
    if x.is_cuda and kernel_available():
            return ops.gemm_fp8(x, packed, absmax, codebook, bits, n, k, w_exp, bias)
    return gemm_fp8_reference(x, packed, absmax, codebook, bits, n, k, w_exp, bias)


@_linear_fp8.register_fake
def _linear_fp8_fake(x, packed, absmax, codebook, bits, n, k, w_exp, bias=None):
    return x.new_empty((x.shape[0], n))


def gemm(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, bits: int,
         n: int, k: int, w_exp: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A kbit layer with FP8 activations, x[..., k] -> y[..., n]: the 16-bit GEMV for M <= 16
    rows (GEMV_MAX_M), the FP8 function above it (the CUDA kernel where built, else the
    reference)."""
    if x.shape[-1] != k:
        raise ValueError(f"kbit gemm_fp8: x has {x.shape[-1]} features in its last dim, the layer expects k = {k}")
    y = torch.ops.kbit.linear_fp8(x.reshape(-1, k).contiguous(), packed, absmax, codebook, bits, n, k, w_exp, bias)
    return y.reshape(*x.shape[:-1], n)
