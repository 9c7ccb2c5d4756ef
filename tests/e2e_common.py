"""Shared by the conversion and end-to-end tests: a kbit checkpoint's dequantized bf16 copy,
one vLLM engine run in its own process (vllm_runner.py), and the comparison of two runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vllm_kbit import format as kf


def dequantized_copy(kbit_dir: Path, dst: Path) -> Path:
    """The kbit checkpoint with every qweight/absmax pair replaced by its bf16 dequantization."""
    dst.mkdir(parents=True)
    cfg = json.loads((kbit_dir / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    cb = torch.tensor(qc["codebook"])
    tensors = {}
    for f in kbit_dir.glob("*.safetensors"):
        tensors.update(load_file(f))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            p = name[: -len(".qweight")]
            bits = qc.get("bits_per_layer", {}).get(p, qc["bits"])  # mixed K: the layer's own
            base = torch.tensor(qc["codebooks"][str(bits)]) if bits != qc["bits"] else cb
            layer_cb = tensors.get(p + ".codebook", base)  # convert --fit-codebook
            out[p + ".weight"] = kf.dequantize(t, tensors[p + ".absmax"], bits, layer_cb, dtype=torch.bfloat16)
        elif not name.endswith((".absmax", ".codebook")):
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in kbit_dir.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


RUNNER = Path(__file__).with_name("vllm_runner.py")


def run(model: Path, tag: str, *args, env=None, reuse: bool = False) -> dict:
    """vllm_runner.py on `model` (extra runner arguments `args`); its JSON, kept beside the model
    as MODEL-TAG.json, which `reuse` reads instead of running again if an earlier run wrote it."""
    out = model.parent / f"{model.name}-{tag}.json"
    if reuse and out.exists():
        return json.loads(out.read_text())
    subprocess.run([sys.executable, str(RUNNER), str(model), str(out), *args], check=True, timeout=900,
                   env={**os.environ, **(env or {})})
    return json.loads(out.read_text())


def compare(a: dict, b: dict) -> tuple[float, float]:
    """Teacher-forced top-1 agreement and mean |logprob difference| of the prompt's tokens."""
    agree, diffs = [], []
    for pa, pb, ids in zip(a["prompt_logprobs"], b["prompt_logprobs"], a["prompt_ids"]):
        for pos in range(1, len(ids)):
            top_a = next(t for t, (_, r) in pa[pos].items() if r == 1)
            top_b = next(t for t, (_, r) in pb[pos].items() if r == 1)
            agree.append(top_a == top_b)
            tok = str(ids[pos])
            diffs.append(abs(pa[pos][tok][0] - pb[pos][tok][0]))
    return sum(agree) / len(agree), sum(diffs) / len(diffs)


def logprob_scale(a: dict) -> float:
    """Mean |logprob| of the prompt's tokens in run `a`: what compare's mean difference is relative to."""
    vals = [abs(pos[str(ids[i])][0]) for pl, ids in zip(a["prompt_logprobs"], a["prompt_ids"])
            for i, pos in enumerate(pl) if pos]
    return sum(vals) / len(vals)
