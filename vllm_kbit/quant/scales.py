"""Block scales: the E4M4 code of each 32-weight block chosen to minimise its squared error.

The format decodes a weight as codebook[index] * decode(code). RTN takes the code nearest to
the block's absmax; `mse_codes` also tries the `search - 1` codes below it (a smaller scale
clips the largest weight but places the others on finer levels) and keeps, per block, the
code whose nearest-entry rounding gives the smallest (optionally column-weighted) error.
"""
from __future__ import annotations

import torch

from vllm_kbit import format as kf
from vllm_kbit.format import nearest_index

# Elements of the [blocks, candidates, 32] work tensors processed at once (~64 MiB float32).
_BUDGET = 16 * 1024 * 1024


def absmax_codes(blocks: torch.Tensor) -> torch.Tensor:
    """RTN's scale: the E4M4 code nearest each block's absmax. blocks [..., 32] -> uint8 [...]."""
    return kf.encode_e4m4(blocks.abs().amax(-1))


def mse_codes(blocks: torch.Tensor, codebook: torch.Tensor, search: int = 16,
              col_weight: torch.Tensor | None = None) -> torch.Tensor:
    """blocks [..., 32] float -> uint8 E4M4 codes [...]: per block, among the absmax code and
    the search - 1 codes below it (never code 0 for a non-zero block), the one minimising
    sum(col_weight * (w - codebook[nearest] * scale)^2). col_weight [..., 32] or None (= 1)."""
    shape = blocks.shape[:-1]
    b = blocks.reshape(-1, kf.BLOCK_SIZE).float()
    cw = None if col_weight is None else col_weight.reshape(-1, kf.BLOCK_SIZE).float().expand_as(b)
    top = absmax_codes(b).long()
    table = kf.e4m4_table(b.device)
    cb = codebook.to(b.device, torch.float32)
    out = torch.empty(b.shape[0], dtype=torch.uint8, device=b.device)
    step = max(1, _BUDGET // (search * kf.BLOCK_SIZE))
    offs = torch.arange(search, device=b.device)
    for r in range(0, b.shape[0], step):
        w = b[r:r + step, None, :]                                        # [R, 1, 32]
        cand = (top[r:r + step, None] - offs).clamp(min=1)                # [R, S]
        cand = torch.where(top[r:r + step, None] == 0, 0, cand)           # zero blocks stay zero
        s = table[cand].unsqueeze(-1)                                     # [R, S, 1]
        v = torch.where(s > 0, w / torch.where(s > 0, s, 1.0), 0.0)
        err = (cb[nearest_index(v, cb)] * s - w).pow(2)
        if cw is not None:
            err = err * cw[r:r + step, None, :]
        best = err.sum(-1).argmin(-1, keepdim=True)
        out[r:r + step] = cand.gather(1, best).squeeze(1).to(torch.uint8)
    return out.reshape(shape)
