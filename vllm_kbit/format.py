"""The kbit format: codebook, E4M4 absmax, bit-planes, and the reference quantize / dequantize.

This module is the public contract of a kbit checkpoint (see docs/FORMAT.md). Everything here
is plain vectorized PyTorch, runs on the CPU and on the GPU, and is the reference the CUDA
kernels are tested against.

For a linear layer with weight W[N, K] (out x in), K % 32 == 0:
  * blocks of BLOCK_SIZE = 32 consecutive weights along K of one output row;
  * per block, absmax encoded as E4M4 (uint8, exponent bias 11, with subnormals);
  * each weight becomes the index of the codebook value nearest to w / decode(absmax);
  * per block, `bits` int32 words: bit i of word b is bit b of element i's index;
  * qweight int32 [N, K/32*bits] (block j's words at columns j*bits .. j*bits+bits-1),
    absmax uint8 [N, K/32].
"""
from __future__ import annotations

import functools

import torch

BLOCK_SIZE = 32
# MoE routers (a layer's `gate`, Qwen2-MoE's `shared_expert_gate`, `router`): tiny linears whose
# rounding would move every token's choice of experts; convert and the vLLM config keep them
# float, whatever the ignore list (compressed-tensors pattern syntax).
ROUTER_PATTERN = r"re:.*\.(gate|router|shared_expert_gate)$"
# Checkpoint linears that vLLM runs as one layer (qkv_proj, gate_up_proj; Mixtral's and
# InternLM2's w1 / w3 experts or MLPs): one kernel call, so one scheme and one codebook each.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
SUPPORTED_BITS = (2, 3, 4, 5)

E4M4_BIAS = 11
# Largest E4M4 value: exponent 15, mantissa 15 -> 2^(15-11) * (1 + 15/16).
E4M4_MAX = 31.0
# Smallest positive E4M4 value: subnormal with mantissa 1 -> 2^(1-11) * 1/16.
E4M4_MIN_SUBNORMAL = 2.0 ** -14


class KbitFormatError(ValueError):
    """Input that the kbit format cannot represent faithfully."""


def check_bits(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise KbitFormatError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return bits


# ----------------------------------------------------------------------------- codebook

@functools.lru_cache(maxsize=None)
def _normal_float_codebook_cpu(bits: int) -> torch.Tensor:
    n = 1 << bits
    # Quantiles of N(0, 1) at the centres of 2^K equiprobable bins, as bitsandbytes' kbit
    # code builds them; computed in float64 so the float32 result is correctly rounded.
    p = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    v = torch.special.ndtri(p)
    return (v / v.abs().max()).to(torch.float32)


def normal_float_codebook(bits: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The normal-float codebook `nf`: v_i = Phi^-1((i + 0.5) / 2^K), scaled so max |v| = 1
    (float32, ascending); the codebook of checkpoints that store none."""
    cb = _normal_float_codebook_cpu(check_bits(bits))
    return cb.to(device) if device is not None else cb.clone()


@functools.lru_cache(maxsize=None)
def _nf0_cpu(bits: int) -> torch.Tensor:
    n = 1 << bits
    pos, neg = n // 2, n // 2 - 1
    # bitsandbytes' offset: halfway between the outermost quantiles of 2(n-1) and 2n bins, so
    # the largest level is finite and both halves end at +-1 after scaling
    offset = ((1 - 1 / (2 * (n - 1))) + (1 - 1 / (2 * n))) / 2
    ndtri = torch.special.ndtri
    p = ndtri(torch.linspace(offset, 0.5, pos + 1, dtype=torch.float64)[:-1])
    m = -ndtri(torch.linspace(offset, 0.5, neg + 1, dtype=torch.float64)[:-1])
    v = torch.cat([p, torch.zeros(1, dtype=torch.float64), m]).sort().values
    return (v / v.abs().max()).to(torch.float32)


def nf0_codebook(bits: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Normal-float codebook with an exact zero, built as bitsandbytes' create_normal_map builds
    NF4: 2^(K-1) - 1 negative quantiles, 0, 2^(K-1) positive ones (float32, ascending)."""
    cb = _nf0_cpu(check_bits(bits))
    return cb.to(device) if device is not None else cb.clone()


# The codebook every entry point that quantizes uses when none is given (ops.quantize,
# `--quantization kbit`, convert): nf0, whose zero level keeps small weights at zero (see
# docs/FORMAT.md). A checkpoint that stores no codebook predates it and decodes with
# normal_float_codebook (config.KbitConfig).
DEFAULT_CODEBOOK = "nf0"


def default_codebook(bits: int, device: torch.device | str | None = None) -> torch.Tensor:
    return nf0_codebook(bits, device)


def check_codebook(codebook, bits: int) -> torch.Tensor:
    """Validate a codebook for `bits` and return it as a float32 CPU tensor."""
    check_bits(bits)
    cb = torch.as_tensor(codebook, dtype=torch.float32).flatten().cpu()
    if cb.numel() != (1 << bits):
        raise KbitFormatError(
            f"codebook has {cb.numel()} entries but bits={bits} needs exactly {1 << bits}")
    if not torch.isfinite(cb).all():
        raise KbitFormatError("codebook has non-finite entries")
    if not (cb[1:] > cb[:-1]).all():
        raise KbitFormatError("codebook must be strictly ascending")
    if cb.abs().max() > 1.0:
        raise KbitFormatError("codebook entries must lie in [-1, 1] (they are scaled by the block absmax)")
    return cb


def nearest_index(v: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the codebook entry nearest to each v (the lower entry at a midpoint); int64."""
    cb = codebook.to(v.device, v.dtype)
    return torch.bucketize(v, (cb[1:] + cb[:-1]) / 2)


# ----------------------------------------------------------------------------- E4M4

@functools.lru_cache(maxsize=None)
def _e4m4_table_cpu() -> torch.Tensor:
    code = torch.arange(256, dtype=torch.int64)
    e, m = code >> 4, (code & 0xF).double()
    normal = torch.ldexp(1.0 + m / 16.0, e - E4M4_BIAS)
    subnormal = torch.ldexp(m / 16.0, torch.full_like(e, 1 - E4M4_BIAS))
    return torch.where(e > 0, normal, subnormal).to(torch.float32)


@functools.lru_cache(maxsize=None)
def _on_device(make, device: torch.device) -> torch.Tensor:
    # One copy per device, made on first use: later calls (e.g. inside CUDA-graph capture,
    # where a host-to-device copy is not allowed) reuse it.
    return make().to(device)


def e4m4_table(device=None) -> torch.Tensor:
    """float32[256]: the value of every E4M4 code. Strictly increasing in the code."""
    if device is None:
        return _e4m4_table_cpu().clone()
    return _on_device(_e4m4_table_cpu, torch.device(device))


def decode_e4m4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M4 codes -> float32 values."""
    return e4m4_table(codes.device)[codes.long()]


def encode_e4m4(values: torch.Tensor) -> torch.Tensor:
    """float absmax (>= 0) -> nearest E4M4 code (ties to the larger code). Saturates at E4M4_MAX;
    callers check the range first (quantize does)."""
    table = e4m4_table(values.device)
    v = values.to(torch.float32).clamp(0.0, E4M4_MAX).contiguous()
    hi = torch.searchsorted(table, v).clamp(max=255)
    lo = (hi - 1).clamp(min=0)
    take_lo = (v - table[lo]) < (table[hi] - v)
    return torch.where(take_lo, lo, hi).to(torch.uint8)


# ----------------------------------------------------------------------------- bit-planes

def _shifts_cpu() -> torch.Tensor:
    return torch.arange(BLOCK_SIZE, dtype=torch.int64)


def _shifts(device) -> torch.Tensor:
    return _on_device(_shifts_cpu, torch.device(device))


def pack_bitplanes(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """indices uint8 [..., nblocks*32] (values < 2^bits) -> int32 [..., nblocks*bits].

    Block j's words sit at j*bits .. j*bits+bits-1; bit i of word b is bit b of element i."""
    check_bits(bits)
    idx = indices.reshape(*indices.shape[:-1], -1, 1, BLOCK_SIZE).to(torch.int64)
    planes = (idx >> torch.arange(bits, device=idx.device).view(bits, 1)) & 1      # [..., nb, bits, 32]
    words = (planes << _shifts(idx.device)).sum(-1)                                # [..., nb, bits] in [0, 2^32)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.reshape(*indices.shape[:-1], -1)


def unpack_bitplanes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., nblocks*bits] -> uint8 indices [..., nblocks*32]."""
    check_bits(bits)
    w = words.reshape(*words.shape[:-1], -1, bits, 1).to(torch.int64) & 0xFFFFFFFF
    planes = (w >> _shifts(w.device)) & 1                                          # [..., nb, bits, 32]
    idx = (planes << torch.arange(bits, device=w.device).view(bits, 1)).sum(-2)    # [..., nb, 32]
    return idx.to(torch.uint8).reshape(*words.shape[:-1], -1)


# ----------------------------------------------------------------------------- quantize / dequantize

# Rows quantized at once: bounds the [rows, K, 2^bits] distance tensor to ~256 MiB.
_DIST_BUDGET = 64 * 1024 * 1024


def check_quantizable(weight: torch.Tensor, name: str = "weight") -> int:
    """Raise KbitFormatError naming `name` if W[N, K] cannot be stored faithfully: not 2-D,
    K % 32 != 0, a NaN/Inf, or a block absmax above E4M4_MAX (it would be clipped).
    Returns how many non-zero blocks underflow E4M4 (absmax below half its smallest value,
    2^-15): those are stored as zeros, which moves no weight by more than 2^-15."""
    if weight.dim() != 2:
        raise KbitFormatError(f"{name}: expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if k % BLOCK_SIZE:
        raise KbitFormatError(f"{name}: in_features {k} is not a multiple of {BLOCK_SIZE}")
    finite = torch.isfinite(weight)
    if not finite.all():
        bad = (~finite).nonzero()[0].tolist()
        raise KbitFormatError(f"{name}: non-finite value at index {bad} (NaN/Inf cannot be quantized)")
    amax = weight.reshape(n, k // BLOCK_SIZE, BLOCK_SIZE).abs().amax(-1).float()
    worst = amax.max().item() if amax.numel() else 0.0
    if worst > E4M4_MAX:
        raise KbitFormatError(
            f"{name}: a block absmax of {worst:.4g} exceeds the E4M4 range (max {E4M4_MAX}); "
            f"keep this layer unquantized (--ignore) or rescale it")
    return int(((amax > 0) & (amax < E4M4_MIN_SUBNORMAL / 2)).sum())


def quantize(weight: torch.Tensor, bits: int, codebook: torch.Tensor | None = None,
             name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantizer: W[N, K] -> (qweight int32 [N, K/32*bits], absmax uint8 [N, K/32]).

    Each weight maps to the nearest codebook entry of w / decode(absmax), the first entry on
    ties (the rule the CUDA quantize kernel follows); checks as check_quantizable."""
    check_bits(bits)
    check_quantizable(weight, name)
    cb = default_codebook(bits) if codebook is None else check_codebook(codebook, bits)
    return quantize_checked(weight, bits, cb)


def quantize_checked(weight: torch.Tensor, bits: int, codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` for input its caller has validated (bits, codebook, check_quantizable), as
    ops.quantize does before it dispatches: the checks read the whole weight, once is enough."""
    n, k = weight.shape
    cb = codebook.to(weight.device, torch.float32)
    blocks = weight.to(torch.float32).reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    codes = encode_e4m4(blocks.abs().amax(-1))
    scale = decode_e4m4(codes)

    qweight = torch.empty(n, k // BLOCK_SIZE * bits, dtype=torch.int32, device=weight.device)
    rows = max(1, _DIST_BUDGET // max(1, k * cb.numel()))
    for r in range(0, n, rows):
        s = scale[r:r + rows, :, None]
        v = torch.where(s > 0, blocks[r:r + rows] / torch.where(s > 0, s, 1.0), 0.0)
        idx = (v.unsqueeze(-1) - cb).abs().argmin(-1).to(torch.uint8)
        qweight[r:r + rows] = pack_bitplanes(idx.reshape(idx.shape[0], k), bits)
    return qweight, codes


def dequantize(qweight: torch.Tensor, absmax: torch.Tensor, bits: int,
               codebook: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(qweight int32 [N, K/32*bits], absmax uint8 [N, K/32]) -> W[N, K] in `dtype`
    (computed in float32, or float64 when dtype is float64)."""
    check_bits(bits)
    n, nb = absmax.shape
    if qweight.shape != (n, nb * bits):
        raise KbitFormatError(
            f"qweight shape {tuple(qweight.shape)} does not match absmax {tuple(absmax.shape)} "
            f"for bits={bits} (expected {(n, nb * bits)})")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    cb = (default_codebook(bits) if codebook is None else codebook).to(qweight.device, work)
    idx = unpack_bitplanes(qweight, bits).long().reshape(n, nb, BLOCK_SIZE)
    w = cb[idx] * decode_e4m4(absmax).to(work).unsqueeze(-1)
    return w.reshape(n, nb * BLOCK_SIZE).to(dtype)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum()
    return float(10.0 * torch.log10(ref.pow(2).sum() / noise))


def from_bitsandbytes(packed: torch.Tensor, absmax: torch.Tensor, out_features: int,
                      in_features: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bitsandbytes kbit tensor (flat bit-planes of W[N, K], E4M4 absmax) is already this
    layout; only the shapes change. Returns (qweight, absmax) ready for a kbit checkpoint."""
    check_bits(bits)
    if in_features % BLOCK_SIZE:
        raise KbitFormatError(f"in_features {in_features} is not a multiple of {BLOCK_SIZE}")
    nb = in_features // BLOCK_SIZE
    if absmax.dtype != torch.uint8:
        raise KbitFormatError(f"absmax must be E4M4 uint8, got {absmax.dtype}")
    return (packed.contiguous().view(torch.int32).reshape(out_features, nb * bits),
            absmax.reshape(out_features, nb))
