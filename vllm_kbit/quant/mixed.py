"""K per layer for an average number of bits (`convert --bits 2.5`).

1. Sensitivity: the float model runs over the calibration windows, layer by layer
   (calibrate.quantize_sequential, keeping every float weight); for each group of linears
   that read one input (q/k/v, gate/up: the layers vLLM fuses, which share K; o_proj and
   down_proj alone) the input Hessian H = sum x x^T gives the output error of the group
   quantized at each candidate K:  loss(K) = sum_i tr(dW_i H dW_i^T) / sum_i tr(W_i H W_i^T),
   the group's noise-to-signal ratio on the calibration text (scale-free, so that groups of
   different magnitudes compare).
2. Allocation: every group starts at the smallest K; the upgrade (group, K' > K) with the
   largest loss decrease per stored byte that still fits the budget is taken, until none fits.
   Bytes are counted as the format stores them: K/8 bytes per weight plus one E4M4 absmax
   byte per 32 weights, so the budget for an average of b bits is sum n_g * (4b + 1) / 32.
"""
from __future__ import annotations

import math

import torch

from vllm_kbit import format as kf
from vllm_kbit.quant import calibrate, rounding
from vllm_kbit.quant.codebooks import default_codebook

CANDIDATES = (2, 3, 4, 5)


class MixedBitsError(ValueError):
    """An average that no assignment of K per layer can meet, or bad sensitivities."""


def check_average(bits: float) -> float:
    try:
        b = float(bits)
    except (TypeError, ValueError):
        raise MixedBitsError(f"bits must be a number in [{CANDIDATES[0]}, {CANDIDATES[-1]}], got {bits!r}") from None
    if not (CANDIDATES[0] <= b <= CANDIDATES[-1]) or math.isnan(b):
        raise MixedBitsError(f"bits must be in [{CANDIDATES[0]}, {CANDIDATES[-1]}], got {bits!r}")
    return b


def stored_bytes(n_weights: int, bits: int) -> float:
    """Bytes the format stores for n weights at K = bits (qweight + E4M4 absmax)."""
    return n_weights * (4 * bits + 1) / kf.BLOCK_SIZE


@torch.no_grad()
def group_loss(weights: list[torch.Tensor], hessian: torch.Tensor, bits: int, method: str = "mse",
               codebook: torch.Tensor | None = None) -> float:
    """Noise-to-signal of a group's outputs on the calibration inputs at K = bits, each weight
    rounded by `method` (gptq: the whole group in one GPTQ sweep on `hessian`, so the loss is
    the one GPTQ leaves, which it lowers most where the inputs are loud)."""
    cb = default_codebook(bits) if codebook is None else codebook
    cb = cb.to(hessian.device)
    ws = [w.to(hessian.device, torch.float32) for w in weights]
    codes = (rounding.gptq_shared_input(ws, hessian, bits, [cb] * len(ws)) if method == "gptq"
             else [rounding.quantize_weight(w, bits, cb, method) for w in ws])
    num = den = 0.0
    for w, (q, a) in zip(ws, codes):
        d = kf.dequantize(q, a, bits, cb).to(w.dtype) - w
        num += float(torch.einsum("ij,jk,ik->", d, hessian, d))
        den += float(torch.einsum("ij,jk,ik->", w, hessian, w))
    return num / max(den, 1e-30)


def measure(model, batches, candidates=CANDIDATES, method: str = "rtn", device="cpu",
            progress: bool = True, select=None) -> dict[str, dict]:
    """{group name (its first linear's module name): {"members": [module names], "weights": n,
    "loss": {K: loss}}} for every group of decoder linears whose members `select(name)` accepts
    (all by default). The model's weights are left as they were. `method` rounds each weight for
    the measurement: rtn by default, since the allocation needs the ranking of the groups'
    losses, which rtn gives at a sixteenth of mse's cost (mse searches 16 scales per block);
    gptq measures the loss a gptq conversion leaves (a GPTQ sweep per group and K)."""
    out: dict[str, dict] = {}

    def visit(names, weights, hessian):
        picked = [i for i, n in enumerate(names) if select is None or select(n)]
        if picked:
            ws = [weights[i] for i in picked]
            out[names[picked[0]]] = {
                "members": [names[i] for i in picked], "weights": sum(w.numel() for w in ws),
                "loss": {k: group_loss(ws, hessian, k, method) for k in candidates}}
        return [None] * len(names)  # keep the float weights

    calibrate.quantize_sequential(model, batches, visit, device, progress)
    return out


def allocate(groups: dict[str, dict], average: float) -> dict[str, int]:
    """{group: K} meeting the average bits per weight (module docstring) at the least summed loss."""
    average = check_average(average)
    if not groups:
        raise MixedBitsError("no quantized layers to assign bits to")
    budget = sum(stored_bytes(g["weights"], average) for g in groups.values())
    ks = {name: min(g["loss"]) for name, g in groups.items()}
    used = sum(stored_bytes(g["weights"], ks[n]) for n, g in groups.items())
    while True:
        best, best_ratio = None, 0.0
        for name, g in groups.items():
            k0 = ks[name]
            for k in g["loss"]:
                if k <= k0:
                    continue
                extra = stored_bytes(g["weights"], k) - stored_bytes(g["weights"], k0)
                if used + extra > budget * (1 + 1e-12):
                    continue
                ratio = (g["loss"][k0] - g["loss"][k]) / extra
                if ratio > best_ratio:
                    best, best_ratio = (name, k, extra), ratio
        if best is None:
            return ks
        name, k, extra = best
        ks[name] = k
        used += extra


def per_module(groups: dict[str, dict], ks: dict[str, int]) -> dict[str, int]:
    """{module name: K} from a group allocation."""
    return {m: ks[g] for g, info in groups.items() for m in info["members"]}


def average_bits(groups: dict[str, dict], ks: dict[str, int]) -> float:
    n = sum(g["weights"] for g in groups.values())
    return sum(g["weights"] * ks[name] for name, g in groups.items()) / n
