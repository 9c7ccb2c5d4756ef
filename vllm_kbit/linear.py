"""KbitLinearMethod: the parameters vLLM loads for a kbit linear layer, the load-time repack,
and `apply`, which calls the one fused op `kbit::gemm` (or, with FP8 activations,
`kbit::linear_fp8`: vllm_kbit.fp8).

Parameters (per tensor-parallel rank: N = sum(output_partition_sizes), K = input size per rank):
  qweight  int32 [N, K/32*bits]  PackedvLLMParameter   (input_dim=1, output_dim=0)
  absmax   uint8 [N, K/32]       GroupQuantScaleParameter
vLLM's own loaders shard them: column/QKV/merged layers narrow dim 0 in rows; row-parallel
layers narrow dim 1, which stays on block boundaries as long as K/tp % 32 == 0 (checked).
The packed dim is the input dim, so vLLM applies no packing arithmetic to the output offsets.
"""
from __future__ import annotations

from fractions import Fraction

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.layers.quantization.utils.layer_utils import replace_parameter
from vllm.model_executor.parameter import GroupQuantScaleParameter, ModelWeightParameter, PackedvLLMParameter

from vllm_kbit import format as kf
from vllm_kbit import fp8, ops

# under vLLM's logger, whose handler prints INFO in every vLLM process
logger = init_logger("vllm.kbit")

# E4M4 codes for the random weights of --load-format dummy: absmax between 0.03 and 0.12,
# the range of real LLM linear layers, so activations stay healthy.
_DUMMY_CODE_LO, _DUMMY_CODE_HI = int(kf.encode_e4m4(torch.tensor(0.03))), int(kf.encode_e4m4(torch.tensor(0.12)))


def load_mode(config) -> str:
    """How a kbit layer gets its weights, fixed at create time: "dummy" (`--load-format dummy`),
    "checkpoint" (a kbit checkpoint) or "online" (`--quantization kbit` on a float checkpoint)."""
    vc = get_current_vllm_config_or_none()
    if vc is not None and vc.load_config.load_format == "dummy":
        return "dummy"
    return "checkpoint" if config.from_checkpoint else "online"


def fill_dummy(qweight: torch.Tensor, absmax: torch.Tensor) -> None:
    """Random valid kbit weights in place: every bit pattern (plain random_() never sets bit 31)
    and block scales in the dummy range."""
    qweight.random_(-2**31, 2**31)
    absmax.random_(_DUMMY_CODE_LO, _DUMMY_CODE_HI + 1)


@register_weight_loader_v2_supported_method
class KbitLinearMethod(LinearMethodBase):
    """Three modes, fixed at create time:
    - checkpoint: a kbit checkpoint (quantization_config in config.json);
    - online:     `--quantization kbit` on a float checkpoint: load `weight`, quantize after loading;
    - dummy:      `--load-format dummy`: random valid kbit weights."""

    def __init__(self, config, prefix: str):
        self.config = config
        self.prefix = prefix

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        ops.require_kernels(self.prefix)
        logger.info_once("vllm_kbit: kbit layers run %s", ops.kernels_in_use())
        bits = self.config.bits
        n, k = sum(output_partition_sizes), input_size_per_partition
        if k % kf.BLOCK_SIZE:
            split = f" split over tensor-parallel ranks into {k}" if k != input_size else ""
            raise ValueError(
                f"kbit layer {self.prefix}: input size {input_size}{split} is not a multiple of "
                f"the {kf.BLOCK_SIZE}-weight block; use a tensor-parallel size that keeps whole "
                f"blocks per rank, or list the layer in quantization_config.ignore")
        layer.kbit_mode = load_mode(self.config)
        layer.kbit_fp8 = self._fp8_activations()
        layer.kbit_n, layer.kbit_k = n, k
        layer.kbit_loaded = {}
        layer.kbit_expected_shards = len(output_partition_sizes)
        loader = extra_weight_attrs["weight_loader"]

        if layer.kbit_mode == "online":
            # The float weight stays on the GPU until process_weights_after_loading: peak memory
            # is the float model's (README).
            layer.register_parameter("weight", ModelWeightParameter(
                data=torch.empty(n, k, dtype=params_dtype), input_dim=1, output_dim=0,
                weight_loader=self._checked_loader(layer, "weight", loader, None, input_size)))
            return
        layer.register_parameter("qweight", PackedvLLMParameter(
            data=torch.empty(n, k // kf.BLOCK_SIZE * bits, dtype=torch.int32),
            input_dim=1, output_dim=0, packed_dim=1, packed_factor=Fraction(kf.BLOCK_SIZE, bits),
            weight_loader=self._checked_loader(layer, "qweight", loader, torch.int32,
                                               input_size // kf.BLOCK_SIZE * bits)))
        layer.register_parameter("absmax", GroupQuantScaleParameter(
            data=torch.empty(n, k // kf.BLOCK_SIZE, dtype=torch.uint8), input_dim=1, output_dim=0,
            weight_loader=self._checked_loader(layer, "absmax", loader, torch.uint8,
                                               input_size // kf.BLOCK_SIZE)))
        if self.config.codebook_per_layer and layer.kbit_mode == "checkpoint":
            self._create_codebook(layer)

    def _fp8_activations(self) -> bool:
        """Whether this layer runs FP8 activations: the config asks for them (or a serve-time
        override does) and this process can run them; where it cannot (a GPU without the FP8
        kernel), 16-bit activations, said once in the log."""
        if self.config.serving_activations() != "fp8":
            return False
        why_not = fp8.unavailable_reason()
        if why_not is not None:
            logger.warning_once("vllm_kbit: activations fp8 asked for, but %s; kbit layers multiply "
                                "16-bit activations", why_not)
            return False
        logger.info_once("vllm_kbit: kbit layers run FP8 activations above %d tokens", fp8.GEMV_MAX_M)
        return True

    def _create_codebook(self, layer: torch.nn.Module) -> None:
        """The layer's own codebook (`P.codebook`, float32 [2^bits]). A fused layer (qkv_proj,
        gate_up_proj) is one kernel call with one codebook, so its shards must carry equal ones
        (convert --fit-codebook fits one per fused group)."""
        from vllm.model_executor.utils import set_weight_attrs

        n = 1 << self.config.bits
        param = torch.nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        full = f"{self.prefix}.codebook"

        def load(param, loaded_weight: torch.Tensor, *args, **kwargs):
            try:
                cb = kf.check_codebook(loaded_weight, self.config.bits)
            except kf.KbitFormatError as e:
                raise ValueError(f"kbit: {full}: {e}") from None
            shard = args[0] if args else kwargs.get("loaded_shard_id")
            seen = layer.kbit_loaded.setdefault("codebook", set())
            if seen and not torch.equal(param.data.cpu(), cb):
                raise ValueError(
                    f"kbit: {full}: shard {shard!r} carries a codebook different from the other "
                    f"shard(s) of this fused layer ({sorted(map(str, seen))}); vLLM runs them as one "
                    f"layer with one codebook (convert --fit-codebook fits one per fused group)")
            param.data.copy_(cb)
            seen.update(shard if isinstance(shard, tuple) else (shard,))

        set_weight_attrs(param, {"weight_loader": load})
        layer.register_parameter("codebook", param)

    def _checked_loader(self, layer, name, loader, dtype, cols):
        """vLLM's loader, after checks that name the tensor, recording which shards arrived
        (vLLM itself does not report missing tensors of quantized layers)."""
        full = f"{self.prefix}.{name}"

        def load(param, loaded_weight: torch.Tensor, *args, **kwargs):
            if dtype is not None and loaded_weight.dtype != dtype:
                raise ValueError(f"kbit: {full} must be {dtype}, the checkpoint has {loaded_weight.dtype}")
            if loaded_weight.dim() != 2 or loaded_weight.shape[1] != cols:
                raise ValueError(
                    f"kbit: {full} has shape {tuple(loaded_weight.shape)}; expected [rows, {cols}] "
                    f"for bits={self.config.bits} (is the checkpoint's `bits` right?)")
            shard = args[0] if args else kwargs.get("loaded_shard_id")
            # some models load several shards of a merged layer at once: shard id (0, 1, 2)
            layer.kbit_loaded.setdefault(name, set()).update(shard if isinstance(shard, tuple) else (shard,))
            return loader(param, loaded_weight, *args, **kwargs)

        return load

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        bits, cb = self.config.bits, self.config.codebook
        if layer.kbit_mode == "online":
            self._check_all_loaded(layer, ("weight",))
            qweight, absmax, _ = ops.quantize(layer.weight.data, bits, cb, name=f"{self.prefix}.weight")
            del layer.weight
        else:
            qweight, absmax = layer.qweight.data, layer.absmax.data
            if layer.kbit_mode == "dummy":
                fill_dummy(qweight, absmax)
            else:
                self._check_all_loaded(layer, ("qweight", "absmax"))
                if hasattr(layer, "codebook"):  # quantization_config.codebook_per_layer
                    self._check_all_loaded(layer, ("codebook",))
                    cb = layer.codebook.data.float().cpu()
                    del layer.codebook
        if layer.kbit_fp8:  # the weight's power-of-two exponent for e4m3 (fp8.weight_exponent)
            layer.kbit_w_exp = fp8.weight_exponent(absmax)
        packed, absmax_packed = ops.repack(qweight, absmax, bits)
        for name, t in (("qweight", packed), ("absmax", absmax_packed)):
            if hasattr(layer, name):
                replace_parameter(layer, name, torch.nn.Parameter(t, requires_grad=False))
            else:
                layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        layer.register_buffer("kbit_codebook", cb.to(packed.device), persistent=False)

    def _check_all_loaded(self, layer, names) -> None:
        for name in names:
            shards = layer.kbit_loaded.get(name, set())
            if None not in shards and len(shards) < layer.kbit_expected_shards:
                got = sorted(map(str, shards)) or "none"
                raise ValueError(
                    f"kbit: {self.prefix}.{name} is missing from the checkpoint "
                    f"(loaded shards: {got} of {layer.kbit_expected_shards})")

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module):
        """vLLM ties an lm_head to the input embeddings through its quant method; a kbit lm_head
        cannot share their float table (some models tie whatever their config says)."""
        raise ValueError(f"kbit: {self.prefix} is kbit (quantization_config.lm_head) but the model ties it "
                         f"to the input embeddings; set lm_head to false")

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.kbit_fp8:
            return fp8.gemm(x, layer.qweight, layer.absmax, layer.kbit_codebook, self.config.bits,
                            layer.kbit_n, layer.kbit_k, layer.kbit_w_exp, bias)
        return ops.gemm(x, layer.qweight, layer.absmax, layer.kbit_codebook, self.config.bits,
                        layer.kbit_n, layer.kbit_k, bias)
