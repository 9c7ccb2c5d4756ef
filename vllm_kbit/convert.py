"""Convert a Hugging Face safetensors checkpoint into a kbit checkpoint (library API and CLI).

    python -m vllm_kbit.convert SRC DST --bits K [--ignore PATTERN ...] [--overwrite]
        [--quantize-lm-head] [--device cpu|cuda] [--codebook JSON_FILE_OR_LIST] [--max-shard-size 2GB]
        [--method rtn|mse|gptq] [--calib TEXT_FILE] [--calib-samples 128] [--fit-codebook]
        [--activations auto|fp8] [--rotate [--rotate-seed 0]]

--bits with a fraction (2.5: any average in [2, 5]) picks K per layer (quant/mixed.py): the
layers vLLM fuses share K, the checkpoint lists every quantized layer's K in
quantization_config.bits_per_layer and each K's codebook in quantization_config.codebooks.
--rotate folds a random-sign Hadamard rotation into a float copy of SRC first (quant/rotate.py;
written beside DST and removed afterwards) and quantizes that: an ordinary checkpoint of the
same architecture whose float logits equal SRC's.

What is quantized: the weight of every `Linear` of the architecture named by SRC/config.json,
found by building that architecture on the meta device with transformers and matching it with
compressed-tensors (`"Linear"` target), except
  * modules matched by the ignore patterns: DEFAULT_IGNORE (lm_head and MoE routers) plus the
    caller's (compressed-tensors semantics: an exact module name, or "re:<regex>" matched
    from the start of the name);
    with quantize_lm_head (`--quantize-lm-head`) lm_head is quantized too, and the config says
    so (`"lm_head": true`, vLLM's key), unless the model ties it to its input embeddings;
  * linears whose in_features is not a multiple of 32: kept, and added by exact module name
    to the config's ignore list.
MoE experts stored per expert (`...experts.{e}.{proj}.weight`, 2-D: Mixtral, Qwen-MoE, DeepSeek)
are quantized like any linear, all experts of a layer or none (`--ignore 're:.*\\.experts(\\..*)?$'`
keeps them float; the layer's name then joins the config's ignore list, which is what vLLM
matches its fused MoE layer against). Experts fused into 3-D tensors (gpt-oss) are refused unless
ignored: vLLM loads those straight into its own float layout.
Each quantized `P.weight` [N, K] becomes `P.qweight` int32 [N, K/32*bits] and `P.absmax` uint8
[N, K/32] (format.quantize's layout); every other tensor (embeddings, norms, biases, ignored
linears, checkpoint names that map to no module) is copied byte for byte. If transformers
cannot build the architecture, or none of its linear weights appear in the checkpoint (keys
renamed by the architecture), a name heuristic picks the linears instead (see
`_heuristic_linears`) and says so on stderr.

Memory: tensors are streamed one at a time from SRC and output shards are flushed as soon as
they reach max_shard_size, so peak host memory is about max_shard_size + the largest tensor +
the quantizer's working set for it (a float32 copy, plus up to 256 MiB of scratch on the CPU).

Atomicity: everything is written into a hidden temporary folder beside DST, which is renamed
to DST only once complete; an existing DST (with overwrite) is removed only after that. On any
error, Ctrl-C or SIGTERM the temporary folder is removed and an existing DST is left as it was;
one that a killed conversion (SIGKILL, power loss) left is removed by the next conversion to
the same DST once its process is gone. Every source shard is checked to be complete, and every
weight to quantize to be in range, before anything is written.
"""
from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import os
import re
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_kbit import format as kf
from vllm_kbit.format import FUSED_GROUPS, ROUTER_PATTERN, KbitFormatError
from vllm_kbit.fp8 import ACTIVATIONS, check_activations
from vllm_kbit.quant import METHODS, default_codebook

# See docs/FORMAT.md ("Choosing a method") for the measurement behind the default.
DEFAULT_METHOD = "mse"

# lm_head, and the MoE routers (format.ROUTER_PATTERN)
LM_HEAD = "lm_head"
DEFAULT_IGNORE = (LM_HEAD, ROUTER_PATTERN)
# One expert's linear weight, stored per expert: LAYER.experts.E.PROJ.weight.
_EXPERT_RE = re.compile(r"(?P<layer>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.weight")
# All experts of a layer in one tensor: LAYER.experts.NAME (3-D).
_FUSED_EXPERTS_RE = re.compile(r"(?P<layer>.*\.experts)\.[^.]+")

INDEX_NAME = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_WEIGHT_INDEXES = re.compile(r".*\.(safetensors|bin|pt|pth)\.index\.json$")
# Fallback: 2-D weights inside a numbered decoder block.
_LAYER_RE = re.compile(r"(^|\.)(layers|h|blocks)\.\d+\.")
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]i?b|b)?\s*", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConversionError(ValueError):
    """Bad input to the converter (paths, options, checkpoint layout)."""


@dataclass
class ConversionReport:
    src: str
    dst: str
    bits: int
    quantized: list[str] = field(default_factory=list)          # source names now stored as .qweight/.absmax
    skipped: dict[str, str] = field(default_factory=dict)       # weight name -> why it stayed unquantized
    ignore: list[str] = field(default_factory=list)             # the config's quantization_config.ignore
    copied_files: list[str] = field(default_factory=list)       # non-weight files copied from SRC
    not_copied: list[str] = field(default_factory=list)         # SRC entries left out (weights in other formats, folders)
    underflow_blocks: dict[str, int] = field(default_factory=dict)  # name -> non-zero blocks stored as zeros
    quantized_sizes: dict[str, int] = field(default_factory=dict)   # mixed K: module -> weights
    unmapped_2d: list[str] = field(default_factory=list)        # 2-D tensors of no known Linear, copied as is
    used_heuristic: bool = False
    num_shards: int = 0
    bytes_in: int = 0    # tensor bytes read
    bytes_out: int = 0   # tensor bytes written (the index's total_size)
    bits_per_layer: dict[str, int] = field(default_factory=dict)  # mixed K: module -> K
    rotated: bool = False

    def summary(self) -> str:
        k = (f"mixed (average {_mixed_average(self.bits_per_layer, self.quantized_sizes):.3f}, "
             f"{_k_counts(self.bits_per_layer)})" if self.bits_per_layer else self.bits)
        lines = [f"kbit K={k}{' rotated' if self.rotated else ''}: {_count(len(self.quantized), 'linear weight')} quantized, "
                 f"{len(self.skipped)} left unquantized, {_count(len(self.copied_files), 'file')} copied",
                 f"  tensors: {_fmt_bytes(self.bytes_in)} -> {_fmt_bytes(self.bytes_out)} "
                 f"in {self.num_shards} shard(s)"]
        by_why: dict[str, list[str]] = {}
        for name, why in self.skipped.items():
            by_why.setdefault(why, []).append(name)
        for why, names in by_why.items():  # (an MoE's experts: hundreds of weights, one reason)
            lines += ([f"  unquantized {name}: {why}" for name in names] if len(names) <= 4 else
                      [f"  unquantized {len(names)} weights ({names[0]}, ...): {why}"])
        if self.unmapped_2d:
            lines.append(f"  {len(self.unmapped_2d)} 2-D weight(s) of no known Linear copied unquantized")
        lines += [f"  underflow {name}: {n} block(s) stored as zeros" for name, n in self.underflow_blocks.items()]
        if self.used_heuristic:
            lines.append("  linears found by the name heuristic (transformers could not map the architecture)")
        lines.append(f"  wrote {self.dst}")
        return "\n".join(lines)


@dataclass
class _Item:
    file: Path
    name: str
    nbytes: int
    quantize: bool
    out_nbytes: int


def parse_size(size: int | str) -> int:
    """Bytes in a size such as "2GB" (10^9), "512MiB" (2^20), "100KB", or an int."""
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE_RE.fullmatch(str(size))
        if not m:
            raise ConversionError(f"bad size {size!r} (examples: 2GB, 500MB, 4GiB)")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])
    if value <= 0:
        raise ConversionError(f"size must be positive, got {size!r}")
    return value


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# Whether convert() runs for the command line: its errors then name options as the CLI spells
# them (--calib-samples), and as the Python API does (calib_samples=) otherwise.
_FOR_CLI = contextvars.ContextVar("kbit_convert_for_cli", default=False)


@contextlib.contextmanager
def cli_spelling():
    """Within it, convert()'s errors name options as the command line spells them (for scripts
    with options of the same names, as `main` and examples/convert_hf_model.py)."""
    token = _FOR_CLI.set(True)
    try:
        yield
    finally:
        _FOR_CLI.reset(token)


def _opt(name: str, value: str | None = None) -> str:
    """An option as the caller spells it: `--overwrite` / `overwrite=True`."""
    if _FOR_CLI.get():
        return "--" + name.replace("_", "-") + ("" if value is None else f" {value}")
    return f"{name}={'True' if value is None else value}"


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _note(msg: str) -> None:
    print(f"vllm_kbit.convert: {msg}", file=sys.stderr)


# ----------------------------------------------------------------------------- reading SRC

def _read_config(src: Path) -> dict:
    if not src.is_dir():
        raise ConversionError(f"SRC {src} is not a folder" if src.exists() else f"SRC {src} does not exist")
    path = src / "config.json"
    if not path.is_file():
        raise ConversionError(f"{src} has no config.json (expected a Hugging Face model folder)")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise ConversionError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: expected a JSON object (a model configuration), got a "
                              f"{type(config).__name__}")
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "?")
        raise ConversionError(f"{src} is already quantized (quantization_config with quant_method "
                              f"{method!r}); convert the unquantized checkpoint")
    return config


def _weight_files(src: Path) -> list[Path]:
    index = src / INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise ConversionError(f"{index}: not a safetensors index ({e})") from None
        missing = [n for n in names if not (src / n).is_file()]
        if missing:
            raise ConversionError(f"{index} lists missing file(s): {', '.join(missing)}")
        return [src / n for n in names]
    if (src / "model.safetensors").is_file():
        return [src / "model.safetensors"]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in src.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
        hint = f" (found {', '.join(others)}: convert them to safetensors first)" if others else ""
        raise ConversionError(f"{src} has no *.safetensors weights{hint}")
    return files


def _header(path: Path) -> dict:
    """The safetensors header: {name: {"dtype", "shape", "data_offsets"}} (cheap: no tensor data)."""
    with open(path, "rb") as f:
        try:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if n < 100_000_000 else None  # the format's own cap
        except (struct.error, ValueError):
            header = None
    if not isinstance(header, dict):
        raise ConversionError(f"{path} is not a safetensors file")
    header.pop("__metadata__", None)
    _check_complete(path, n, header)
    return header


def _check_complete(path: Path, header_len: int, header: dict) -> None:
    """The tensor data the header describes must fill the rest of the file exactly (what
    safetensors itself requires when the tensor is read): a truncated download or copy is found
    here, before anything is written, rather than mid-way through the conversion."""
    try:
        end = max((int(info["data_offsets"][1]) for info in header.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise ConversionError(f"{path} is not a safetensors file (a tensor entry without data_offsets)") from None
    held = os.path.getsize(path) - 8 - header_len
    if end != held:
        what = "truncated" if end > held else "longer than its header says"
        raise ConversionError(
            f"{path} is {what}: its header describes {end} bytes of tensor data, the file holds {held} "
            f"(an incomplete download or copy?); fetch it again")


# ----------------------------------------------------------------------------- which tensors

def _meta_model(src: Path):
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        cfg = transformers.AutoConfig.from_pretrained(src)
        with torch.device("meta"):
            for arch in getattr(cfg, "architectures", None) or []:
                cls = getattr(transformers, arch, None)
                if cls is not None:
                    return cls(cfg)
            return transformers.AutoModelForCausalLM.from_config(cfg)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _heuristic_linears(shapes: dict[str, list[int]]) -> dict[str, None]:
    """Module names of 2-D `*.weight` tensors inside numbered decoder blocks (`.layers.N.`,
    `.h.N.`, `.blocks.N.`) that are not embeddings. Assumes [out, in] weights (not GPT-2's Conv1D)."""
    return {name[:-len(".weight")]: None for name, shape in shapes.items()
            if name.endswith(".weight") and len(shape) == 2 and _LAYER_RE.search(name)
            and "embed" not in name}


def _find_linears(src: Path, shapes: dict[str, list[int]]) -> tuple[dict, bool]:
    """{module name: module or None} of the Linears whose weight is in the checkpoint, and
    whether the name heuristic was used."""
    from compressed_tensors.utils import match_named_modules

    try:
        model = _meta_model(src)
    except Exception as e:  # any failure to build the architecture means: use the heuristic
        why = f"transformers cannot build the architecture ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    else:
        linears = {name: module for name, module in match_named_modules(model, ["Linear"])
                   if f"{name}.weight" in shapes}
        if linears:
            return linears, False
        why = "none of the architecture's Linear weights are named as in the checkpoint"
    _note(f"{why}; picking linears by name instead: 2-D '*.weight' tensors inside "
          f"'.layers.N.' / '.h.N.' / '.blocks.N.' that are not embeddings")
    return _heuristic_linears(shapes), True


def _matching_pattern(name: str, module, patterns: list[str]) -> str | None:
    from compressed_tensors.utils import is_match, match_name

    for p in patterns:
        if is_match(name, module, p) if module is not None else match_name(name, p):
            return p
    return None


def _select(linears: dict, shapes: dict, user_ignore: list[str], report: ConversionReport,
            quantize_lm_head: bool = False) -> tuple[set[str], set[str]]:
    """Weight names to quantize, and the ignore patterns that matched a linear; fills
    report.skipped and report.ignore (the config's list)."""
    default = [p for p in DEFAULT_IGNORE if not (quantize_lm_head and p == LM_HEAD)]
    patterns = list(dict.fromkeys([*default, *user_ignore]))
    used, auto_ignore, selected = set(), [], set()
    for mod_name, module in linears.items():
        wname = f"{mod_name}.weight"
        if _EXPERT_RE.fullmatch(wname):
            continue  # _select_experts
        shape = shapes[wname]
        pattern = _matching_pattern(mod_name, module, patterns)
        if pattern is not None:
            used.add(pattern)
            report.skipped[wname] = f"ignored (matches {pattern!r})"
        elif len(shape) != 2 or shape[1] % kf.BLOCK_SIZE:
            why = (f"in_features {shape[1]} is not a multiple of {kf.BLOCK_SIZE}" if len(shape) == 2
                   else f"weight is not 2-D (shape {shape})")
            report.skipped[wname] = why
            auto_ignore.append(mod_name)  # exact name, so vLLM keeps this layer unquantized too
            _note(f"{mod_name} left unquantized: {why}")
        else:
            selected.add(wname)
    _check_fused_groups(linears, selected)
    report.ignore = list(dict.fromkeys([*patterns, *auto_ignore]))
    return selected, used


def _select_experts(linears: dict, shapes: dict, report: ConversionReport) -> tuple[set[str], set[str]]:
    """Expert weight names to quantize, and the ignore patterns that matched: per MoE layer, all
    of its per-expert 2-D weights, unless an ignore pattern matches the layer or its experts
    (then none, and the layer's exact name joins report.ignore if no pattern names it). Refuses
    a layer whose experts would be split between kbit and float (vLLM runs them as one fused
    layer) and un-ignored 3-D fused experts."""
    patterns = list(report.ignore)
    layers: dict[str, list[str]] = {}
    selected, used = set(), set()
    for name, shape in shapes.items():
        m = _EXPERT_RE.fullmatch(name)
        if m and len(shape) == 2:
            layers.setdefault(m["layer"], []).append(name)
        elif len(shape) == 3 and (f := _FUSED_EXPERTS_RE.fullmatch(name)):
            pattern = _matching_pattern(f["layer"], None, patterns)
            if pattern is not None:
                used.add(pattern)
                continue
            raise ConversionError(
                f"{name} holds all experts of {f['layer']} in one 3-D tensor {shape}; vLLM loads such "
                f"tensors straight into its own float layout, so kbit experts cannot be served for this "
                f"architecture: keep them unquantized with --ignore 're:.*\\.experts(\\..*)?$'")
    for layer, names in layers.items():
        why = {}
        layer_pattern = _matching_pattern(layer, None, patterns)
        for name in names:
            mod = name[:-len(".weight")]
            pattern = layer_pattern or _matching_pattern(mod, linears.get(mod), patterns)
            if pattern is not None:
                used.add(pattern)
                why[name] = f"ignored (matches {pattern!r})"
            elif shapes[name][1] % kf.BLOCK_SIZE:
                why[name] = f"in_features {shapes[name][1]} is not a multiple of {kf.BLOCK_SIZE}"
        if why and len(why) < len(names):
            raise ConversionError(
                f"{layer}: {len(why)} of its {len(names)} expert weights would stay unquantized "
                f"({next(iter(why))}: {next(iter(why.values()))}) but the others would not; vLLM runs "
                f"the experts of a layer as one fused layer, which needs one scheme: ignore all of them or none")
        if not why:
            selected.update(names)
            continue
        report.skipped.update(why)
        if layer_pattern is None:
            _note(f"{layer}: experts left unquantized ({next(iter(why.values()))})")
            report.ignore.append(layer)  # exact name: vLLM matches its fused MoE layer by it
    return selected, used


def _ties_embeddings(src: Path, config: dict) -> bool:
    """tie_word_embeddings as transformers resolves it (a class default when config.json is silent)."""
    try:
        import transformers
        return bool(transformers.AutoConfig.from_pretrained(src).get_text_config().tie_word_embeddings)
    except Exception:  # an architecture transformers does not know: config.json alone, whose
        # silence means tied (PretrainedConfig's default), so lm_head stays float
        text = config.get("text_config") or {}
        return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))


def _check_lm_head(src: Path, config: dict, linears: dict, shapes: dict, selected: set[str], report: ConversionReport) -> None:
    """quantize_lm_head needs an untied `lm_head` Linear that is being quantized."""
    if _ties_embeddings(src, config):
        raise ConversionError("--quantize-lm-head: this model ties lm_head to its input embeddings "
                              "(tie_word_embeddings, true unless the config says false), which vLLM "
                              "reads as a float table")
    wname = f"{LM_HEAD}.weight"
    if wname not in shapes:
        raise ConversionError(f"--quantize-lm-head: the checkpoint has no {wname}")
    if LM_HEAD not in linears:
        raise ConversionError(f"--quantize-lm-head: {wname} is not the weight of a Linear the "
                              f"converter recognised in this architecture")
    if wname not in selected:
        raise ConversionError(f"--quantize-lm-head: {LM_HEAD} stays unquantized ({report.skipped.get(wname)})")


# Checkpoint linears that vLLM fuses into one layer (its models' packed_modules_mapping:
# qkv_proj, gate_up_proj). vLLM needs one scheme per fused layer.
def _check_fused_groups(linears: dict, selected: set[str]) -> None:
    for mod_name in linears:
        parent, _, leaf = mod_name.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf != group[0]:
                continue
            members = [f"{parent}.{g}" if parent else g for g in group]
            members = [m for m in members if m in linears]
            quantized = {m: f"{m}.weight" in selected for m in members}
            if len(set(quantized.values())) > 1:
                kept = [m for m, q in quantized.items() if not q]
                raise ConversionError(
                    f"{', '.join(kept)} would stay unquantized but {', '.join(m for m in members if m not in kept)} "
                    f"would not: vLLM fuses {', '.join(members)} into one layer, which needs one scheme; "
                    f"ignore all of them or none")


# ----------------------------------------------------------------------------- checks before writing

def _check_ranges(items: list[_Item], device: torch.device, progress: bool) -> None:
    """Every floating-point tensor of SRC must be finite: NaN or Inf anywhere means a corrupt
    source, refused whatever is ignored (a float copy would serve it). Every weight to quantize
    must also have its block absmax within E4M4 (a larger one would be clipped). Each tensor is
    read once more (streamed, one at a time) so that all offenders are reported together,
    before anything is written."""
    from safetensors import safe_open
    from tqdm import tqdm

    bad: dict[str, str] = {}
    corrupt: list[str] = []
    for it in tqdm(items, unit="tensor", desc="kbit range check", disable=not progress, file=sys.stderr):
        with safe_open(str(it.file), framework="pt") as f:
            t = f.get_tensor(it.name)
        if t.numel() == 0 or not t.is_floating_point():
            continue
        if t.element_size() == 1:  # float8: aminmax has no kernel for it
            t = t.float()
        lo, hi = torch.aminmax(t.to(device))
        top = max(-float(lo), float(hi))
        if top != top or top == float("inf"):
            corrupt.append(it.name)
        elif it.quantize and top > kf.E4M4_MAX:
            bad[it.name] = f"max |w| = {top:.4g}"
        del t
    if corrupt:
        shown = ", ".join(corrupt[:8]) + (f" and {len(corrupt) - 8} more" if len(corrupt) > 8 else "")
        raise KbitFormatError(
            f"{_count(len(corrupt), 'tensor')} of SRC {'holds' if len(corrupt) == 1 else 'hold'} NaN or Inf "
            f"values: {shown}. A trained checkpoint "
            f"has none; the source is corrupt (fetch it again, or re-export it from the training run)")
    if not bad:
        return
    modules = [name[:-len(".weight")] for name in bad]
    ignore = []
    for mod in modules:  # vLLM fuses some linears into one layer: ignore all of them or none
        expert = _EXPERT_RE.fullmatch(f"{mod}.weight")
        if expert:  # a layer's experts: vLLM runs them as one fused layer, named by the layer
            ignore.append(expert["layer"])
            continue
        parent, _, leaf = mod.rpartition(".")
        group = next((g for g in FUSED_GROUPS if leaf in g), (leaf,))
        ignore += [f"{parent}.{g}" if parent else g for g in group]
    ignore = list(dict.fromkeys(ignore))
    raise KbitFormatError(
        f"{len(bad)} weight(s) cannot be quantized (a block absmax above the E4M4 range, max "
        f"{kf.E4M4_MAX}, would be clipped): "
        + "; ".join(f"{name} ({why})" for name, why in bad.items())
        + ". Keep them unquantized: " + " ".join(f"--ignore {m}" for m in ignore) + " (or rescale them)")


# ----------------------------------------------------------------------------- interruption

class _Terminated(BaseException):
    """SIGTERM during convert: unwinds like KeyboardInterrupt, so the temporary folder goes."""


@contextlib.contextmanager
def _sigterm_unwinds():
    """While converting, SIGTERM (kill, timeout, container stop) unwinds convert() as Ctrl-C
    does, removing the temporary folder; the previous handler then gets the signal (the default
    one ends the process, whose status says terminated). Only the main thread gets signals."""
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_IGN, None) or threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        raise _Terminated()

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    except _Terminated:
        _note("terminated (SIGTERM): nothing written, temporary folder removed")
        signal.signal(signal.SIGTERM, previous)
        signal.raise_signal(signal.SIGTERM)
        raise InterruptedError("conversion terminated by SIGTERM; nothing written") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _temp_prefix(dst: Path) -> str:
    return f".{dst.name}.kbit-tmp-"


def _owner_tag() -> str:
    """host-pid: who writes a temporary folder, so a later run can tell a dead one."""
    return f"{re.sub(r'[^A-Za-z0-9]', '', socket.gethostname()) or 'host'}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process
        return True
    return True


def _clear_stale_temps(dst: Path) -> None:
    """Remove temporary folders that earlier conversions to `dst` on this host left behind when
    killed (SIGKILL, power loss); report those that may belong to one still running."""
    prefix = _temp_prefix(dst)
    if not dst.parent.is_dir():
        return
    host = _owner_tag().rpartition("-")[0]
    for name in sorted(os.listdir(dst.parent)):
        if not name.startswith(prefix):
            continue
        path = dst.parent / name
        m = re.fullmatch(r"(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)-.+", name[len(prefix):])
        if m and m["host"] == host and not _pid_alive(int(m["pid"])):
            shutil.rmtree(path, ignore_errors=True)
            _note(f"removed {path}, left by an interrupted conversion (process {m['pid']} is gone)")
        else:
            owner = f"process {m['pid']} on {m['host']}" if m else "an unknown process"
            _note(f"{path} may belong to a conversion still running ({owner}); if none is, remove it")


# ----------------------------------------------------------------------------- writing DST

def _copy_other_files(src: Path, out: Path, report: ConversionReport) -> None:
    """Tokenizer, generation config, chat templates, README...: every top-level file of SRC
    except weights, weight indexes and config.json (rewritten)."""
    for p in sorted(src.iterdir()):
        if p.name.startswith("."):
            continue
        if not p.is_file() or p.name == "config.json":
            if p.is_dir():
                report.not_copied.append(p.name + "/")
            continue
        if p.suffix in _WEIGHT_SUFFIXES or _WEIGHT_INDEXES.fullmatch(p.name):
            report.not_copied.append(p.name)
            continue
        shutil.copy2(p, out / p.name)  # follows symlinks (HF cache snapshots)
        report.copied_files.append(p.name)


def _install(tmp: Path, dst: Path) -> None:
    """Move the finished `tmp` to `dst`; an existing `dst` is removed only once `tmp` is in place."""
    if not (dst.exists() or dst.is_symlink()):
        os.replace(tmp, dst)
        return
    old = dst.parent / f".{dst.name}.kbit-old-{uuid.uuid4().hex[:8]}"
    os.replace(dst, old)
    try:
        os.replace(tmp, dst)
    except BaseException:
        os.replace(old, dst)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()


def _write_shards(items: list[_Item], out: Path, bits: int, codebook: torch.Tensor,
                  device: torch.device, shard_limit: int, progress: bool,
                  report: ConversionReport, plan=None) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    from vllm_kbit import ops

    # Sizes are known from the headers, so shards are planned first and get final names.
    shards: list[list[_Item]] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.out_nbytes > shard_limit:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.out_nbytes
    n = len(shards)
    weight_map = {}
    with tqdm(total=len(items), unit="tensor", desc="kbit convert", disable=not progress,
              file=sys.stderr) as bar:
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{n:05d}.safetensors"
            tensors = {}
            for it in shard:
                # One open per tensor keeps only that tensor's pages of SRC mapped.
                with safe_open(str(it.file), framework="pt") as f:
                    t = f.get_tensor(it.name)
                if it.quantize:
                    prefix = it.name[:-len(".weight")]
                    if plan is None:  # rtn with the config's codebook: the quantize kernel
                        q, a, underflow = ops.quantize(t.to(device), bits, codebook, it.name)
                    else:
                        underflow = kf.check_quantizable(t, it.name)
                        q, a, layer_cb = plan(it.name, t)
                        if layer_cb is not None:
                            tensors[f"{prefix}.codebook"] = layer_cb.float().clone()  # own storage per tensor
                    tensors[f"{prefix}.qweight"], tensors[f"{prefix}.absmax"] = q.cpu(), a.cpu()
                    if underflow:
                        report.underflow_blocks[it.name] = underflow
                else:
                    tensors[it.name] = t
                del t
                bar.update(1)
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
            os.chmod(out / fname, 0o666 & ~_umask())  # safetensors writes 0600
            weight_map.update(dict.fromkeys(tensors, fname))
            report.bytes_out += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
    index = {"metadata": {"total_size": report.bytes_out}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    report.num_shards = n


# ----------------------------------------------------------------------------- argument checks

def _check_calib_text(path: Path) -> None:
    """gptq's calibration file must be plain UTF-8 text: checked before any model is loaded."""
    opt = _opt("calib", str(path))
    if not path.is_file():
        raise ConversionError(f"{opt}: no such file" if not path.exists() else f"{opt}: not a file")
    data = path.read_bytes()
    try:
        data.decode("utf-8")
        bad = data.find(b"\0")
    except UnicodeDecodeError as e:
        bad = e.start
    if bad >= 0:
        raise ConversionError(f"{opt}: not a plain-text (UTF-8) file (byte 0x{data[bad]:02x} at offset {bad}); "
                              f"gptq calibrates on text")


def _check_tokenizer(src: Path) -> None:
    """gptq turns calibration text (or the text the model samples) into tokens with SRC's tokenizer."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        transformers.AutoTokenizer.from_pretrained(src)
    except Exception as e:  # transformers raises many kinds here: all mean "no usable tokenizer"
        raise ConversionError(
            f"{_opt('method', 'gptq')} needs SRC's tokenizer (tokenizer.json, or tokenizer.model with "
            f"tokenizer_config.json, in {src}) and transformers cannot load one "
            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); copy the model's tokenizer files "
            f"into {src}, or use {_opt('method', 'mse')}, which needs none") from None
    finally:
        transformers.logging.set_verbosity(verbosity)


def _refuse_nothing_to_quantize(linears: dict, report: ConversionReport) -> None:
    """A kbit checkpoint without a kbit weight is a mistake (an ignore pattern that matches
    everything, an architecture whose linears were not found): say why each stayed float."""
    reasons = list(dict.fromkeys(report.skipped.values()))
    why = f": {'; '.join(reasons[:3])}" if reasons else ""
    found = (f"of the {_count(len(linears), 'linear layer')} found, none is left to quantize{why}" if linears
             else "no linear layer was found in the checkpoint")
    raise ConversionError(f"nothing to quantize: {found}; a kbit checkpoint needs at least one kbit weight")


# ----------------------------------------------------------------------------- methods

def _make_plan(src: Path, items: list[_Item], bits: int, cb: torch.Tensor, device: torch.device,
               method: str, fit_codebook: bool, calib: str | None, calib_samples: int, progress: bool,
               bits_of: dict[str, int] | None = None):
    """None for plain rtn (the quantize kernel, tensor by tensor); else a quant.plan.Plan with
    its codebooks fitted and, for gptq, the calibrated quantization done."""
    if method == "rtn" and not fit_codebook and not bits_of:
        return None
    from safetensors import safe_open

    from vllm_kbit.quant.calibrate import CalibrationError
    from vllm_kbit.quant.plan import Plan

    where = {it.name: it.file for it in items if it.quantize}

    def read(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name)

    plan = Plan(method, bits, cb, device, fit=fit_codebook, bits_of=bits_of,
                codebooks_of={k: default_codebook(k) for k in set((bits_of or {}).values())})
    if fit_codebook:
        plan.fit_codebooks(list(where), read, progress)
    if method == "gptq":
        try:
            plan.run_gptq(src, set(where), calib, progress, samples=calib_samples)
        except CalibrationError as e:
            raise ConversionError(str(e)) from None
    return plan


# ----------------------------------------------------------------------------- API

@_sigterm_unwinds()
def convert(src, dst, bits: int, *, ignore=(), codebook=None, overwrite: bool = False,
            device: str | torch.device | None = None, max_shard_size: int | str = "2GB",
            progress: bool = True, quantize_lm_head: bool = False, method: str = DEFAULT_METHOD,
            calib: str | None = None, calib_samples: int = 128, fit_codebook: bool = False,
            activations: str = "auto", rotate: bool = False, rotate_seed: int = 0) -> ConversionReport:
    """Write a kbit checkpoint of the HF safetensors model folder `src` to `dst` (see the module
    docstring). `ignore`: extra compressed-tensors patterns of modules to keep unquantized;
    `quantize_lm_head`: quantize the output projection too (smaller and faster per decode step,
    with the lm_head's rounding error on every logit);
    `codebook`: 2^bits ascending floats in [-1, 1] (default quant.default_codebook, the
    normal-float codebook with a zero level); `method`: rtn, mse or gptq (quant/rounding.py;
    gptq runs the model over `calib`, a plain-text file, or over text the model samples);
    `fit_codebook`: store a Lloyd-Max codebook per layer (one per fused q/k/v and gate/up group);
    `activations`: the config's `activations` ("auto": the model's dtype; "fp8": e4m3 with
    per-token scales on the tensor-core paths, docs/FP8.md);
    `device`: where to quantize (default cuda when available). Raises ConversionError or
    KbitFormatError (naming the tensor) on bad input, leaving nothing behind.
    `bits` with a fraction (2.5): K per layer for that average (module docstring);
    `rotate`: quantize a Hadamard-rotated copy of src (quant/rotate.py, seeded by rotate_seed)."""
    if rotate:
        return _convert_rotated(src, dst, bits, rotate_seed, dict(
            ignore=ignore, codebook=codebook, overwrite=overwrite, device=device, max_shard_size=max_shard_size,
            progress=progress, quantize_lm_head=quantize_lm_head, method=method, calib=calib,
            calib_samples=calib_samples, fit_codebook=fit_codebook, activations=activations))
    bits, average = _split_bits(bits)
    if average is not None and codebook is not None:
        raise ConversionError(f"--codebook holds one K's levels; --bits {average} picks K per layer "
                              f"(each K uses its default codebook)")
    kf.check_bits(bits)
    cb = default_codebook(bits) if codebook is None else kf.check_codebook(codebook, bits)
    if method not in METHODS:
        raise ConversionError(f"{_opt('method', repr(method))}: must be one of {', '.join(METHODS)}")
    try:
        check_activations(activations, "activations")
    except ValueError as e:
        raise ConversionError(str(e).removeprefix("kbit: ")) from None
    if calib_samples < 1:
        raise ConversionError(f"{_opt('calib_samples', str(calib_samples))}: must be at least 1")
    if calib is not None and method != "gptq" and average is None:
        raise ConversionError(f"{_opt('calib', str(calib))} is only used by {_opt('method', 'gptq')} "
                              f"(got {_opt('method', method)})")
    if calib is not None:
        _check_calib_text(Path(calib))
    shard_limit = parse_size(max_shard_size)
    user_ignore = [ignore] if isinstance(ignore, str) else list(ignore)
    for p in user_ignore:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise ConversionError(f"{_opt('ignore', repr(p))}: bad regex ({e})") from None
    try:
        dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, ValueError) as e:
        raise ConversionError(f"{_opt('device', repr(device))}: not a device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConversionError(f"{_opt('device', 'cuda')}: CUDA is not available on this machine")

    src, dst = Path(src), Path(dst)
    config = _read_config(src)
    files = _weight_files(src)
    if dst.resolve() == src.resolve() or dst.resolve() in src.resolve().parents:
        raise ConversionError(f"DST {dst} would replace SRC {src}; choose another DST")
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise ConversionError(f"DST {dst} already exists; use {_opt('overwrite')} to replace it")
    if method == "gptq":
        _check_tokenizer(src)

    report = ConversionReport(src=str(src), dst=str(dst), bits=bits)
    headers = {f: _header(f) for f in files}
    shapes = {}
    for f, h in headers.items():
        for name, info in h.items():
            if name in shapes:
                raise ConversionError(f"tensor {name} appears in more than one safetensors file")
            shapes[name] = info["shape"]
    linears, report.used_heuristic = _find_linears(src, shapes)
    to_quantize, used = _select(linears, shapes, user_ignore, report, quantize_lm_head)
    experts, used_by_experts = _select_experts(linears, shapes, report)
    to_quantize |= experts
    used |= used_by_experts
    if quantize_lm_head:
        _check_lm_head(src, config, linears, shapes, to_quantize, report)
    for n, s in shapes.items():
        mod = n[:-len(".weight")]
        if len(s) != 2 or not n.endswith(".weight") or mod in linears or "embed" in n or _EXPERT_RE.fullmatch(n):
            continue
        pattern = _matching_pattern(mod, None, report.ignore)
        if pattern is not None:
            used.add(pattern)
            report.skipped[n] = f"ignored (matches {pattern!r})"
        else:  # copied unquantized: if vLLM builds a linear layer for one, it must not expect kbit tensors
            report.unmapped_2d.append(n)
            report.ignore.append(mod)  # (no pattern matched it, so it is not listed yet)
    for p in user_ignore:
        if p not in used:
            _note(f"ignore pattern {p!r} matches no linear layer")
    if not to_quantize:
        _refuse_nothing_to_quantize(linears, report)

    bits_of = None
    if average is not None:
        bits_of = _mixed_bits(src, to_quantize, average, calib, calib_samples, dev, progress)
        report.bits_per_layer = {n[:-len(".weight")]: k for n, k in sorted(bits_of.items())}
        report.quantized_sizes = {n[:-len(".weight")]: shapes[n][0] * shapes[n][1] for n in bits_of}
        bits = _k_nominal(report.bits_per_layer, report.quantized_sizes)
        report.bits = bits
        cb = default_codebook(bits)
    items = []
    for f, h in headers.items():
        for name, info in sorted(h.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            start, end = info["data_offsets"]
            if name in to_quantize:
                n, k = info["shape"]
                kb = bits_of.get(name, bits) if bits_of else bits
                items.append(_Item(f, name, end - start, True, n * (k // kf.BLOCK_SIZE) * (4 * kb + 1)))
            else:
                items.append(_Item(f, name, end - start, False, end - start))
    report.bytes_in = sum(it.nbytes for it in items)

    config["quantization_config"] = {
        "quant_method": "kbit", "bits": bits, "block_size": kf.BLOCK_SIZE, "absmax_format": "e4m4",
        "codebook": [float(v) for v in cb], "ignore": report.ignore, "activations": activations}
    if quantize_lm_head:
        config["quantization_config"]["lm_head"] = True
    if fit_codebook:
        config["quantization_config"]["codebook_per_layer"] = True
    if bits_of:
        qc = config["quantization_config"]
        qc["bits_per_layer"] = report.bits_per_layer
        qc["codebooks"] = {str(k): [float(v) for v in default_codebook(k)] for k in sorted(set(bits_of.values()))}

    _check_ranges(items, dev, progress)
    dst.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale_temps(dst)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_temp_prefix(dst)}{_owner_tag()}-", dir=dst.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would make DST private
        plan = _make_plan(src, items, bits, cb, dev, method, fit_codebook, calib, calib_samples, progress, bits_of)
        _write_shards(items, tmp, bits, cb, dev, shard_limit, progress, report, plan)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _copy_other_files(src, tmp, report)
        _install(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.quantized = [it.name for it in items if it.quantize]
    return report


# ----------------------------------------------------------------------------- mixed K, rotation

def _split_bits(bits) -> tuple[int, float | None]:
    """(K, None) for a whole number of bits; (floor, average) for a fractional average."""
    from vllm_kbit.quant.mixed import MixedBitsError, check_average

    if isinstance(bits, int) and not isinstance(bits, bool):
        return bits, None
    try:
        b = check_average(bits)
    except MixedBitsError as e:
        raise ConversionError(str(e)) from None
    return (int(b), None) if b.is_integer() else (int(b), b)


def _k_counts(bits_per_layer: dict[str, int]) -> str:
    counts: dict[int, int] = {}
    for k in bits_per_layer.values():
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{n} layer(s) at K={k}" for k, n in sorted(counts.items()))


def _mixed_average(bits_per_layer: dict[str, int], sizes: dict[str, int]) -> float:
    return sum(k * sizes[m] for m, k in bits_per_layer.items()) / max(1, sum(sizes.values()))


def _k_nominal(bits_per_layer: dict[str, int], sizes: dict[str, int]) -> int:
    """The K holding the most weights: the config's `bits` (layers not listed would use it)."""
    by_k: dict[int, int] = {}
    for m, k in bits_per_layer.items():
        by_k[k] = by_k.get(k, 0) + sizes[m]
    return max(by_k, key=lambda k: (by_k[k], -k))


def _mixed_bits(src: Path, to_quantize: set[str], average: float, calib: str | None, calib_samples: int,
                device: torch.device, progress: bool) -> dict[str, int]:
    """{weight name: K} for the average (quant/mixed.py), measured on the calibration text."""
    import transformers

    from vllm_kbit.quant import mixed
    from vllm_kbit.quant.calibrate import CalibrationError
    from vllm_kbit.quant.plan import calibration_batches

    experts = sorted(n for n in to_quantize if _EXPERT_RE.fullmatch(n))
    if experts:
        raise ConversionError(f"--bits {average}: K per layer is not supported for MoE experts ({experts[0]}, ...); "
                              f"use a whole --bits or keep the experts unquantized with --ignore")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype="auto").eval()
        batches = calibration_batches(model, src, calib, calib_samples, 512, device, progress)
        groups = mixed.measure(model, batches, device=device, progress=progress,
                               select=lambda m: f"{m}.weight" in to_quantize)
    except CalibrationError as e:
        raise ConversionError(f"--bits {average}: {e}") from None
    del model
    reached = {f"{m}.weight" for g in groups.values() for m in g["members"]}
    missing = sorted(to_quantize - reached)
    if missing:
        raise ConversionError(f"--bits {average}: the calibration run reached no input for {missing[0]} "
                              f"(and {len(missing) - 1} more); keep it unquantized with --ignore or use a whole --bits")
    try:
        ks = mixed.allocate(groups, average)
    except mixed.MixedBitsError as e:
        raise ConversionError(f"--bits {average}: {e}") from None
    return {f"{m}.weight": k for m, k in mixed.per_module(groups, ks).items()}


def _convert_rotated(src, dst, bits, seed: int, kwargs: dict) -> ConversionReport:
    """convert() of a rotated float copy of src, written beside dst and removed afterwards."""
    from vllm_kbit.quant import rotate

    src, dst = Path(src), Path(dst)
    config = _read_config(src)
    try:
        rotate.check_rotatable(config)
    except rotate.RotationError as e:
        raise ConversionError(str(e)) from None
    if (dst.exists() or dst.is_symlink()) and not kwargs.get("overwrite"):
        raise ConversionError(f"DST {dst} already exists; use --overwrite (overwrite=True) to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale_temps(dst)
    # named as convert's own temporary folders, so that a killed run's copy is cleared the same way
    rotated = Path(tempfile.mkdtemp(prefix=f"{_temp_prefix(dst)}{_owner_tag()}-rotated-", dir=dst.parent))
    try:
        dev = kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        rotate.rotate_checkpoint(src, rotated, seed=seed, device=dev, progress=kwargs.get("progress", True))
        report = convert(rotated, dst, bits, **kwargs)
    except rotate.RotationError as e:
        raise ConversionError(str(e)) from None
    finally:
        shutil.rmtree(rotated, ignore_errors=True)
    report.src, report.rotated = str(src), True
    return report


# ----------------------------------------------------------------------------- CLI

def _bits_arg(value: str):
    try:
        b = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    return int(b) if b.is_integer() else b


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message, exit status from main()
        raise ConversionError(f"{message} (see --help)")


def _load_codebook(arg: str):
    path = Path(arg)
    try:
        value = json.loads(path.read_text() if path.is_file() else arg)
    except ValueError as e:
        raise ConversionError(f"--codebook: neither a JSON file nor a JSON list ({e})") from None
    if isinstance(value, dict):
        value = value.get("codebook", value.get("quantization_config", {}).get("codebook"))
    if not isinstance(value, list):
        raise ConversionError("--codebook: expected a JSON list of floats (or an object with 'codebook')")
    return value


# what a converter CLI reports in one line (cli_error) rather than as a traceback
CLI_ERRORS = (KbitFormatError, ConversionError, OSError)


def cli_error(e: BaseException) -> int:
    """Print a CLI_ERRORS exception (or Ctrl-C) as one line on stderr; the exit status."""
    if isinstance(e, KeyboardInterrupt):
        print("error: interrupted (nothing written)", file=sys.stderr)
        return 130
    print("error: " + " ".join(str(e).split()), file=sys.stderr)
    return 1


def main(argv=None) -> int:
    parser = _Parser(prog="python -m vllm_kbit.convert",
                     description="Convert a Hugging Face safetensors model folder to a kbit checkpoint.")
    parser.add_argument("src", metavar="SRC", help="HF model folder (config.json + *.safetensors)")
    parser.add_argument("dst", metavar="DST", help="output folder (must not exist unless --overwrite)")
    parser.add_argument("--bits", type=_bits_arg, required=True,
                        help="bits per weight: 2, 3, 4 or 5, or an average in [2, 5] such as 2.5 "
                             "(K per layer, chosen on the calibration text: see --calib)")
    parser.add_argument("--ignore", action="append", default=[], metavar="PATTERN",
                        help="module to keep unquantized: exact name or 're:REGEX' (repeatable); "
                             f"ignored by default: {', '.join(DEFAULT_IGNORE)} (for lm_head see --quantize-lm-head)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST once the new one is complete")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="quantize lm_head too (not for models that tie it to the embeddings)")
    parser.add_argument("--device", default=None, help="quantize on cpu or cuda (default: cuda if available)")
    parser.add_argument("--codebook", default=None, metavar="JSON_FILE_OR_LIST",
                        help="custom codebook: 2^bits ascending floats in [-1, 1]")
    parser.add_argument("--max-shard-size", default="2GB", help="output shard size (default 2GB)")
    parser.add_argument("--method", default=DEFAULT_METHOD, choices=METHODS,
                        help=f"rtn: nearest level of the absmax scale; mse: per-block scale searched for the "
                             f"smallest error (data-free); gptq: error-compensated rounding calibrated on text "
                             f"run through the model (default {DEFAULT_METHOD})")
    parser.add_argument("--calib", default=None, metavar="TEXT_FILE",
                        help="gptq calibration text (plain text; default: text the model samples itself)")
    parser.add_argument("--calib-samples", type=int, default=128, metavar="N",
                        help="gptq calibration windows of 512 tokens (default 128)")
    parser.add_argument("--fit-codebook", action="store_true",
                        help="store a codebook fitted to each layer's weights (Lloyd-Max) with the layer")
    parser.add_argument("--activations", default="auto", choices=ACTIVATIONS,
                        help="auto: multiply in the model's dtype (fp16/bf16); fp8: e4m3 activations with "
                             "per-token scales on the tensor-core paths (Hopper; docs/FP8.md). Written to "
                             "quantization_config.activations; vLLM's --hf-overrides "
                             "'{\"kbit_activations\": ...}' overrides it at serve time (default auto)")
    parser.add_argument("--rotate", action="store_true",
                        help="fold a random Hadamard rotation into the weights before quantizing "
                             "(Llama / Mistral / Qwen2 / Qwen3)")
    parser.add_argument("--rotate-seed", type=int, default=0, metavar="N", help="seed of --rotate's signs")
    try:
        args = parser.parse_args(argv)
        codebook = _load_codebook(args.codebook) if args.codebook is not None else None
        with cli_spelling():
            report = convert(args.src, args.dst, args.bits, ignore=args.ignore, codebook=codebook,
                             overwrite=args.overwrite, device=args.device, max_shard_size=args.max_shard_size,
                             quantize_lm_head=args.quantize_lm_head, method=args.method, calib=args.calib,
                             calib_samples=args.calib_samples,
                             fit_codebook=args.fit_codebook, activations=args.activations, rotate=args.rotate,
                             rotate_seed=args.rotate_seed)
    except (*CLI_ERRORS, KeyboardInterrupt) as e:
        return cli_error(e)
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
