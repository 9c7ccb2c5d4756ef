"""`kbit` as a vLLM quantization method: the config vLLM builds from config.json.

Registered by importing this module (vllm_kbit.register, the `vllm.general_plugins` entry
point, does it in every vLLM process). Importing it must not initialise CUDA.
"""
from __future__ import annotations

import copy
import re
from typing import Any

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from vllm_kbit import format as kf
from vllm_kbit.fp8 import check_activations

# MoE routers: always float, whatever the ignore list (as convert leaves them)
ROUTER_RE = re.compile(kf.ROUTER_PATTERN[len("re:"):])

# the top-level hf_config key a serve-time `--hf-overrides` sets (vLLM replaces a dict-valued
# override such as quantization_config whole, so one field of it cannot be overridden alone)
ACTIVATIONS_OVERRIDE = "kbit_activations"


@register_quantization_config("kbit")
class KbitConfig(QuantizationConfig):
    """bits, codebook and the layers left unquantized (compressed-tensors `ignore` semantics:
    exact module names or `re:` regexes; a fused vLLM layer such as qkv_proj is skipped when
    all of its checkpoint shards are). `lm_head` (vLLM's key, as for GPTQ and AWQ; default false):
    the output projection is kbit too (`convert --quantize-lm-head`), served by the same op.
    MoE experts (vLLM's fused RoutedExperts layer) are kbit too (vllm_kbit.moe.KbitMoEMethod),
    unless ignored; MoE routers always stay float (ROUTER_RE).

    Built by `from_config` for a kbit checkpoint. Built with no arguments (`--quantization kbit`
    on a model without a quantization_config) it quantizes the checkpoint's float weights at
    load time, or, with `--load-format dummy`, fills random valid kbit weights.
    """

    def __init__(self, bits: int = 4, block_size: int = kf.BLOCK_SIZE, codebook=None,
                 ignore: list[str] | None = None, absmax_format: str = "e4m4",
                 from_checkpoint: bool = False, lm_head: bool = False, codebook_per_layer: bool = False,
                 activations: str = "auto", bits_per_layer: dict | None = None, codebooks: dict | None = None):
        super().__init__()
        kf.check_bits(bits)
        if block_size != kf.BLOCK_SIZE:
            raise ValueError(f"kbit: block_size must be {kf.BLOCK_SIZE}, got {block_size}")
        if str(absmax_format).lower() != "e4m4":
            raise ValueError(f"kbit: absmax_format must be 'e4m4', got {absmax_format!r}")
        self.bits = bits
        self.block_size = block_size
        try:
            if codebook is not None:
                self.codebook = kf.check_codebook(codebook, bits)
            elif from_checkpoint:  # a checkpoint without its codebook predates nf0: it used NF
                self.codebook = kf.normal_float_codebook(bits)
            else:  # quantizing at load time: the default of every entry point that quantizes
                self.codebook = kf.default_codebook(bits)
        except kf.KbitFormatError as e:
            raise ValueError(f"kbit quantization_config: {e}") from None
        self.ignore = list(ignore or [])
        if not isinstance(lm_head, bool):
            raise ValueError(f"kbit quantization_config: lm_head must be true or false, got {lm_head!r}")
        if lm_head and "lm_head" in self.ignore:
            raise ValueError("kbit quantization_config: lm_head is true but 'lm_head' is in ignore")
        self.lm_head_quantized = lm_head
        if not isinstance(codebook_per_layer, bool):
            raise ValueError(f"kbit quantization_config: codebook_per_layer must be true or false, "
                             f"got {codebook_per_layer!r}")
        # every quantized layer stores its own `codebook` tensor (convert --fit-codebook)
        self.codebook_per_layer = codebook_per_layer
        self.from_checkpoint = from_checkpoint
        self.activations = check_activations(activations)
        self.bits_per_layer, self.codebooks = _check_mixed(bits_per_layer, codebooks, bits, self.codebook)

    def __repr__(self) -> str:
        return (f"KbitConfig(bits={self.bits}, activations={self.activations!r}, lm_head={self.lm_head_quantized}, "
                f"ignore={self.ignore})")

    def get_name(self) -> str:
        return "kbit"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    @staticmethod
    def get_config_filenames() -> list[str]:
        # Empty: `--quantization kbit` on a plain model folder builds KbitConfig() (online mode).
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "KbitConfig":
        return cls(bits=cls.get_from_keys(config, ["bits"]),
                   block_size=cls.get_from_keys_or(config, ["block_size"], kf.BLOCK_SIZE),
                   codebook=cls.get_from_keys_or(config, ["codebook"], None),
                   ignore=cls.get_from_keys_or(config, ["ignore"], None),
                   absmax_format=cls.get_from_keys_or(config, ["absmax_format"], "e4m4"),
                   from_checkpoint=True, lm_head=cls.get_from_keys_or(config, ["lm_head"], False),
                   codebook_per_layer=cls.get_from_keys_or(config, ["codebook_per_layer"], False),
                   activations=cls.get_from_keys_or(config, ["activations"], "auto"),
                   bits_per_layer=cls.get_from_keys_or(config, ["bits_per_layer"], None),
                   codebooks=cls.get_from_keys_or(config, ["codebooks"], None))

    def serving_activations(self) -> str:
        """The activations this model's layers run: `--hf-overrides '{"kbit_activations": ...}'`
        where given (checkpoints, `--quantization kbit`, dummy weights alike), else
        quantization_config.activations."""
        vc = get_current_vllm_config_or_none()
        hf = vc.model_config.hf_config if vc is not None and vc.model_config is not None else None
        override = getattr(hf, ACTIVATIONS_OVERRIDE, None) if hf is not None else None
        if override is None:
            return self.activations
        return check_activations(override, f"--hf-overrides {ACTIVATIONS_OVERRIDE}")

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.ignore:
            self.ignore = hf_to_vllm_mapper.apply_list(self.ignore)
        if self.bits_per_layer:
            self.bits_per_layer = hf_to_vllm_mapper.apply_dict(self.bits_per_layer)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, ParallelLMHead):
            # `lm_head` names the model's output projection (the one `convert` quantizes), not
            # other heads vLLM builds the same way (e.g. multi-token-prediction heads)
            if not self.lm_head_quantized or prefix.rpartition(".")[2] != "lm_head":
                return None  # vLLM's unquantized lm_head
            if should_ignore_layer(prefix, ignore=self.ignore):
                raise ValueError(f"kbit quantization_config: lm_head is true but ignore matches {prefix}")
            _check_untied(prefix)
        elif _is_routed_experts(layer):
            from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
            if should_ignore_layer(prefix, ignore=self.ignore):
                return UnquantizedFusedMoEMethod(layer.moe_config)
            from vllm_kbit.moe import KbitMoEMethod
            return KbitMoEMethod(self.for_layer(prefix), layer.moe_config, prefix)
        elif not isinstance(layer, LinearBase):
            return None  # embeddings, attention: unquantized
        elif ROUTER_RE.fullmatch(prefix) or should_ignore_layer(
                prefix, ignore=self.ignore, fused_mapping=self.packed_modules_mapping):
            return UnquantizedLinearMethod()
        from vllm_kbit.linear import KbitLinearMethod
        return KbitLinearMethod(self.for_layer(prefix), prefix)

    def layer_bits(self, prefix: str) -> int:
        """K of the vLLM layer `prefix`: its entry in bits_per_layer (a fused layer such as
        qkv_proj: its checkpoint shards' entries, which must agree), else `bits`."""
        if not self.bits_per_layer:
            return self.bits
        if prefix in self.bits_per_layer:
            return self.bits_per_layer[prefix]
        parent, _, leaf = prefix.rpartition(".")
        shards = (self.packed_modules_mapping or {}).get(leaf, [])
        ks = {s: self.bits_per_layer.get(f"{parent}.{s}" if parent else s) for s in shards}
        found = {k for k in ks.values() if k is not None}
        if len(found) > 1:
            raise ValueError(f"kbit quantization_config.bits_per_layer: the shards of the fused layer {prefix} "
                             f"have different K ({', '.join(f'{s}: {k}' for s, k in ks.items())}); vLLM runs "
                             f"them as one layer with one K")
        if found and None in ks.values():
            missing = [s for s, k in ks.items() if k is None]
            raise ValueError(f"kbit quantization_config.bits_per_layer lists some shards of {prefix} but not "
                             f"{', '.join(missing)}")
        return found.pop() if found else self.bits

    def for_layer(self, prefix: str) -> "KbitConfig":
        """This config as one layer sees it: its own K and that K's codebook (mixed K)."""
        k = self.layer_bits(prefix)
        if k == self.bits:
            return self
        view = copy.copy(self)
        view.bits, view.codebook = k, self.codebooks[k]
        return view


def _check_mixed(bits_per_layer, codebooks, bits: int, codebook: torch.Tensor):
    """bits_per_layer {layer: K} and codebooks {K: levels} of a mixed-K checkpoint, checked;
    every K listed needs its codebook (the config's `codebook` serves K = bits)."""
    if bits_per_layer is None:
        return {}, {bits: codebook}
    if not isinstance(bits_per_layer, dict):
        raise ValueError(f"kbit quantization_config: bits_per_layer must map layer names to K, "
                         f"got {type(bits_per_layer).__name__}")
    out_cb = {bits: codebook}
    for k_str, levels in (codebooks or {}).items():
        try:
            k = kf.check_bits(int(k_str))
            out_cb[k] = kf.check_codebook(levels, k)
        except (ValueError, kf.KbitFormatError) as e:
            raise ValueError(f"kbit quantization_config.codebooks[{k_str!r}]: {e}") from None
    checked = {}
    for name, k in bits_per_layer.items():
        if isinstance(k, bool) or not isinstance(k, int):
            raise ValueError(f"kbit quantization_config.bits_per_layer[{name!r}] must be an integer K, got {k!r}")
        try:
            kf.check_bits(k)
        except kf.KbitFormatError as e:
            raise ValueError(f"kbit quantization_config.bits_per_layer[{name!r}]: {e}") from None
        if k not in out_cb:
            raise ValueError(f"kbit quantization_config.bits_per_layer[{name!r}] is {k} but codebooks has "
                             f"no entry for K={k}")
        checked[name] = k
    return checked, out_cb


def _is_routed_experts(layer: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    return isinstance(layer, RoutedExperts)


def _check_untied(prefix: str) -> None:
    """A tied lm_head shares the input embedding's float table, which vLLM's embedding lookup
    reads directly: it cannot be kbit."""
    vc = get_current_vllm_config_or_none()
    hf = vc.model_config.hf_config if vc is not None and vc.model_config is not None else None
    if hf is not None and getattr(hf.get_text_config(), "tie_word_embeddings", False):
        raise ValueError(f"kbit: quantization_config.lm_head is true but {prefix} is tied to the "
                         f"input embeddings (tie_word_embeddings); set lm_head to false")
