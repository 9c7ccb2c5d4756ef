"""Codebooks for the kbit format: the normal-float codebooks and a per-tensor fitted one.

A codebook is 2^K strictly ascending float32 values in [-1, 1]; a weight is stored as
codebook[index] * block_scale. Two closed-form families and one data-driven fit:

  * `nf` (format.normal_float_codebook): symmetric normal-float quantiles. It has no zero
    level, so every small weight is rounded away from zero; that costs most at K = 2, 3.
  * `nf0`: the normal-float map with an exact zero, built as bitsandbytes' create_normal_map
    builds NF4: 2^(K-1) positive quantiles, 0, and 2^(K-1) - 1 negative quantiles.
  * `fit_codebook`: Lloyd-Max (weighted k-means) on the block-normalised weights w / scale of
    one tensor or one fused group, weighted by scale^2 so that it minimises the squared error
    in weight space.
"""
from __future__ import annotations

import torch

from vllm_kbit import format as kf
from vllm_kbit.format import nearest_index
from vllm_kbit.quant.scales import mse_codes

CODEBOOKS = ("nf", "nf0")


def nf0_codebook(bits: int) -> torch.Tensor:
    """Normal-float codebook with an exact zero (format.nf0_codebook)."""
    return kf.nf0_codebook(bits)


def named_codebook(name: str, bits: int) -> torch.Tensor:
    if name == "nf":
        return kf.normal_float_codebook(bits)
    if name == "nf0":
        return nf0_codebook(bits)
    raise ValueError(f"unknown codebook {name!r} (choose from {', '.join(CODEBOOKS)})")


def default_codebook(bits: int) -> torch.Tensor:
    """The codebook every entry point that quantizes uses by default (format.DEFAULT_CODEBOOK)."""
    return kf.default_codebook(bits)


def _clean(cb: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Clamp to [-1, 1], sort, and push apart entries closer than 1e-4 (empty clusters)."""
    cb = torch.where(torch.isfinite(cb), cb, fallback).clamp(-1, 1).sort().values
    for i in range(1, cb.numel()):
        cb[i] = torch.maximum(cb[i], cb[i - 1] + 1e-4)
    if cb[-1] > 1:  # pushed past the top: shift the tail back down
        cb = cb - (cb[-1] - 1)
    return cb.float()


def fit_codebook(weights: list[torch.Tensor], bits: int, init: torch.Tensor | None = None,
                 iters: int = 25, max_samples: int = 1 << 21, scale_search: int = 0,
                 seed: int = 0) -> torch.Tensor:
    """Lloyd-Max codebook for the block-normalised values of `weights` (one tensor, or the
    shards of a fused layer, which must share one codebook). Scales are the absmax E4M4 codes
    (or, with scale_search > 0, the mse search of `scales.mse_codes` against the current
    codebook, alternating twice). At most max_samples blocks' values are used (a random subset
    of blocks), so an 8B layer fits in seconds."""
    cb = (nf0_codebook(bits) if init is None else kf.check_codebook(init, bits)).to(weights[0].device)
    blocks = torch.cat([w.float().reshape(-1, kf.BLOCK_SIZE) for w in weights])
    if blocks.numel() > max_samples:
        g = torch.Generator(device="cpu").manual_seed(seed)
        pick = torch.randperm(blocks.shape[0], generator=g)[: max_samples // kf.BLOCK_SIZE]
        blocks = blocks[pick.to(blocks.device)]
    for _ in range(2 if scale_search else 1):
        if scale_search:
            codes = mse_codes(blocks, cb, scale_search)
        else:
            codes = kf.encode_e4m4(blocks.abs().amax(-1))
        s = kf.decode_e4m4(codes).unsqueeze(-1).expand_as(blocks)
        keep = s > 0
        v, wt = (blocks[keep] / s[keep]).clamp(-1, 1), s[keep].pow(2)
        for _ in range(iters):
            idx = nearest_index(v, cb)
            num = torch.zeros_like(cb).index_add_(0, idx, v * wt)
            den = torch.zeros_like(cb).index_add_(0, idx, wt)
            new = _clean(torch.where(den > 0, num / den.clamp_min(1e-30), cb), cb)
            done = (new - cb).abs().max() < 1e-6
            cb = new
            if done:
                break
    return kf.check_codebook(cb, bits)
