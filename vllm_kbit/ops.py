"""The kbit custom ops (`torch.ops.kbit.*`): schemas, fake (meta) kernels, and the reference path.

Schemas live here so they exist with or without the CUDA extension. `vllm_kbit._C` registers
CUDA kernels for them; where it is not built (CPU machines, or a GPU without the extension)
the PyTorch reference below serves every device, on the checkpoint layout (repack is then
the identity). VLLM_KBIT_REFERENCE=1 forces the reference path (to compare against it).
The layout `repack` returns is whatever the kernels of that device read: callers treat it
as opaque and hand it back to `gemm` unchanged.

  kbit::repack(qweight, absmax, bits) -> (packed, absmax_packed)      once, at load time
  kbit::gemm(x[M,K], packed, absmax_packed, codebook, bits, n, k, bias?) -> y[M,n]
  kbit::quantize(w[N,K], codebook, bits) -> (qweight, absmax)          checkpoint layout
"""
from __future__ import annotations

import collections
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

HAS_CUDA_KERNELS = False
if os.environ.get("VLLM_KBIT_REFERENCE", "0") != "1":
    try:  # registers the CUDA kernels for the schemas above
        importlib.import_module("vllm_kbit._C")
        HAS_CUDA_KERNELS = True
    except ModuleNotFoundError as e:  # not built (CPU install): the reference serves
        if e.name != "vllm_kbit._C":
            raise
    if not HAS_CUDA_KERNELS and torch.cuda.is_available():
        logging.getLogger(__name__).warning(
            "vllm_kbit: CUDA is available but the extension vllm_kbit._C is not built; kbit layers "
            "run the slow PyTorch reference (pip install --no-build-isolation -e . builds it)")


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


_REF_KEYS = ["CPU"] if HAS_CUDA_KERNELS else ["CPU", "CUDA"]
for _key in _REF_KEYS:
    _lib.impl("repack", _repack_ref, _key)
    _lib.impl("gemm", _gemm_ref, _key)
    _lib.impl("quantize", _quantize_ref, _key)


# ----------------------------------------------------------------------------- fake kernels

@torch.library.register_fake("kbit::gemm")
def _gemm_fake(x, packed, absmax, codebook, bits, n, k, bias=None):
    return x.new_empty((x.shape[0], n))


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
    return torch.ops.kbit.repack(qweight, absmax, bits)


def gemm(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
         bits: int, n: int, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [..., k]; the GEMV / tensor-core choice is made inside."""
    if x.shape[-1] != k:
        raise ValueError(f"kbit gemm: x has {x.shape[-1]} features in its last dim, the layer expects k = {k}")
    y = torch.ops.kbit.gemm(x.reshape(-1, k).contiguous(), packed, absmax, codebook, bits, n, k, bias)
    return y.reshape(*x.shape[:-1], n)


def quantize(weight: torch.Tensor, bits: int, codebook: torch.Tensor | None = None,
             name: str = "weight") -> tuple[torch.Tensor, torch.Tensor, int]:
    """W[N, K] -> (qweight, absmax, underflow_blocks) in the checkpoint layout, on the weight's
    device (the CUDA kernel where built, else the reference). Bad input raises
    KbitFormatError naming `name` (see format.check_quantizable)."""
    cb = kf.normal_float_codebook(bits) if codebook is None else kf.check_codebook(codebook, bits)
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


# field names of the plan ops' lists, in order (csrc/binding.cpp documents them)
GEMV_PLAN_FIELDS = ("splits", "warps", "slabs", "clusters")
MMA_PLAN_FIELDS = ("config", "tile_m", "tile_n", "splits", "k_tiles_per_split", "items", "grid", "workspace_bytes")
WGMMA_PLAN_FIELDS = ("tile_m", "splits", "grid_x", "token_tiles", "column_groups", "columns", "launch_per_sm",
                     "row_split", "built_per_sm", "groups")

GemvPlan = collections.namedtuple("GemvPlan", GEMV_PLAN_FIELDS)
MmaPlan = collections.namedtuple("MmaPlan", MMA_PLAN_FIELDS)
WgmmaPlan = collections.namedtuple("WgmmaPlan", WGMMA_PLAN_FIELDS)


def gemv_plan(m, n, k, bits, splits=0, overrides=None) -> GemvPlan:
    """The GEMV's launch plan on the current device; `clusters`: how many clusters of 1..8
    one-per-SM CTAs it runs at once."""
    p = list(torch.ops.kbit.gemv_plan(m, n, k, bits, splits, plan_overrides(overrides)))
    return GemvPlan(*p[:3], tuple(p[3:]))


def mma_plan(m, n, k, bits, overrides=None) -> MmaPlan:
    return MmaPlan(*torch.ops.kbit.mma_plan(m, n, k, bits, plan_overrides(overrides)))


def wgmma_plan(m, n, k, bits, dtype=torch.float16, splits=0, overrides=None) -> WgmmaPlan:
    return WgmmaPlan(*torch.ops.kbit.wgmma_plan(m, n, k, bits, dtype, splits, plan_overrides(overrides)))
