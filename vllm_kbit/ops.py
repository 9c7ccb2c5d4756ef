"""The kbit custom ops (`torch.ops.kbit.*`): schemas, fake (meta) kernels, and the reference path.

Schemas live here so they exist with or without the CUDA extension. `vllm_kbit._C` registers
CUDA kernels for them; where it is not built (CPU machines) the PyTorch reference below serves
every device, on the checkpoint layout (repack is then the identity). On a CUDA device a kbit
layer refuses to run without the kernels (require_kernels) unless VLLM_KBIT_REFERENCE=1 asks
for the reference on purpose (to compare against it); that variable also skips loading them.
The layout `repack` returns is whatever the kernels of that device read: callers treat it
as opaque and hand it back to `gemm` unchanged.

  kbit::repack(qweight, absmax, bits) -> (packed, absmax_packed)      once, at load time
  kbit::gemm(x[M,K], packed, absmax_packed, codebook, bits, n, k, bias?) -> y[M,n]
  kbit::quantize(w[N,K], codebook, bits) -> (qweight, absmax)          checkpoint layout
  kbit::moe_gemm(x, packed[E], absmax[E], codebook, bits, n, k, sorted_token_ids, expert_ids,
                 num_tokens_post_padded, block_m, top_k, topk_weights?) -> y[T*top_k, n]
  kbit::moe_gemm_grouped(x, packed[E], absmax[E], codebook, bits, n, k, sorted_token_ids, expert_ids,
                         num_tokens_post_padded, block_m, top_k, topk_weights?, activation=0,
                         zero_uncovered=True, overrides="") -> y[T*top_k, n or n/2]
      the grouped tensor-core form (Hopper; block_m 64, 128 or 256), the activation
      (MOE_ACTIVATIONS) fused; rows no block covers zeroed only where zero_uncovered;
      overrides: "moe.one_per_sm=0|1" forces the 64-token build (the reference ignores them)
  kbit::dequantize_experts(packed[E], absmax[E], codebook, bits, n, k, dtype) -> W[E, n, k]
  kbit::gemm_fp8(x, packed, absmax, codebook, bits, n, k, w_exp, bias?) -> y[M, n]
      FP8 (e4m3) activations, per-token scales; w_exp: fp8.weight_exponent of the layer
      (the plan's path: the fused kernel, the weights decoded to e4m3 once + an FP8 GEMM, or the
      16-bit kbit::gemm where that is faster; Fp8Plan.path)
  kbit::gemm_fp8_path(x, ..., w_exp, bias?, overrides="") -> y   gemm_fp8 with plan overrides
                           ("fp8.path=0|1|2": fused kernel, decode-first, 16-bit; Fp8Path)
  kbit::decode_fp8(packed, absmax, codebook, bits, n, k, w_exp) -> w_q e4m3 [n, k] (fp8.decode_weight)
  kbit::quantize_act_fp8(x, bits) -> (x_q e4m3 [M, K] in the kernel's k order for bits, natural
                           order for bits = 0, s_x fp32 [M])
  kbit::gemm_fp8_quantized(x_q, s_x, packed, absmax, codebook, bits, n, k, w_exp, dtype, bias?,
                           overrides="") -> y   (plan overrides: "fp8.tile_m=256" forces the
                           kernel's CTA tile, csrc/dispatch/overrides.h; the reference ignores them)
The two MoE ops serve vLLM's MoE layer (vllm_kbit/moe.py): experts repacked one by one and
stacked (moe.repack_experts), pairs (token, expert) grouped in blocks of block_m as vLLM's
moe_align_block_size lays them out. Their codebook is float32 [2^bits], one for all experts,
or [E, 2^bits], expert e decoding with row e (convert --fit-codebook fits one per expert).
"""
from __future__ import annotations

import collections
import enum
import importlib
import logging
import os

import torch

from vllm_kbit import format as kf

_lib = torch.library.Library("kbit", "DEF")
_lib.define("repack(Tensor qweight, Tensor absmax, int bits) -> (Tensor, Tensor)")
_lib.define("gemm(Tensor x, Tensor packed, Tensor absmax, Tensor codebook, int bits, "
            "SymInt n, SymInt k, Tensor? bias=None) -> Tensor")
_lib.define("quantize(Tensor weight, Tensor codebook, int bits) -> (Tensor, Tensor)")
_lib.define("moe_gemm(Tensor x, Tensor packed, Tensor absmax, Tensor codebook, int bits, SymInt n, "
            "SymInt k, Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded, "
            "int block_m, int top_k, Tensor? topk_weights=None) -> Tensor")
_lib.define("moe_gemm_grouped(Tensor x, Tensor packed, Tensor absmax, Tensor codebook, int bits, SymInt n, "
            "SymInt k, Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded, "
            "int block_m, int top_k, Tensor? topk_weights=None, int activation=0, bool zero_uncovered=True, "
            "str overrides=\"\") -> Tensor")
_lib.define("dequantize_experts(Tensor packed, Tensor absmax, Tensor codebook, int bits, SymInt n, "
            "SymInt k, ScalarType dtype) -> Tensor")
_lib.define("gemm_fp8(Tensor x, Tensor packed, Tensor absmax, Tensor codebook, int bits, SymInt n, SymInt k, "
            "int w_exp, Tensor? bias=None) -> Tensor")
_lib.define("gemm_fp8_path(Tensor x, Tensor packed, Tensor absmax, Tensor codebook, int bits, SymInt n, "
            "SymInt k, int w_exp, Tensor? bias=None, str overrides=\"\") -> Tensor")
_lib.define("decode_fp8(Tensor packed, Tensor absmax, Tensor codebook, int bits, SymInt n, SymInt k, "
            "int w_exp) -> Tensor")
_lib.define("quantize_act_fp8(Tensor x, int bits) -> (Tensor, Tensor)")
_lib.define("gemm_fp8_quantized(Tensor x_q, Tensor x_scale, Tensor packed, Tensor absmax, Tensor codebook, "
            "int bits, SymInt n, SymInt k, int w_exp, ScalarType dtype, Tensor? bias=None, str overrides=\"\") "
            "-> Tensor")

# VLLM_KBIT_REFERENCE=1: run the reference on every device, on purpose (to compare against it).
REFERENCE_REQUESTED = os.environ.get("VLLM_KBIT_REFERENCE", "0") == "1"
HAS_CUDA_KERNELS = False
# Why the CUDA kernels are not loaded (None when they are): "not built (...)", "built but fails
# to load (...)" or "not loaded (VLLM_KBIT_REFERENCE=1 ...)", the import error in the brackets.
# Importing vllm_kbit never fails for it (vLLM imports the plugin in every process, CPU machines
# run the reference); creating a kbit layer on a CUDA device does, in require_kernels.
KERNELS_ERROR: str | None = None


def _load_extension() -> str | None:
    """Import vllm_kbit._C (it registers the CUDA kernels for the schemas above); the reason
    it is unusable, or None."""
    try:
        importlib.import_module("vllm_kbit._C")
    except ModuleNotFoundError as e:
        if e.name == "vllm_kbit._C":
            return f"not built ({type(e).__name__}: {e})"
        return f"built but fails to load ({type(e).__name__}: {e})"  # a module the extension needs
    except (ImportError, OSError) as e:  # e.g. undefined symbol: built against another torch
        return f"built but fails to load ({type(e).__name__}: {e})"
    return None


if REFERENCE_REQUESTED:
    KERNELS_ERROR = "not loaded (VLLM_KBIT_REFERENCE=1 asks for the PyTorch reference)"
else:
    KERNELS_ERROR = _load_extension()
    HAS_CUDA_KERNELS = KERNELS_ERROR is None
    if not HAS_CUDA_KERNELS and torch.cuda.is_available():
        logging.getLogger(__name__).warning(
            "vllm_kbit: CUDA is available but the kbit CUDA extension vllm_kbit._C is %s; creating a "
            "kbit layer will fail (python3 -m vllm_kbit.check explains; VLLM_KBIT_REFERENCE=1 runs the "
            "slow PyTorch reference on purpose)", KERNELS_ERROR)


class KernelsUnavailableError(RuntimeError):
    """A kbit layer on a CUDA device without the CUDA kernels (and without VLLM_KBIT_REFERENCE=1)."""


def build_command() -> str:
    """The command that builds the extension for this machine's GPU, from the source folder."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    where = root if os.path.isfile(os.path.join(root, "setup.py")) else "<the vllm_kbit source folder>"
    arch = "9.0a"  # the default list (8.0;8.6;8.9;9.0a) builds for every supported GPU, slower
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch = "9.0a" if (major, minor) == (9, 0) else f"{major}.{minor}"
    return f"cd {where} && TORCH_CUDA_ARCH_LIST={arch} pip install --no-build-isolation -e ."


def kernels_in_use() -> str:
    """What this process's kbit layers run, for the logs (benchmarks/e2e.py reads it)."""
    if HAS_CUDA_KERNELS:
        return "the CUDA kernels (vllm_kbit._C)"
    if REFERENCE_REQUESTED:
        return "the PyTorch reference (VLLM_KBIT_REFERENCE=1)"
    return f"the PyTorch reference (vllm_kbit._C is {KERNELS_ERROR})"


def require_kernels(prefix: str) -> None:
    """Call where a kbit layer is created: on a CUDA device without the CUDA kernels it raises
    KernelsUnavailableError naming the layer, what is missing and the build command, unless
    VLLM_KBIT_REFERENCE=1. The reference would serve it, but far slower, and its float
    dequantization takes GPU memory that vLLM's profile then withholds from the KV cache."""
    if HAS_CUDA_KERNELS or REFERENCE_REQUESTED or not torch.cuda.is_available():
        return
    raise KernelsUnavailableError(
        f"kbit layer {prefix}: CUDA is available but the kbit CUDA kernels are not: the extension "
        f"vllm_kbit._C is {KERNELS_ERROR}. Build it with `{build_command()}` (TORCH_CUDA_ARCH_LIST: your "
        f"GPU's compute capability, 9.0a on Hopper for its wgmma kernel; unset, it builds "
        f"8.0;8.6;8.9;9.0a), then check with `python3 -m vllm_kbit.check`. To run the slow PyTorch "
        f"reference on purpose, set VLLM_KBIT_REFERENCE=1.")


# ----------------------------------------------------------------------------- reference path

def _repack_ref(qweight, absmax, bits):
    return qweight.clone(), absmax.clone()


def _gemm_ref(x, packed, absmax, codebook, bits, n, k, bias=None):
    # Dequantize in float32, matmul in the activation dtype (what a bf16/fp16 layer does).
    w = kf.dequantize(packed, absmax, bits, codebook.float(), dtype=x.dtype)
    y = x @ w.t()
    return y + bias if bias is not None else y


def _quantize_ref(weight, codebook, bits):
    # like the CUDA kernel, the op leaves input checks to its caller (ops.quantize)
    return kf.quantize_checked(weight, bits, codebook)


def _check_expert_layout(packed, absmax, bits, n, k, op):
    """The reference reads the checkpoint layout, stacked: packed [E, n, k/32*bits], absmax [E, n, k/32]."""
    e = packed.shape[0]
    if packed.shape != (e, n, k // kf.BLOCK_SIZE * bits) or packed.dtype != torch.int32:
        raise ValueError(f"kbit::{op}: packed is {packed.dtype} {tuple(packed.shape)}; the reference path "
                         f"expects int32 [E, {n}, {k // kf.BLOCK_SIZE * bits}] (n={n}, k={k}, bits={bits})")
    if absmax.shape != (e, n, k // kf.BLOCK_SIZE) or absmax.dtype != torch.uint8:
        raise ValueError(f"kbit::{op}: absmax is {absmax.dtype} {tuple(absmax.shape)}; the reference path "
                         f"expects uint8 [{e}, {n}, {k // kf.BLOCK_SIZE}] (n={n}, k={k})")


def _expert_codebooks(codebook, bits, num_experts, op, device, dtype):
    """[E, 2^bits] in `dtype` on `device`: row e is expert e's codebook (a shared [2^bits]
    one repeated)."""
    entries = 1 << bits
    if codebook.dim() == 1 and codebook.shape[0] == entries:
        return codebook.to(device, dtype).expand(num_experts, entries)
    if codebook.shape != (num_experts, entries):
        raise ValueError(f"kbit::{op}: codebook has shape {tuple(codebook.shape)}; bits={bits} needs [{entries}] "
                         f"(one for all experts) or [E = {num_experts}, {entries}] (one per expert)")
    return codebook.to(device, dtype)


def _work_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _moe_pairs_ref(x, packed, absmax, codebook, bits, n, k, sorted_token_ids, expert_ids,
                   num_tokens_post_padded, block_m, top_k, op):
    # Which expert each pair p = token * top_k + slot gets, from the blocks alone (as the kernel
    # reads them); pairs no valid block covers stay at -1 and give 0. Computed in float32
    # (float64 for float64 x), unrounded. Shape-only control flow: no host sync.
    _check_expert_layout(packed, absmax, bits, n, k, op)
    num_pairs = x.shape[0] * top_k
    work = _work_dtype(x.dtype)
    ids = sorted_token_ids.long()
    nblocks = expert_ids.shape[0]
    ids = torch.nn.functional.pad(ids, (0, nblocks * block_m - ids.shape[0]), value=num_pairs)[:nblocks * block_m]
    start = torch.arange(nblocks, device=x.device).repeat_interleave(block_m) * block_m
    expert = expert_ids.long().repeat_interleave(block_m)
    valid = (ids >= 0) & (ids < num_pairs) & (start < num_tokens_post_padded.long()) & (expert >= 0)
    pair_expert = torch.full((num_pairs + 1,), -1, dtype=torch.long, device=x.device)
    pair_expert.index_put_((torch.where(valid, ids, num_pairs),), torch.where(valid, expert, -1))
    pair_expert = pair_expert[:num_pairs]
    rows = x.to(work).repeat_interleave(top_k, dim=0)
    y = torch.zeros(num_pairs, n, dtype=work, device=x.device)
    cbs = _expert_codebooks(codebook, bits, packed.shape[0], op, x.device, work)
    for e in range(packed.shape[0]):
        w = kf.dequantize(packed[e], absmax[e], bits, cbs[e], dtype=work)
        y = torch.where((pair_expert == e).unsqueeze(1), rows @ w.t(), y)
    return y


def _moe_gemm_ref(x, packed, absmax, codebook, bits, n, k, sorted_token_ids, expert_ids,
                  num_tokens_post_padded, block_m, top_k, topk_weights=None):
    # rounded to x.dtype once, after the router weights
    y = _moe_pairs_ref(x, packed, absmax, codebook, bits, n, k, sorted_token_ids, expert_ids,
                       num_tokens_post_padded, block_m, top_k, "moe_gemm")
    if topk_weights is not None:
        y = y * topk_weights.reshape(-1, 1).to(y.dtype)
    return y.to(x.dtype)


# kbit::moe_gemm_grouped's `activation` codes (csrc/moe/grouped_config.h Activation): the
# activations vLLM's apply_moe_activation runs without clamp parameters, as
# vllm_kbit/moe_cpu.py ACTIVATIONS lists them. The gated ones ("_and_mul") read W rows [0, n/2)
# as the gate and [n/2, n) as the up projection and give n/2 columns act(gate) * up.
MOE_ACTIVATIONS = ("none", "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul", "silu", "gelu", "gelu_tanh",
                   "relu2")
# The activations themselves (the gated ones apply the first to the gate), in torch.
MOE_ACTIVATION_FNS = {
    "none": lambda t: t,
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    "relu2": lambda t: torch.nn.functional.relu(t).square(),
}


def moe_activation_gated(activation: int) -> bool:
    return MOE_ACTIVATIONS[activation].endswith("_and_mul")


def moe_activation_apply(activation: int, h: torch.Tensor) -> torch.Tensor:
    """MOE_ACTIVATIONS[activation] of h [P, n] -> [P, n / 2] (gated) or [P, n], in h's dtype."""
    name = MOE_ACTIVATIONS[activation]
    if name.endswith("_and_mul"):
        gate, up = h.chunk(2, dim=-1)
        return MOE_ACTIVATION_FNS[name[:-len("_and_mul")]](gate) * up
    return MOE_ACTIVATION_FNS[name](h)


def check_moe_activation(activation: int, n: int, op: str) -> None:
    """The ValueError kbit::moe_gemm_grouped's binding raises (as a RuntimeError) for a bad
    activation code, or a gated one whose gate and up halves are not whole 64-column units."""
    if not 0 <= activation < len(MOE_ACTIVATIONS):
        raise ValueError(f"kbit::{op}: activation must be 0..{len(MOE_ACTIVATIONS) - 1} (MOE_ACTIVATIONS), "
                         f"got {activation}")
    if moe_activation_gated(activation) and n % 128:
        raise ValueError(f"kbit::{op}: a gated activation needs n = 2 x the intermediate size, a multiple of "
                         f"128; got n = {n}")


def _moe_gemm_grouped_ref(x, packed, absmax, codebook, bits, n, k, sorted_token_ids, expert_ids,
                          num_tokens_post_padded, block_m, top_k, topk_weights=None, activation=0,
                          zero_uncovered=True, overrides=""):
    # the kernel's function: activation and router weight in float32, one rounding; uncovered
    # rows are 0 whatever zero_uncovered says (the kernel leaves them unspecified without it)
    check_moe_activation(activation, n, "moe_gemm_grouped")
    if block_m not in (64, 128, 256):
        raise ValueError(f"kbit::moe_gemm_grouped: block_m must be 64, 128 or 256 (the kernels' tokens per CTA), "
                         f"got {block_m}")
    y = _moe_pairs_ref(x, packed, absmax, codebook, bits, n, k, sorted_token_ids, expert_ids,
                       num_tokens_post_padded, block_m, top_k, "moe_gemm_grouped")
    y = moe_activation_apply(activation, y)
    if topk_weights is not None:
        y = y * topk_weights.reshape(-1, 1).to(y.dtype)
    return y.to(x.dtype)


def _dequantize_experts_ref(packed, absmax, codebook, bits, n, k, dtype):
    _check_expert_layout(packed, absmax, bits, n, k, "dequantize_experts")
    cbs = _expert_codebooks(codebook, bits, packed.shape[0], "dequantize_experts", packed.device, _work_dtype(dtype))
    out = torch.empty(packed.shape[0], n, k, dtype=dtype, device=packed.device)
    for e in range(packed.shape[0]):
        out[e] = kf.dequantize(packed[e], absmax[e], bits, cbs[e], dtype=dtype)
    return out


# The FP8 references are vllm_kbit.fp8's (imported when called: fp8 imports this module).
def _gemm_fp8_ref(x, packed, absmax, codebook, bits, n, k, w_exp, bias=None):
    from vllm_kbit import fp8
    return fp8.gemm_fp8_reference(x, packed, absmax, codebook, bits, n, k, w_exp, bias)


def _gemm_fp8_path_ref(x, packed, absmax, codebook, bits, n, k, w_exp, bias=None, overrides=""):
    from vllm_kbit import fp8
    return fp8.gemm_fp8_reference(x, packed, absmax, codebook, bits, n, k, w_exp, bias)


def _decode_fp8_ref(packed, absmax, codebook, bits, n, k, w_exp):
    from vllm_kbit import fp8
    return fp8.decode_weight(packed, absmax, codebook, bits, w_exp)


def _quantize_act_fp8_ref(x, bits):
    from vllm_kbit import fp8
    return fp8.quantize_act(x, bits)


def _gemm_fp8_quantized_ref(x_q, x_scale, packed, absmax, codebook, bits, n, k, w_exp, dtype, bias=None,
                            overrides=""):
    from vllm_kbit import fp8
    w_q = fp8.decode_weight(packed, absmax, codebook, bits, w_exp)
    return fp8.linear_quantized(fp8.unpermute(x_q, bits), x_scale.unsqueeze(1), w_q, w_exp, bias).to(dtype)


_REF_KEYS = ["CPU"] if HAS_CUDA_KERNELS else ["CPU", "CUDA"]
for _key in _REF_KEYS:
    _lib.impl("repack", _repack_ref, _key)
    _lib.impl("gemm", _gemm_ref, _key)
    _lib.impl("quantize", _quantize_ref, _key)
    _lib.impl("moe_gemm", _moe_gemm_ref, _key)
    _lib.impl("moe_gemm_grouped", _moe_gemm_grouped_ref, _key)
    _lib.impl("dequantize_experts", _dequantize_experts_ref, _key)
    _lib.impl("gemm_fp8", _gemm_fp8_ref, _key)
    _lib.impl("gemm_fp8_path", _gemm_fp8_path_ref, _key)
    _lib.impl("decode_fp8", _decode_fp8_ref, _key)
    _lib.impl("quantize_act_fp8", _quantize_act_fp8_ref, _key)
    _lib.impl("gemm_fp8_quantized", _gemm_fp8_quantized_ref, _key)


# ----------------------------------------------------------------------------- fake kernels

@torch.library.register_fake("kbit::gemm")
def _gemm_fake(x, packed, absmax, codebook, bits, n, k, bias=None):
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake("kbit::moe_gemm")
def _moe_gemm_fake(x, packed, absmax, codebook, bits, n, k, sorted_token_ids, expert_ids,
                   num_tokens_post_padded, block_m, top_k, topk_weights=None):
    return x.new_empty((x.shape[0] * top_k, n))


@torch.library.register_fake("kbit::moe_gemm_grouped")
def _moe_gemm_grouped_fake(x, packed, absmax, codebook, bits, n, k, sorted_token_ids, expert_ids,
                           num_tokens_post_padded, block_m, top_k, topk_weights=None, activation=0,
                           zero_uncovered=True, overrides=""):
    check_moe_activation(activation, n, "moe_gemm_grouped")
    return x.new_empty((x.shape[0] * top_k, n // 2 if moe_activation_gated(activation) else n))


@torch.library.register_fake("kbit::dequantize_experts")
def _dequantize_experts_fake(packed, absmax, codebook, bits, n, k, dtype):
    return packed.new_empty((packed.shape[0], n, k), dtype=dtype)


@torch.library.register_fake("kbit::gemm_fp8")
def _gemm_fp8_fake(x, packed, absmax, codebook, bits, n, k, w_exp, bias=None):
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake("kbit::gemm_fp8_path")
def _gemm_fp8_path_fake(x, packed, absmax, codebook, bits, n, k, w_exp, bias=None, overrides=""):
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake("kbit::decode_fp8")
def _decode_fp8_fake(packed, absmax, codebook, bits, n, k, w_exp):
    return packed.new_empty((n, k), dtype=torch.float8_e4m3fn)


@torch.library.register_fake("kbit::quantize_act_fp8")
def _quantize_act_fp8_fake(x, bits):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty((x.shape[0],), dtype=torch.float32)


@torch.library.register_fake("kbit::gemm_fp8_quantized")
def _gemm_fp8_quantized_fake(x_q, x_scale, packed, absmax, codebook, bits, n, k, w_exp, dtype, bias=None,
                             overrides=""):
    return x_q.new_empty((x_q.shape[0], n), dtype=dtype)


@torch.library.register_fake("kbit::repack")
def _repack_fake(qweight, absmax, bits):
    raise RuntimeError("kbit::repack runs eagerly at load time; it has no meta shape rule")


@torch.library.register_fake("kbit::quantize")
def _quantize_fake(weight, codebook, bits):
    n, k = weight.shape
    return (weight.new_empty((n, k // 32 * bits), dtype=torch.int32),
            weight.new_empty((n, k // 32), dtype=torch.uint8))


# ----------------------------------------------------------------------------- wrappers

def repack(qweight: torch.Tensor, absmax: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' layout of one weight. The repack kernel reads 16-byte vectors, so a view that
    starts off a 16-byte boundary (one expert of a stacked [E, n, k/32] absmax) is copied first."""
    qweight, absmax = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (qweight, absmax))
    return torch.ops.kbit.repack(qweight, absmax, bits)


def check_features(x: torch.Tensor, k: int, op: str) -> None:
    """A ValueError naming `op` where x's last dim is not the layer's k."""
    if x.shape[-1] != k:
        raise ValueError(f"kbit {op}: x has {x.shape[-1]} features in its last dim, the layer expects k = {k}")


def over_tokens(op, x: torch.Tensor, n: int, k: int, *args, name: str) -> torch.Tensor:
    """op(x as a contiguous [M, k], *args) -> [M, n], returned as [..., n] for x [..., k]: the ops
    take 2-D activations."""
    check_features(x, k, name)
    return op(x.reshape(-1, k).contiguous(), *args).reshape(*x.shape[:-1], n)


def gemm(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
         bits: int, n: int, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [..., k]; the GEMV / tensor-core choice is made inside."""
    return over_tokens(torch.ops.kbit.gemm, x, n, k, packed, absmax, codebook, bits, n, k, bias, name="gemm")


def gemm_fp8(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
             bits: int, n: int, k: int, w_exp: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) with x quantized per token to e4m3 (vllm_kbit.fp8 describes the function);
    w_exp: fp8.weight_exponent of the layer's absmax, computed once at load time."""
    return over_tokens(torch.ops.kbit.gemm_fp8, x, n, k, packed, absmax, codebook, bits, n, k, w_exp, bias,
                       name="gemm_fp8")


def quantize(weight: torch.Tensor, bits: int, codebook: torch.Tensor | None = None,
             name: str = "weight") -> tuple[torch.Tensor, torch.Tensor, int]:
    """W[N, K] -> (qweight, absmax, underflow_blocks) in the checkpoint layout, with `codebook`
    (default: format.default_codebook, nf0, as every entry point that quantizes) on the weight's
    device (the CUDA kernel where built, else the reference). Bad input raises
    KbitFormatError naming `name` (see format.check_quantizable)."""
    cb = kf.default_codebook(bits) if codebook is None else kf.check_codebook(codebook, bits)
    underflow = kf.check_quantizable(weight, name)
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        weight = weight.float()  # e.g. float64: the kernels take 16/32-bit floats
    q, a = torch.ops.kbit.quantize(weight.contiguous(), cb.to(weight.device), bits)
    return q, a, underflow


# ----------------------------------------------------------------------------- tests and benchmarks
# The CUDA extension's C++-only ops (csrc/binding.cpp) force a path and report plans; these helpers
# give their `overrides` string and their plan lists names.

def plan_overrides(overrides: dict | str | None = None) -> str:
    """{"wgmma.tile_m": 256, "gemv.wide_table": False} -> "wgmma.tile_m=256,gemv.wide_table=0", the
    `overrides` argument of kbit::gemm_path and the plan ops (keys: csrc/dispatch/overrides.h).
    A string passes through."""
    if not overrides:
        return ""
    if isinstance(overrides, str):
        return overrides
    return ",".join(f"{key}={int(value)}" for key, value in overrides.items())


class Path(enum.IntEnum):
    """kbit::gemm_path's path ids (csrc/dispatch/path_rule.h, Path): AUTO is kbit::gemm's rule."""
    AUTO = 0
    GEMV = 1
    MMA = 2
    DEQUANT = 3
    WGMMA = 4


# field names of the plan ops' lists, in order (csrc/dispatch/plan_fields.h): the kernel's key,
# then its launch. GemvPlan's clusters1..8 are gathered into one tuple field, `clusters`.
GEMV_PLAN_FIELDS = ("bits", "dtype", "mt", "warps", "wide", "x_smem", "slabs", "splits", "chunk", "pdl",
                    "pdl_trigger", "clusters")
MMA_PLAN_FIELDS = ("bits", "dtype", "config", "tile_m", "tile_n", "splits", "k_tiles_per_split", "items", "grid",
                   "workspace_bytes")
WGMMA_PLAN_FIELDS = ("bits", "dtype", "tile_m", "columns", "row_split", "built_per_sm", "split_tall", "splits",
                     "groups", "grid_x", "token_tiles", "column_groups", "launch_per_sm", "chunk", "spread", "y_tma",
                     "pdl")
FP8_PLAN_FIELDS = ("bits", "dtype", "tile_m", "tile_n", "token_tiles", "column_groups", "path")
_DTYPE_CODES = {0: "f16", 1: "bf16", 2: "f32"}  # the plan ops' dtype field (plan_fields.h, dtype_code)


class GemvPlan(collections.namedtuple("GemvPlan", GEMV_PLAN_FIELDS)):
    __slots__ = ()

    @property
    def kernel(self) -> str:
        """The kernel's key as csrc/core/kernel_keys.h's describe() writes it."""
        return (f"gemv<K{self.bits},{_DTYPE_CODES[self.dtype]},mt{self.mt},w{self.warps},"
                f"{'wide' if self.wide else 'packed'},{'xsmem' if self.x_smem else 'xreg'},g{self.slabs}>")


class MmaPlan(collections.namedtuple("MmaPlan", MMA_PLAN_FIELDS)):
    __slots__ = ()

    @property
    def kernel(self) -> str:
        return f"mma<K{self.bits},{_DTYPE_CODES[self.dtype]},cfg{self.config}>"


class WgmmaPlan(collections.namedtuple("WgmmaPlan", WGMMA_PLAN_FIELDS)):
    __slots__ = ()

    @property
    def kernel(self) -> str:
        return (f"wgmma<K{self.bits},{_DTYPE_CODES[self.dtype]},mt{self.tile_m},cn{self.columns},r{self.row_split},"
                f"cps{self.built_per_sm}{',split_tall' if self.split_tall else ''}>")


class Fp8Path(enum.IntEnum):
    """kbit::gemm_fp8's paths (csrc/dispatch/fp8_plan.h, fp8::Path; the override fp8.path)."""
    FUSED = 0         # the FP8 kernel, weights decoded in registers
    DECODE_FIRST = 1  # kbit::decode_fp8 + natural-order x + an FP8 scaled_mm
    SIXTEEN_BIT = 2   # kbit::gemm with 16-bit activations


class Fp8Plan(collections.namedtuple("Fp8Plan", FP8_PLAN_FIELDS)):
    __slots__ = ()

    @property
    def kernel(self) -> str:
        if self.path == Fp8Path.DECODE_FIRST:
            return f"decode_fp8<K{self.bits}>+scaled_mm<{_DTYPE_CODES[self.dtype]}>"
        if self.path == Fp8Path.SIXTEEN_BIT:
            return f"gemm<K{self.bits},{_DTYPE_CODES[self.dtype]}>"
        return f"fp8<K{self.bits},{_DTYPE_CODES[self.dtype]},mt{self.tile_m},cn{self.tile_n}>"


def gemv_plan_from_list(values) -> GemvPlan:
    """A GemvPlan from kbit::gemv_plan's list (its eight cluster counts gathered into `clusters`)."""
    values = [int(v) for v in values]
    n = len(GEMV_PLAN_FIELDS) - 1
    return GemvPlan(*values[:n], tuple(values[n:]))


def gemv_plan(m, n, k, bits, splits=0, overrides=None, dtype=torch.float16) -> GemvPlan:
    """The GEMV's launch plan on the current device, naming its kernel; `clusters`: how many
    clusters of 1..8 one-per-SM CTAs the device runs at once."""
    return gemv_plan_from_list(torch.ops.kbit.gemv_plan(m, n, k, bits, splits, plan_overrides(overrides), dtype))


def mma_plan(m, n, k, bits, overrides=None, dtype=torch.float16) -> MmaPlan:
    return MmaPlan(*torch.ops.kbit.mma_plan(m, n, k, bits, plan_overrides(overrides), dtype))


def wgmma_plan(m, n, k, bits, dtype=torch.float16, splits=0, overrides=None) -> WgmmaPlan:
    return WgmmaPlan(*torch.ops.kbit.wgmma_plan(m, n, k, bits, dtype, splits, plan_overrides(overrides)))


def fp8_plan(m, n, k, bits, dtype=torch.float16, overrides=None) -> Fp8Plan:
    """kbit::gemm_fp8's plan on the current device: the fused kernel's key and grid, and `path`
    (Fp8Path: what gemm_fp8 runs), as kbit::gemm_fp8_path(..., overrides) follows it
    (kbit::gemm_fp8's without overrides; kbit::gemm_fp8_quantized always runs the fused kernel)."""
    return Fp8Plan(*torch.ops.kbit.fp8_plan(m, n, k, bits, dtype, plan_overrides(overrides)))


def has_fp8() -> bool:
    """Whether this build and the current GPU run the FP8-activation GEMM (kbit::has_fp8; False
    without it: a CPU machine, or a build from before the op)."""
    return HAS_CUDA_KERNELS and hasattr(torch.ops.kbit, "has_fp8") and torch.ops.kbit.has_fp8()


def gemm_kernel(m, n, k, bits, dtype=torch.float16, path=Path.AUTO, splits=0, overrides=None) -> str:
    """The kernel kbit::gemm_path(..., path, splits, overrides) runs for this shape on the current
    device (kbit::gemm's with the defaults), as csrc/core/kernel_keys.h describes its key; the
    dequantize path's is "dequantize<...> + cublas"."""
    return torch.ops.kbit.gemm_kernel(m, n, k, bits, dtype, int(path), splits, plan_overrides(overrides))


def moe_kernel(bits, dtype=torch.float16) -> str:
    """The MoE expert GEMV kernel kbit::moe_gemm runs."""
    return torch.ops.kbit.moe_kernel(bits, dtype)


_MOE_GROUPED = {}  # device index -> has_moe_grouped()


def has_moe_grouped() -> bool:
    """Whether this build and the current GPU run kbit::moe_gemm_grouped's kernel (sm_90a code on
    a compute capability 9.0 GPU; False without the extension). Asked once per device."""
    if not (HAS_CUDA_KERNELS and torch.cuda.is_available() and hasattr(torch.ops.kbit, "has_moe_grouped")):
        return False
    dev = torch.cuda.current_device()
    if dev not in _MOE_GROUPED:
        _MOE_GROUPED[dev] = bool(torch.ops.kbit.has_moe_grouped())
    return _MOE_GROUPED[dev]


def moe_grouped_kernel(bits, dtype, block_m, num_sorted, n, activation=0, overrides=None) -> str:
    """The grouped MoE kernel kbit::moe_gemm_grouped runs for these shapes (num_sorted: the length
    of the sorted ids) on the current device."""
    return torch.ops.kbit.moe_grouped_kernel(bits, dtype, block_m, num_sorted, n, activation,
                                             plan_overrides(overrides))


def heuristics_table() -> str:
    """The name of the tuned table (csrc/dispatch/heuristics.h) the current device plans with."""
    return torch.ops.kbit.heuristics()
