"""Weight-only quantizers that all write the kbit format (qweight int32, absmax uint8 E4M4):

  * rtn:  absmax scale, nearest codebook entry (format.quantize);
  * mse:  per-block scale searched for the smallest squared error (scales.mse_codes), nearest
          entry; data-free;
  * gptq: error-compensated rounding (Frantar et al., GPTQ) to the codebook with the layer's
          input Hessian H = X^T X: columns are rounded left to right and each rounding error is
          spread over the columns not yet rounded through the Cholesky factor of H^-1, in lazy
          batches of 128 columns. The format fixes one scale per 32 columns, chosen (mse
          search) when the sweep reaches the block's first column, from the error-updated
          weights.

Every function returns (qweight, absmax) exactly as the kernels read them; callers get the
float weight the kernels compute with via format.dequantize.
"""
from __future__ import annotations

import torch

from vllm_kbit import format as kf
from vllm_kbit.format import nearest_index
from vllm_kbit.quant.scales import absmax_codes, mse_codes

METHODS = ("rtn", "mse", "gptq")
DEFAULT_SEARCH = 16


def _pack(idx: torch.Tensor, codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = idx.shape
    return kf.pack_bitplanes(idx.to(torch.uint8), bits), codes.reshape(n, k // kf.BLOCK_SIZE)


def _round(w: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Nearest codebook index of each weight under its block's scale. w [..., 32], codes [...]."""
    s = kf.decode_e4m4(codes).unsqueeze(-1)
    v = torch.where(s > 0, w / torch.where(s > 0, s, 1.0), 0.0)
    return nearest_index(v, codebook)


def quantize_rtn(weight: torch.Tensor, bits: int, codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // kf.BLOCK_SIZE, kf.BLOCK_SIZE)
    codes = absmax_codes(blocks)
    return _pack(_round(blocks, codes, codebook).reshape(n, k), codes, bits)


def quantize_mse(weight: torch.Tensor, bits: int, codebook: torch.Tensor,
                 search: int = DEFAULT_SEARCH) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // kf.BLOCK_SIZE, kf.BLOCK_SIZE)
    codes = mse_codes(blocks, codebook, search)
    return _pack(_round(blocks, codes, codebook).reshape(n, k), codes, bits)


@torch.no_grad()
def quantize_gptq(weight: torch.Tensor, hessian: torch.Tensor, bits: int, codebook: torch.Tensor,
                  search: int = DEFAULT_SEARCH, damp: float = 0.01,
                  lazy_block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ to the kbit format. hessian [K, K]: sum of x x^T over the calibration inputs of
    this layer (any positive multiple works: damping is relative to its mean diagonal)."""
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"gptq: Hessian shape {tuple(hessian.shape)} does not match in_features {k}")
    if lazy_block % kf.BLOCK_SIZE:
        raise ValueError(f"gptq: lazy_block {lazy_block} must be a multiple of {kf.BLOCK_SIZE}")
    dev = weight.device
    W = weight.to(torch.float32).clone()
    H = hessian.to(dev, torch.float32).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * torch.mean(torch.diag(H)) * torch.eye(k, device=dev)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    del H
    cb = codebook.to(dev, torch.float32)
    idx = torch.empty(n, k, dtype=torch.int64, device=dev)
    codes = torch.empty(n, k // kf.BLOCK_SIZE, dtype=torch.uint8, device=dev)
    for i1 in range(0, k, lazy_block):
        i2 = min(i1 + lazy_block, k)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % kf.BLOCK_SIZE == 0:
                blk = col // kf.BLOCK_SIZE
                codes[:, blk] = mse_codes(W1[:, i:i + kf.BLOCK_SIZE], cb, search)
                scale = kf.decode_e4m4(codes[:, blk])
                safe = torch.where(scale > 0, scale, 1.0)
            w = W1[:, i]
            j = nearest_index(torch.where(scale > 0, w / safe, 0.0), cb)
            idx[:, col] = j
            err = (w - cb[j] * scale) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return _pack(idx, codes, bits)


def gptq_shared_input(weights: list[torch.Tensor], hessian: torch.Tensor, bits: int,
                      codebooks: list[torch.Tensor], search: int = DEFAULT_SEARCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """quantize_gptq for linears that read the same input (q/k/v, gate/up): GPTQ treats rows
    independently, so the ones sharing a codebook run as one stacked matrix (one column sweep)."""
    out: list = [None] * len(weights)
    groups: dict[tuple, list[int]] = {}
    for i, cb in enumerate(codebooks):
        groups.setdefault(tuple(cb.tolist()), []).append(i)
    for members in groups.values():
        stacked = torch.cat([weights[i] for i in members])
        q, a = quantize_gptq(stacked, hessian, bits, codebooks[members[0]], search)
        r = 0
        for i in members:
            n = weights[i].shape[0]
            out[i] = (q[r:r + n], a[r:r + n])
            r += n
    return out


def quantize_weight(weight: torch.Tensor, bits: int, codebook: torch.Tensor, method: str = "mse",
                    hessian: torch.Tensor | None = None, search: int = DEFAULT_SEARCH):
    """Dispatch by method name; gptq needs `hessian`."""
    if method == "rtn":
        return quantize_rtn(weight, bits, codebook)
    if method == "mse":
        return quantize_mse(weight, bits, codebook, search)
    if method == "gptq":
        if hessian is None:
            raise ValueError("gptq needs the layer's input Hessian")
        return quantize_gptq(weight, hessian, bits, codebook, search)
    raise ValueError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
