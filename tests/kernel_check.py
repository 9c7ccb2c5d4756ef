"""The one comparison every kbit kernel test makes: an output against the float64 reference
(vllm_kbit/format.py), element by element, with a bound derived from the dtype and the
reduction, not only a norm over the whole output.

The bound. A kernel computes y = sum_k x_k w_k (+ bias) from x in `dtype` (exact), each weight
decoded from the format exactly in fp32 (codebook entry times E4M4 scale) and rounded to
`dtype` at most twice (the codebook entry, then its product with the block scale where the
scale multiplies the weights), products and sums in fp32, the result rounded to `dtype` once.
So weight k carries an error |d_k| <= eps |w_k| + tiny (eps: the dtype's machine epsilon, two
unit roundoffs; tiny: its smallest subnormal, for the E4M4 subnormal scales), fixed by W,
while x has random signs independent of W: the errors of one output add as a random walk of
standard deviation at most (eps / sqrt(3)) S + tiny ||x||, S = sqrt(sum_k (x_k w_k)^2) (about
rms(x w) sqrt(K)). Hence, per element,

    |y - ref| <= C (eps S + tiny ||x||) + eps (|x . w| + |bias|) + smallest normal,

C = 4: about 7 standard deviations, a false failure has probability < 1e-11 per element. The
second term is the output rounding (and the bias add); fp32 accumulation (~2^-24 sqrt(K) S)
is far below the first.

What it catches. One wrong 32-weight block in row n of W (planes flipped: each weight moves by
about 2|w|) moves output column n by D = sum over the block of x_i dw_i, of standard deviation
about 2 sqrt(32) rms(x) rms(w) = 11 rms(x) rms(w) in every row of x; at K = 14336 the bound is
4 eps sqrt(K) rms(x) rms(w) = 3.7 (bf16) / 0.47 (fp16) rms(x) rms(w). One row catches it with
probability 0.74 (bf16) / 0.97 (fp16), 16 rows with 1 - 4e-10 (bf16). The relative Frobenius
norm over a 16 x 4096 output moves by about 11 / sqrt(4096 * 14336) = 1e-3 of its size: under
a norm tolerance of 2e-3 (fp16) or 1e-2 (bf16), which a norm check needs for the rounding.
tests/test_corrupted_block.py shows each path's check failing on one such block and on one
wrong E4M4 code.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

C = 4.0


class Reference(NamedTuple):
    """float64 reference of a bilinear kernel output and the per-element scales of its bound."""
    value: torch.Tensor      # sum_k x_k w_k (+ bias)
    spread: torch.Tensor     # S = sqrt(sum_k (x_k w_k)^2)
    xnorm: torch.Tensor      # sqrt(sum_k x_k^2) over the weights the element reads
    magnitude: torch.Tensor  # |sum_k x_k w_k| + |bias|


def reference(apply: Callable, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              row_weights: torch.Tensor | None = None) -> Reference:
    """`apply(x, w)`: the kernel's bilinear map in float64 (x @ w.T for a GEMM; the MoE pair
    map; x * w for a dequantize, x = 1). `row_weights`: per-row factors applied in fp32 before
    the rounding (MoE topk_weights)."""
    x64, w64 = x.double(), w.double()
    value = apply(x64, w64)
    spread = apply(x64 * x64, w64 * w64).sqrt()
    xnorm = apply(x64 * x64, torch.ones_like(w64)).sqrt()
    if row_weights is not None:
        r = row_weights.reshape(-1, 1).double()
        value, spread, xnorm = value * r, spread * r.abs(), xnorm * r.abs()
    magnitude = value.abs()
    if bias is not None:
        value = value + bias.double()
        magnitude = magnitude + bias.double().abs()
    return Reference(value, spread, xnorm, magnitude)


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> Reference:
    """The reference of y = x @ w^T (+ bias)."""
    return reference(lambda a, b: a @ b.t(), x, w.to(x.device), bias)


def weights(w: torch.Tensor) -> Reference:
    """The reference of a dequantized weight (one rounding of each exact value)."""
    return reference(lambda a, b: a * b, torch.ones((), dtype=torch.float64, device=w.device), w)


def bound(ref: Reference, dtype: torch.dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    tiny = fi.smallest_normal * fi.eps  # the smallest subnormal
    return C * (fi.eps * ref.spread + tiny * ref.xnorm) + fi.eps * ref.magnitude + fi.smallest_normal


def compare(y: torch.Tensor, ref: Reference, dtype: torch.dtype | None = None) -> str | None:
    """None if every element of y is within the bound of ref (NaN never is), else what failed:
    how many elements, the worst one (its index, error and bound) and the relative norm error."""
    dtype = dtype or y.dtype
    value = ref.value.to(y.device)
    if y.shape != value.shape:
        return f"shape {tuple(y.shape)}, expected {tuple(value.shape)}"
    err = (y.double() - value).abs()
    lim = bound(Reference(*(t.to(y.device) for t in ref)), dtype)
    bad = ~(err <= lim)
    if not bool(bad.any()):
        return None
    ratio = torch.where(bad, torch.nan_to_num(err / lim, nan=float("inf")), 0.0)
    worst = int(ratio.reshape(-1).argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), y.shape))
    rel = float((y.double() - value).norm() / value.norm().clamp_min(1e-300))
    return (f"{int(bad.sum())} of {y.numel()} elements outside the bound; worst at {idx}: |y - ref| = "
            f"{float(err.reshape(-1)[worst]):.3e} > {float(lim.reshape(-1)[worst]):.3e} "
            f"(relative norm error {rel:.2e})")


def outside(y: torch.Tensor, ref: Reference, dtype: torch.dtype | None = None) -> torch.Tensor:
    """bool, y's shape: the elements outside the bound (NaN included)."""
    err = (y.double() - ref.value.to(y.device)).abs()
    return ~(err <= bound(Reference(*(t.to(y.device) for t in ref)), dtype or y.dtype))


def assert_close(y: torch.Tensor, ref: Reference, dtype: torch.dtype | None = None, where: str = "") -> None:
    problem = compare(y, ref, dtype)
    assert problem is None, f"{problem} {where}"


# ----------------------------------------------------------------------------- one bad block

def flip_planes(qweight: torch.Tensor, bits: int, row: int, block: int) -> torch.Tensor:
    """A copy of a checkpoint-layout qweight [N, K/32*bits] with every plane word of one block
    of one row inverted: each of its 32 indices i becomes 2^bits - 1 - i (about -w)."""
    q = qweight.clone()
    q[..., row, block * bits:(block + 1) * bits] = ~q[..., row, block * bits:(block + 1) * bits]
    return q


def bump_code(absmax: torch.Tensor, row: int, block: int) -> torch.Tensor:
    """A copy of a checkpoint-layout absmax [N, K/32] with one block's E4M4 code two exponents
    up (scale x 4) or, near the top, down (scale / 4)."""
    a = absmax.clone()
    code = int(a[..., row, block])
    a[..., row, block] = code + 0x20 if code < 0xE0 else code - 0x20
    return a
