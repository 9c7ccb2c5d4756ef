"""Incoherence processing folded into the weights: a random-sign Hadamard rotation of the
residual stream and of each attention head's values (QuaRot / SpinQuant without online
transforms). The result is an ordinary float checkpoint of the same architecture whose logits
equal the original's up to float rounding; quantizing it (any method) spreads each weight
row's outliers over the whole row, so the per-block absmax wastes fewer levels.

    python -m vllm_kbit.quant.rotate SRC DST [--seed 0]     (or: convert --rotate)

Residual rotation Q (orthogonal, hidden x hidden), residual r -> Q^T r:
  * every RMSNorm gain g is folded into the linears that read the normed stream (W -> W diag(g)),
    and the norm's weight becomes 1: RMSNorm(Q^T r) = Q^T RMSNorm(r) once it has no gain;
  * readers of the stream (q/k/v, gate/up, lm_head): W -> W diag(g) Q;
  * writers into it (o_proj, down_proj and their biases, the embedding rows): W -> Q^T W;
  * a tied embedding / lm_head pair stays tied when the final norm's gain is one scalar c
    (E -> E Q serves both; the norm keeps c, which commutes with Q); otherwise lm_head is
    written as its own tensor E diag(g) Q and the config unties it (the float embedding the
    model already holds, once more: noted on stderr).
Per-head rotation R (head_dim x head_dim, one for all heads): v_proj rows -> R per kv head,
o_proj columns -> R^T per attention head (attention mixes values over positions, per head,
linearly, so R passes through it).

Q = diag(random signs) H / sqrt(n), H a Sylvester Hadamard when n is a power of two; otherwise
n = 2^a * m (m odd, e.g. 576 = 64 * 9) and H = H_{2^a} (x) O_m with O_m a random orthogonal
m x m block (QR of a Gaussian) scaled by sqrt(m): as incoherent as a Hadamard within each
2^a-sized factor, exactly orthogonal, and deterministic in the seed.

Exact only for pre-norm decoders with RMSNorm (no mean subtraction) and no norms between a
block's output and the residual add: ROTATABLE lists the architectures; `check_rotatable`
names why others are refused.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch

# model_type -> the per-layer tensors (beyond the common Llama set) it may carry
ROTATABLE = {"llama": (), "mistral": (), "qwen2": (), "qwen3": ("q_norm", "k_norm")}
# why a model_type cannot be folded exactly
_REFUSED = {
    "gemma": "its RMSNorm scales by (1 + weight) and its embedding by sqrt(hidden); not handled",
    "gemma2": "it normalizes the attention and MLP outputs before the residual add (post-norms), "
              "which a rotation of the residual stream does not pass through",
    "gemma3": "it normalizes the attention and MLP outputs before the residual add (post-norms), "
              "which a rotation of the residual stream does not pass through",
    "olmo2": "it normalizes the attention and MLP outputs before the residual add (post-norms)",
    "gpt2": "LayerNorm subtracts the mean, which does not commute with a rotation",
    "opt": "LayerNorm subtracts the mean, which does not commute with a rotation",
    "bloom": "LayerNorm subtracts the mean, which does not commute with a rotation",
    "falcon": "LayerNorm subtracts the mean, which does not commute with a rotation",
    "phi": "LayerNorm subtracts the mean, which does not commute with a rotation",
    "cohere": "LayerNorm subtracts the mean, which does not commute with a rotation",
    "stablelm": "LayerNorm subtracts the mean, which does not commute with a rotation",
    "phi3": "its fused qkv_proj / gate_up_proj tensors are not handled",
}

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_READERS = {"self_attn.q_proj.weight": "input_layernorm", "self_attn.k_proj.weight": "input_layernorm",
            "self_attn.v_proj.weight": "input_layernorm", "mlp.gate_proj.weight": "post_attention_layernorm",
            "mlp.up_proj.weight": "post_attention_layernorm"}
_WRITERS = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight", "mlp.down_proj.bias")
_KEPT = ("self_attn.q_proj.bias", "self_attn.k_proj.bias")
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


class RotationError(ValueError):
    """A checkpoint the rotation cannot fold exactly."""


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def random_hadamard(n: int, gen: torch.Generator) -> torch.Tensor:
    """An orthogonal n x n float64 matrix diag(s) H / sqrt(n) (module docstring)."""
    if n < 1:
        raise RotationError(f"cannot rotate a dimension of size {n}")
    p = n & -n  # the largest power of two dividing n
    m = n // p
    h = _sylvester(p)
    if m > 1:
        o, r = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
        o = o * torch.sign(torch.diagonal(r))  # Haar-distributed, not QR's sign convention
        h = torch.kron(h, (o * m ** 0.5).contiguous())
    signs = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
    return signs[:, None] * h / n ** 0.5


def check_rotatable(config: dict) -> None:
    """Raise RotationError naming why the folding would not be exact for this config."""
    mt = config.get("model_type")
    text = config.get("text_config")
    if isinstance(text, dict) and mt not in ROTATABLE:
        mt = text.get("model_type", mt)
    if mt in _REFUSED:
        raise RotationError(f"--rotate: cannot fold a rotation into model_type {mt!r} exactly: {_REFUSED[mt]}")
    if mt not in ROTATABLE:
        raise RotationError(f"--rotate: model_type {mt!r} is not one whose folding is known to be exact "
                            f"(pre-norm RMSNorm decoders: {', '.join(sorted(ROTATABLE))})")
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):
            raise RotationError(f"--rotate: {mt} with MoE experts ({key}={config[key]}) is not handled")


class Rotator:
    """Maps each tensor of a checkpoint to its rotated form: `rotate(name, t)` -> {name: tensor}."""

    def __init__(self, config: dict, gains: dict[str, torch.Tensor], seed: int = 0, device="cpu"):
        check_rotatable(config)
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads") or self.heads)
        self.head_dim = int(config.get("head_dim") or self.hidden // self.heads)
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        self.q = random_hadamard(self.hidden, gen).to(self.device)
        self.r = random_hadamard(self.head_dim, gen).to(self.device)
        self.gains = {k: v.to(self.device, torch.float64) for k, v in gains.items()}
        self.tied = bool(config.get("tie_word_embeddings", False))
        final = self.gains.get("model.norm.weight")
        if final is None:
            raise RotationError("--rotate: the checkpoint has no model.norm.weight")
        # a tied pair stays tied only when the final gain is a scalar (it then commutes with Q)
        self.keep_final_gain = self.tied and bool(torch.all(final == final[0]))
        self.untie = self.tied and not self.keep_final_gain

    def _gain(self, name: str) -> torch.Tensor:
        g = self.gains.get(name)
        if g is None:
            raise RotationError(f"--rotate: {name} is missing from the checkpoint")
        if g.shape != (self.hidden,):
            raise RotationError(f"--rotate: {name} has shape {tuple(g.shape)}, expected ({self.hidden},)")
        return g

    def _reader(self, w: torch.Tensor, gain: str) -> torch.Tensor:
        return (w * self._gain(gain)) @ self.q

    def _per_head_rows(self, w: torch.Tensor, heads: int) -> torch.Tensor:
        """R applied to each head's block of rows (v_proj weight / bias)."""
        shape = w.shape
        return (self.r @ w.reshape(heads, self.head_dim, -1)).reshape(shape)

    def rotate(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        dtype = t.dtype
        w = t.to(self.device, torch.float64)
        out = self._rotate(name, w)
        return {k: v.to(dtype).cpu().contiguous() for k, v in out.items()}

    def _rotate(self, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        if name == "model.embed_tokens.weight":
            out = {name: w @ self.q}
            if self.untie:
                out["lm_head.weight"] = self._reader(w, "model.norm.weight")
            return out
        if name == "lm_head.weight":
            return {name: self._reader(w, "model.norm.weight")}
        if name == "model.norm.weight":
            return {name: w if self.keep_final_gain else torch.ones_like(w)}
        m = _LAYER.fullmatch(name)
        if m is None:
            raise RotationError(f"--rotate: tensor {name} is not part of a known Llama-style layout")
        layer, leaf = m.group(1), m.group(2)
        if leaf in _NORMS:
            return {name: torch.ones_like(w)}
        if leaf in _READERS:
            w = self._reader(w, f"model.layers.{layer}.{_READERS[leaf]}.weight")
            if leaf == "self_attn.v_proj.weight":
                w = self._per_head_rows(w, self.kv_heads)
            return {name: w}
        if leaf == "self_attn.v_proj.bias":
            return {name: self._per_head_rows(w[:, None], self.kv_heads)[:, 0]}
        if leaf in _WRITERS:
            if leaf == "self_attn.o_proj.weight":  # columns: per attention head, R^T
                n = w.shape[0]
                w = (w.reshape(n, self.heads, self.head_dim) @ self.r.T.unsqueeze(0)).reshape(n, -1)
            return {name: self.q.T @ w}
        if leaf in _KEPT or leaf.split(".")[-2] in ("q_norm", "k_norm"):
            return {name: w}
        raise RotationError(f"--rotate: tensor {name} is not part of a known Llama-style layout "
                            f"(a norm or linear the rotation does not know how to fold)")


def gain_names(names) -> list[str]:
    return [n for n in names if n == "model.norm.weight" or
            (n.endswith("layernorm.weight") and _LAYER.fullmatch(n))]


def rotated_config(config: dict, rot: Rotator) -> dict:
    config = dict(config)
    if rot.untie:
        config["tie_word_embeddings"] = False
    return config


def rotate_checkpoint(src, dst, seed: int = 0, device="cpu", progress: bool = True) -> Path:
    """Write the rotated float checkpoint of the HF folder `src` to `dst` (a new folder): one
    output shard per source shard, every other file copied. Peak host memory: one source shard
    in its dtype, plus its largest tensor in float64."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    check_rotatable(config)
    index = src / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else sorted(p.name for p in src.glob("*.safetensors")))
    if not files:
        raise RotationError(f"--rotate: {src} has no *.safetensors weights")
    names: dict[str, str] = {}
    for f in files:
        with safe_open(str(src / f), framework="pt") as h:
            names.update(dict.fromkeys(h.keys(), f))
    gains = {}
    for n in gain_names(names):
        with safe_open(str(src / names[n]), framework="pt") as h:
            gains[n] = h.get_tensor(n)
    rot = Rotator(config, gains, seed, device)
    if rot.untie:
        print("vllm_kbit.rotate: the final norm's gain is not one scalar, so the tied lm_head cannot "
              "share the rotated embedding: lm_head is written as its own tensor (tie_word_embeddings "
              "false)", file=sys.stderr)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f in tqdm(files, desc="rotate", unit="shard", disable=not progress, file=sys.stderr):
        out = {}
        with safe_open(str(src / f), framework="pt") as h:
            for n in h.keys():
                out.update(rot.rotate(n, h.get_tensor(n)))
        save_file(out, str(dst / f), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, f))
    if index.is_file() or len(files) > 1:
        total = sum((dst / f).stat().st_size for f in files)
        (dst / index.name).write_text(json.dumps({"metadata": {"total_size": total},
                                                  "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    for p in src.iterdir():
        if p.is_file() and p.name not in files and p.name not in ("config.json", index.name) \
                and not p.name.endswith((".safetensors", ".bin", ".pt", ".pth")):
            shutil.copy2(p, dst / p.name)
    (dst / "config.json").write_text(json.dumps(rotated_config(config, rot), indent=2) + "\n")
    return dst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_kbit.quant.rotate",
                                 description="Write a Hadamard-rotated float copy of a Llama-style checkpoint.")
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if Path(args.dst).exists():
        print(f"error: {args.dst} already exists", file=sys.stderr)
        return 1
    try:
        rotate_checkpoint(args.src, args.dst, args.seed, args.device)
    except (RotationError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
