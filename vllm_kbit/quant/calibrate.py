"""The sequential calibration run that gptq needs: decoder layers one at a time.

The float model stays where it was loaded (host memory); each decoder layer in turn moves to
`device`, the calibration hidden states go through it with hooks on its Linear modules that
accumulate each one's input Hessian H = sum x x^T, its linears are quantized (the callback
returns the dequantized weight the kernels will compute with, which replaces the float
weight), and the same hidden states go through the quantized layer again to become the next
layer's inputs. So each layer is calibrated on what the already-quantized earlier layers
produce, and only one layer, its Hessians and the hidden states are ever on the device.

Works for decoder-only models whose decoder layers are `model.model.layers` (Llama, Qwen,
Mistral, Gemma, Phi-3 and most others in transformers); anything else raises CalibrationError.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch


class CalibrationError(ValueError):
    """A model the sequential calibration cannot walk, or unusable calibration data."""


class _Stop(Exception):
    pass


def decoder_layers(model) -> torch.nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise CalibrationError(
            f"gptq: cannot find the decoder layers of {type(model).__name__} (expected "
            f"model.model.layers, as in Llama / Qwen / Mistral); use --method mse or rtn")
    return layers


def _linears(layer: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: m for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}


def _move_kwargs(kwargs: dict, device) -> dict:
    def mv(v):
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, tuple):
            return tuple(mv(x) for x in v)
        return v
    return {k: mv(v) for k, v in kwargs.items()}


@torch.no_grad()
def _layer_inputs(model, layers, batches: list[torch.Tensor], device) -> tuple[list, list[dict]]:
    """The hidden states and keyword arguments (masks, rotary embeddings) with which the model
    calls its first decoder layer, one entry per batch; computed with everything before the
    first layer on `device` for the duration."""
    first = layers[0]
    states, kwargs = [], []

    def catch(module, args, kw):
        states.append((args[0] if args else kw.pop("hidden_states")).detach())
        kw = {k: v for k, v in kw.items() if k != "hidden_states"}
        kw["use_cache"] = False
        kw.pop("past_key_value", None)
        kw.pop("past_key_values", None)
        kwargs.append(kw)
        raise _Stop

    # Everything but the decoder layers (embeddings, rotary, norm) is small: move it for the pass.
    others = [m for n, m in model.model.named_children() if n != "layers"]
    for m in others:
        m.to(device)
    handle = first.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for ids in batches:
            try:
                model.model(input_ids=ids.to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
        for m in others:
            m.to("cpu")
    return states, kwargs


@torch.no_grad()
def quantize_sequential(model, batches: list[torch.Tensor], quantize: Callable, device="cpu",
                        progress: bool = True, prefix: str = "model.layers") -> None:
    """Run gptq-style sequential calibration on `model` (a transformers causal LM on the CPU).
    `batches`: token id tensors [B, T]. Linears of one decoder layer that read the same input
    (q/k/v, gate/up) form a group with one Hessian; per group,
    `quantize(names, weights, hessian)` returns the dequantized weights (same shapes) that
    replace the float ones, where names are the modules' names in the model (e.g.
    'model.layers.3.self_attn.q_proj') and hessian is the float32 sum of x x^T over every
    calibration token. All linears of a layer are quantized from one pass through the float
    layer."""
    from tqdm import tqdm

    if not batches:
        raise CalibrationError("gptq: no calibration data")
    layers = decoder_layers(model)
    device = torch.device(device)
    states, kwargs = _layer_inputs(model, layers, batches, device)
    bar = tqdm(total=len(layers), unit="layer", desc="gptq", disable=not progress, file=sys.stderr)
    for li, layer in enumerate(layers):
        layer.to(device)
        linears = _linears(layer)
        hess, group_of, first_input = {}, {}, {}

        def hook(name):
            def fn(module, args):
                x = args[0]
                if name not in group_of:  # linears fed the very same tensor share one Hessian
                    group_of[name] = first_input.setdefault(id(x), (name, x))[0]  # (x kept: no id reuse)
                g = group_of[name]
                if g != name:
                    return
                x = x.detach().reshape(-1, x.shape[-1]).float()
                h = hess.get(g)
                hess[g] = x.t() @ x if h is None else h.addmm_(x.t(), x)
            return fn

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
        try:
            for h, kw in zip(states, kwargs):
                layer(h, **kw)
                first_input.clear()
        finally:
            for hd in handles:
                hd.remove()
        for g, h in list(hess.items()):
            names = [n for n in linears if group_of.get(n) == g]
            new = quantize([f"{prefix}.{li}.{n}" for n in names], [linears[n].weight.data for n in names], h)
            del hess[g]
            for n, w in zip(names, new):
                if w is not None:
                    linears[n].weight.data.copy_(w.to(linears[n].weight.dtype))
        for i, (h, kw) in enumerate(zip(states, kwargs)):
            out = layer(h, **kw)
            states[i] = out[0] if isinstance(out, tuple) else out
        layer.to("cpu")
        bar.update(1)
    bar.close()
