"""KbitMoEMethod: kbit experts for vLLM's MoE layer (RoutedExperts), and `experts_forward`,
the routed-experts computation that the layer and benchmarks/bench_moe.py share.

Parameters (per rank; E = local experts, H = hidden, I = expert intermediate per TP rank,
N13 = 2I for gated activations, else I), checkpoint layout as a linear layer's:
  w13_qweight int32 [E, N13, H/32*bits]   w13_absmax uint8 [E, N13, H/32]   (gate rows, then up)
  w2_qweight  int32 [E, H, I/32*bits]     w2_absmax  uint8 [E, H, I/32]
loaded from the per-expert checkpoint tensors `...experts.{e}.{gate,up,down}_proj.{qweight,absmax}`
(Mixtral: w1 / w3 / w2) through vLLM's own expert loader, which shards w13 by rows and w2 along
I (whole 32-blocks per rank, checked). After loading, each expert is repacked (repack_experts)
into the stacked layout of kbit::moe_gemm. With quantization_config.codebook_per_layer
(convert --fit-codebook), every expert also carries its own codebooks
  w13_codebook float32 [E, 2^bits] (`gate_proj` / `up_proj`: one shared, as fitted per fused pair)
  w2_codebook  float32 [E, 2^bits] (`down_proj`)
from `...experts.{e}.{proj}.codebook`, and the MoE ops decode expert e with row e.

Forward (`experts_forward`), vLLM's fused_moe recipe with kbit GEMMs:
  small batches: moe_align_block_size -> kbit::moe_gemm (w13) -> activation -> kbit::moe_gemm
                 (w2, times the router weights) -> moe_sum;
  large batches, Hopper (sm_90a build): moe_align_block_size at block_m 64 / 128 / 256 ->
                 kbit::moe_gemm_grouped (w13, the activation fused into its epilogue) ->
                 kbit::moe_gemm_grouped (w2, times the router weights) -> moe_sum;
  large batches elsewhere ("dense"): kbit::dequantize_experts on chunks of experts (bounded
                 scratch) -> vLLM's Triton fused_experts on each chunk (an expert map selects
                 its experts), summed.
No host synchronisation on the GPU: it runs inside vLLM's opaque moe_forward op, under CUDA
graphs and torch.compile. On the CPU the same code runs with torch stand-ins for vLLM's CUDA
pieces (alignment, activation, sum, fused_experts), kept apart in vllm_kbit/moe_cpu.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
from vllm.model_executor.layers.quantization.utils.layer_utils import replace_parameter
from vllm.model_executor.utils import set_weight_attrs

from vllm_kbit import format as kf
from vllm_kbit import ops
from vllm_kbit.linear import fill_dummy, load_mode
from vllm_kbit.moe_cpu import ACTIVATIONS, align_block_size, fused_experts_torch, moe_activation, moe_sum

# Rows of sorted (token, expert) pairs per block of kbit::moe_gemm.
BLOCK_M = 16
# Up to this many (token, expert) pairs per expert, a batch without an expert map skips
# moe_align_block_size: every pair is its own block (block_m = 1, as vLLM's fused_experts does
# for sparse batches). The grid then holds the pairs, not E * (BLOCK_M - 1) padding blocks, and
# the align kernel is gone; two tokens on one expert read its weights twice, which is rare
# while pairs are fewer than half the experts.
SPARSE_MAX_PAIRS_PER_EXPERT = 0.5
# Without the grouped kernel (GPUs other than Hopper), from this many (token, expert) pairs per
# expert a layer dequantizes its experts and runs vLLM's bf16 / fp16 Triton MoE instead of
# kbit::moe_gemm, whose blocks of BLOCK_M pairs each read their expert's weights once: the
# crossover on Qwen3-30B-A3B's experts lies between 64 and 256 (docs/PERFORMANCE.md).
DENSE_MIN_PAIRS_PER_EXPERT = 128
# Where the grouped tensor-core kernel runs (ops.has_moe_grouped), it replaces kbit::moe_gemm
# from this many pairs per expert: a first estimate, not a measured crossover (the grouped
# kernel reads each expert's weights once per 64 pairs and multiplies on the tensor cores,
# moe_gemm reads them once per BLOCK_M = 16); bench_moe.py's gemm and grouped rows place it.
GROUPED_MIN_PAIRS_PER_EXPERT = 32
# Whether choose_path takes the grouped kernel by itself. It has not yet run on a GPU, so the
# automatic choice keeps the measured paths (gemm, dense) and the grouped kernel runs where asked
# for (path="grouped", bench_moe.py --paths grouped); its GPU tests and the bench rows that place
# GROUPED_MIN_PAIRS_PER_EXPERT decide when this turns True.
GROUPED_CHOSEN = False
# The grouped tensor-core kernel (kbit::moe_gemm_grouped) takes blocks of 128 sorted pairs from
# this many pairs per expert, of 256 (its tall CTA) from the second, of 64 below: a larger CTA
# decodes each weight once for more rows, but pads each expert's run to a multiple of its rows.
# First estimates, for bench_moe.py (`--paths grouped@64,grouped@128,grouped@256`) to place.
GROUPED_MT128_MIN_PAIRS_PER_EXPERT = 192
GROUPED_MT256_MIN_PAIRS_PER_EXPERT = 512
# The activations kbit::moe_gemm_grouped fuses into its epilogue (ops.MOE_ACTIVATIONS codes).
GROUPED_ACTIVATIONS = {
    MoEActivation.SILU: ops.MOE_ACTIVATIONS.index("silu_and_mul"),
    MoEActivation.GELU: ops.MOE_ACTIVATIONS.index("gelu_and_mul"),
    MoEActivation.GELU_TANH: ops.MOE_ACTIVATIONS.index("gelu_tanh_and_mul"),
    MoEActivation.SILU_NO_MUL: ops.MOE_ACTIVATIONS.index("silu"),
    MoEActivation.GELU_NO_MUL: ops.MOE_ACTIVATIONS.index("gelu"),
    MoEActivation.GELU_TANH_NO_MUL: ops.MOE_ACTIVATIONS.index("gelu_tanh"),
    MoEActivation.RELU2_NO_MUL: ops.MOE_ACTIVATIONS.index("relu2"),
}
PATHS = ("gemm", "grouped", "dense")
# Bytes of dequantized experts (w13 + w2) the large-batch path holds at once.
DENSE_SCRATCH_BYTES = 1 << 30

@dataclass
class KbitExperts:
    """One layer's stacked kbit experts and what experts_forward needs to run them."""
    w13: torch.Tensor          # moe_gemm layout (repack_experts)
    w13_absmax: torch.Tensor
    w2: torch.Tensor
    w2_absmax: torch.Tensor
    codebook: torch.Tensor     # float32 [2^bits] (all experts) or [E, 2^bits] (w13's per expert), on their device
    bits: int
    hidden: int                # H
    inter: int                 # I (per rank)
    gated: bool                # w13 holds gate and up rows (N13 = 2I)
    activation: MoEActivation = MoEActivation.SILU
    global_num_experts: int = -1
    expert_map: torch.Tensor | None = None    # int32 [global] -> local id or -1 (expert parallel)
    dense_maps: list[torch.Tensor] | None = None  # per chunk of dense_chunk experts: global -> chunk id
    dense_chunk: int = 0
    w2_codebook: torch.Tensor | None = None   # float32 [E, 2^bits]: w2's, per expert; None: `codebook`

    @property
    def w2_codebooks(self) -> torch.Tensor:
        return self.codebook if self.w2_codebook is None else self.w2_codebook

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def n13(self) -> int:
        return 2 * self.inter if self.gated else self.inter


def repack_experts(qweight: torch.Tensor, absmax: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts of one layer in the checkpoint layout, stacked (qweight int32 [E, n, k/32*bits],
    absmax uint8 [E, n, k/32]) -> the stacked layout kbit::moe_gemm / dequantize_experts read:
    each expert through kbit::repack, row e = expert e's output, flattened to [E, P] / [E, U]
    where the CUDA kernels serve (on the reference path repack is the identity and the stack
    stays 3-D). One expert at a time: the scratch is one expert's repack output."""
    num = qweight.shape[0]
    flat = ops.HAS_CUDA_KERNELS and qweight.is_cuda
    packed = absmax_packed = None
    for e in range(num):
        p, a = ops.repack(qweight[e], absmax[e], bits)
        if packed is None:
            shape_p, shape_a = ((p.numel(),), (a.numel(),)) if flat else (p.shape, a.shape)
            packed = torch.empty((num, *shape_p), dtype=p.dtype, device=p.device)
            absmax_packed = torch.empty((num, *shape_a), dtype=a.dtype, device=a.device)
        packed[e] = p.reshape(packed.shape[1:])
        absmax_packed[e] = a.reshape(absmax_packed.shape[1:])
    return packed, absmax_packed


# ----------------------------------------------------------------------------- forward

def dense_chunk_size(hidden: int, n13: int, inter: int, dtype_bytes: int = 2) -> int:
    """Experts dequantized at once by the large-batch path (DENSE_SCRATCH_BYTES of w13 + w2)."""
    return max(1, DENSE_SCRATCH_BYTES // ((n13 + inter) * hidden * dtype_bytes))


def dense_expert_maps(expert_map: torch.Tensor | None, global_num_experts: int, num_local: int,
                      chunk: int, device) -> list[torch.Tensor]:
    """Per chunk of `chunk` local experts: int32 [global] -> id within the chunk, or -1."""
    local = (expert_map.long().cpu() if expert_map is not None
             else torch.arange(global_num_experts))
    maps = []
    for e0 in range(0, num_local, chunk):
        inside = (local >= e0) & (local < e0 + chunk)
        maps.append(torch.where(inside, local - e0, -1).to(torch.int32).to(device))
    return maps


def sparse_blocks(topk_ids: torch.Tensor):
    """The block_m = 1 form of moe_align_block_size's output, without sorting: pair p is block p,
    of expert topk_ids.view(-1)[p]. Device tensors only (no host sync)."""
    num_pairs = topk_ids.numel()
    sorted_ids = torch.arange(num_pairs, dtype=torch.int32, device=topk_ids.device)
    num_post = torch.full((1,), num_pairs, dtype=torch.int32, device=topk_ids.device)
    return sorted_ids, topk_ids.reshape(-1).to(torch.int32), num_post


def experts_forward(ex: KbitExperts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    apply_router_weight_on_input: bool = False, path: str | None = None,
                    overrides: str = "", block_m: int | None = None) -> torch.Tensor:
    """The routed experts' output [M, H] in x.dtype: sum over k of topk_weights[:, k] times expert
    topk_ids[:, k] applied to x (the router weights multiply x instead when
    apply_router_weight_on_input). `path`: "gemm" (kbit::moe_gemm), "grouped"
    (kbit::moe_gemm_grouped, Hopper), "dense" (dequantize + fused_experts), or None
    (choose_path). `overrides`: the grouped kernel's plan overrides (csrc/dispatch/overrides.h,
    `moe.*`) and `block_m` its CTA's tokens (None: grouped_block_m), for tests and benchmarks."""
    m, top_k = topk_ids.shape
    global_e = ex.global_num_experts if ex.global_num_experts > 0 else ex.num_experts
    if path is None:
        path = choose_path(m * top_k, global_e)
    if path not in PATHS:
        raise ValueError(f"kbit MoE: path must be one of {', '.join(map(repr, PATHS))} or None, got {path!r}")
    if apply_router_weight_on_input and top_k != 1:
        raise ValueError(f"kbit MoE: apply_router_weight_on_input needs top_k = 1, got {top_k}")
    if path == "dense":
        return _forward_dense(ex, x, topk_weights, topk_ids, apply_router_weight_on_input)
    if path == "grouped":
        return _forward_grouped(ex, x, topk_weights, topk_ids, apply_router_weight_on_input,
                                block_m or grouped_block_m(m * top_k, global_e), overrides)
    if ex.expert_map is None and m * top_k <= SPARSE_MAX_PAIRS_PER_EXPERT * global_e:
        block_m, (sorted_ids, expert_ids, num_post) = 1, sparse_blocks(topk_ids)
    else:
        block_m = BLOCK_M
        sorted_ids, expert_ids, num_post = align_block_size(topk_ids, BLOCK_M, global_e, ex.expert_map)
    if apply_router_weight_on_input:
        x = (x.float() * topk_weights.float().reshape(-1, 1)).to(x.dtype)
    x, topk_weights = x.contiguous(), topk_weights.contiguous()
    h = torch.ops.kbit.moe_gemm(x, ex.w13, ex.w13_absmax, ex.codebook, ex.bits, ex.n13, ex.hidden,
                                sorted_ids, expert_ids, num_post, block_m, top_k)
    a = moe_activation(ex.activation, h)
    y = torch.ops.kbit.moe_gemm(a, ex.w2, ex.w2_absmax, ex.w2_codebooks, ex.bits, ex.hidden, ex.inter,
                                sorted_ids, expert_ids, num_post, block_m, 1,
                                None if apply_router_weight_on_input else topk_weights)
    return moe_sum(y.view(m, top_k, ex.hidden))


def choose_path(num_pairs: int, global_experts: int) -> str:
    """The path of a batch of `num_pairs` (token, expert) pairs: where this build and GPU run
    the grouped tensor-core kernel (ops.has_moe_grouped: Hopper) and GROUPED_CHOSEN, kbit::moe_gemm below
    GROUPED_MIN_PAIRS_PER_EXPERT pairs per expert and the grouped kernel from there; elsewhere
    kbit::moe_gemm below DENSE_MIN_PAIRS_PER_EXPERT and dequantize + fused_experts from there."""
    if num_pairs < min(GROUPED_MIN_PAIRS_PER_EXPERT, DENSE_MIN_PAIRS_PER_EXPERT) * global_experts:
        return "gemm"  # either way (the decode steps ask no more)
    if GROUPED_CHOSEN and ops.has_moe_grouped():
        return "grouped" if num_pairs >= GROUPED_MIN_PAIRS_PER_EXPERT * global_experts else "gemm"
    return "dense" if num_pairs >= DENSE_MIN_PAIRS_PER_EXPERT * global_experts else "gemm"


def grouped_block_m(num_pairs: int, global_experts: int) -> int:
    """kbit::moe_gemm_grouped's block_m (its CTA's tokens) for this many pairs."""
    if num_pairs >= GROUPED_MT256_MIN_PAIRS_PER_EXPERT * global_experts:
        return 256
    return 128 if num_pairs >= GROUPED_MT128_MIN_PAIRS_PER_EXPERT * global_experts else 64


def _forward_grouped(ex, x, topk_weights, topk_ids, apply_router_weight_on_input, block_m, overrides=""):
    m, top_k = topk_ids.shape
    global_e = ex.global_num_experts if ex.global_num_experts > 0 else ex.num_experts
    sorted_ids, expert_ids, num_post = align_block_size(topk_ids, block_m, global_e, ex.expert_map)
    if apply_router_weight_on_input:
        x = (x.float() * topk_weights.float().reshape(-1, 1)).to(x.dtype)
    x, topk_weights = x.contiguous(), topk_weights.contiguous()
    # the activation in the first GEMM's epilogue where the kernel has it (gated: gate and up
    # halves of whole 64-column units), else vLLM's between the two
    act = GROUPED_ACTIVATIONS.get(ex.activation, 0)
    if ops.moe_activation_gated(act) and ex.n13 % 128:
        act = 0
    # the down projection reads only the rows of covered pairs: h needs no zeroing
    h = torch.ops.kbit.moe_gemm_grouped(x, ex.w13, ex.w13_absmax, ex.codebook, ex.bits, ex.n13, ex.hidden,
                                        sorted_ids, expert_ids, num_post, block_m, top_k, None, act, False,
                                        overrides)
    a = h if act else moe_activation(ex.activation, h)
    # pairs of experts off this rank are in no block: their rows must be 0 for moe_sum
    y = torch.ops.kbit.moe_gemm_grouped(a, ex.w2, ex.w2_absmax, ex.w2_codebooks, ex.bits, ex.hidden, ex.inter,
                                        sorted_ids, expert_ids, num_post, block_m, 1,
                                        None if apply_router_weight_on_input else topk_weights, 0,
                                        ex.expert_map is not None, overrides)
    return moe_sum(y.view(m, top_k, ex.hidden))


def _forward_dense(ex, x, topk_weights, topk_ids, apply_router_weight_on_input):
    chunk = ex.dense_chunk or dense_chunk_size(ex.hidden, ex.n13, ex.inter, x.element_size())
    maps = ex.dense_maps
    if maps is None:
        maps = dense_expert_maps(ex.expert_map, ex.global_num_experts if ex.global_num_experts > 0
                                 else ex.num_experts, ex.num_experts, chunk, x.device)
    global_e = ex.global_num_experts if ex.global_num_experts > 0 else ex.num_experts
    out = None
    for c, chunk_map in enumerate(maps):
        e0, e1 = c * chunk, min(ex.num_experts, (c + 1) * chunk)
        cb13, cb2 = (cb if cb.dim() == 1 else cb[e0:e1] for cb in (ex.codebook, ex.w2_codebooks))
        w13 = torch.ops.kbit.dequantize_experts(ex.w13[e0:e1], ex.w13_absmax[e0:e1], cb13, ex.bits,
                                                ex.n13, ex.hidden, x.dtype)
        w2 = torch.ops.kbit.dequantize_experts(ex.w2[e0:e1], ex.w2_absmax[e0:e1], cb2, ex.bits,
                                               ex.hidden, ex.inter, x.dtype)
        if x.is_cuda:
            from vllm.model_executor.layers.fused_moe import fused_experts
            y = fused_experts(x, w13, w2, topk_weights, topk_ids, activation=ex.activation,
                              apply_router_weight_on_input=apply_router_weight_on_input,
                              global_num_experts=global_e, expert_map=chunk_map)
        else:
            y = fused_experts_torch(x, w13, w2, topk_weights, topk_ids, ex.activation,
                                     apply_router_weight_on_input, chunk_map)
        del w13, w2
        out = y if out is None else out.add_(y)
    return out


# ----------------------------------------------------------------------------- vLLM method

class KbitMoEMethod(FusedMoEMethodBase):
    """Three modes, fixed at create time, as KbitLinearMethod's: checkpoint (kbit expert
    tensors), online (`--quantization kbit` on a float checkpoint: float w13_weight / w2_weight,
    quantized after loading), dummy (`--load-format dummy`: random valid kbit experts)."""

    def __init__(self, config, moe, prefix: str):
        super().__init__(moe)
        self.config = config
        self.prefix = prefix

    # -- weights

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        ops.require_kernels(self.prefix)
        bits, moe = self.config.bits, self.moe
        hid, inter = hidden_size, intermediate_size_per_partition
        tp = moe.moe_parallel_config.tp_size
        if layer.activation not in ACTIVATIONS or moe.swiglu_limit is not None:
            raise ValueError(f"kbit MoE layer {self.prefix}: activation {layer.activation.value}"
                             f"{' with a clamp limit' if moe.swiglu_limit is not None else ''} is not supported; "
                             f"list the layer in quantization_config.ignore")
        if moe.has_bias:
            raise ValueError(f"kbit MoE layer {self.prefix}: experts with biases are not supported; "
                             f"list the layer in quantization_config.ignore")
        unpadded = extra_weight_attrs.get("unpadded_hidden_size", hid)
        if hid != unpadded:
            raise ValueError(f"kbit MoE layer {self.prefix}: the MoE backend pads the hidden size {unpadded} "
                             f"to {hid}; kbit experts need it unpadded (list the layer in "
                             f"quantization_config.ignore)")
        if hid % kf.BLOCK_SIZE:
            raise ValueError(f"kbit MoE layer {self.prefix}: hidden size {hid} is not a multiple of the "
                             f"{kf.BLOCK_SIZE}-weight block; list the layer in quantization_config.ignore")
        if inter % kf.BLOCK_SIZE:
            split = f" split over {tp} tensor-parallel ranks into {inter}" if tp > 1 else ""
            raise ValueError(
                f"kbit MoE layer {self.prefix}: expert intermediate size {moe.intermediate_size}{split} is "
                f"not a multiple of the {kf.BLOCK_SIZE}-weight block; use a tensor-parallel size that keeps "
                f"whole blocks per rank (or expert parallelism), or list the layer in quantization_config.ignore")
        n13 = 2 * inter if moe.is_act_and_mul else inter
        layer.kbit_mode = load_mode(self.config)
        layer.kbit_dims = (hid, inter, moe.is_act_and_mul)
        layer.kbit_loaded = {}
        loader = extra_weight_attrs["weight_loader"]
        full_inter = moe.intermediate_size
        if layer.kbit_mode == "online":
            specs = [("w13_weight", (n13, hid), params_dtype, hid), ("w2_weight", (hid, inter), params_dtype, full_inter)]
        else:
            nb = kf.BLOCK_SIZE
            specs = [("w13_qweight", (n13, hid // nb * bits), torch.int32, hid // nb * bits),
                     ("w13_absmax", (n13, hid // nb), torch.uint8, hid // nb),
                     ("w2_qweight", (hid, inter // nb * bits), torch.int32, full_inter // nb * bits),
                     ("w2_absmax", (hid, inter // nb), torch.uint8, full_inter // nb)]
        for name, shape, dtype, cols in specs:
            p = torch.nn.Parameter(torch.empty(num_experts, *shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, p)
            check_dtype = None if layer.kbit_mode == "online" else dtype
            set_weight_attrs(p, {"weight_loader": self._checked_loader(layer, name, loader, check_dtype, cols)})
        if self.config.codebook_per_layer and layer.kbit_mode == "checkpoint":
            for name in ("w13_codebook", "w2_codebook"):
                p = torch.nn.Parameter(torch.empty(num_experts, 1 << bits, dtype=torch.float32), requires_grad=False)
                layer.register_parameter(name, p)
                set_weight_attrs(p, {"weight_loader": self._codebook_loader(layer, name)})

    def _codebook_loader(self, layer, name):
        """Loads expert e's `...experts.{e}.{proj}.codebook` into row e (local id) of `name`. The
        gate and up projections of an expert are one kernel call with one codebook, so they must
        carry equal ones (convert --fit-codebook fits one per fused pair)."""

        def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            full = f"{self.prefix}.{expert_id}.{shard_id}.codebook"
            try:
                cb = kf.check_codebook(loaded_weight, self.config.bits)
            except kf.KbitFormatError as e:
                raise ValueError(f"kbit: {full} ({weight_name}): {e}") from None
            local = layer._map_global_expert_id_to_local_expert_id(expert_id)
            if local < 0:  # another rank's expert (expert parallel)
                return False if return_success else None
            seen = layer.kbit_loaded.setdefault(name, set())
            if any(e == expert_id for e, _ in seen) and not torch.equal(param.data[local].cpu(), cb):
                raise ValueError(
                    f"kbit: {full} ({weight_name}) differs from the codebook of the other projection of "
                    f"expert {expert_id} in {self.prefix}: vLLM runs gate_proj and up_proj (w1 / w3) as one "
                    f"fused layer with one codebook per expert (convert --fit-codebook fits one per pair)")
            param.data[local].copy_(cb)
            seen.add((expert_id, shard_id))
            return True if return_success else None

        load.supports_moe_loading = True
        return load

    def _checked_loader(self, layer, name, loader, dtype, cols):
        """vLLM's expert loader after checks that name the tensor, recording which (expert, shard)
        arrived. vLLM's loader picks its branch by the parameter's name: `absmax` goes down its
        weight branch, which shards it as the qweight's blocks."""

        def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            full = f"{self.prefix}.{expert_id}.{shard_id}.{name.split('_', 1)[1]}"
            if dtype is not None and loaded_weight.dtype != dtype:
                raise ValueError(f"kbit: {full} ({weight_name}) must be {dtype}, the checkpoint has "
                                 f"{loaded_weight.dtype}")
            if loaded_weight.dim() != 2 or loaded_weight.shape[1] != cols:
                raise ValueError(
                    f"kbit: expert tensor {full} ({weight_name}) has shape {tuple(loaded_weight.shape)}; "
                    f"expected [rows, {cols}] for bits={self.config.bits} (is the checkpoint's `bits` right?)")
            vllm_name = weight_name if "weight" in weight_name else f"{weight_name}.weight"
            ok = loader(param, loaded_weight, vllm_name, shard_id=shard_id, expert_id=expert_id,
                        return_success=True)
            if ok:
                layer.kbit_loaded.setdefault(name, set()).add((expert_id, shard_id))
            return ok if return_success else None

        load.supports_moe_loading = True
        return load

    def _check_all_loaded(self, layer, names) -> None:
        for name in names:
            got = layer.kbit_loaded.get(name, set())
            shards = ("w1", "w3") if name.startswith("w13") and layer.kbit_dims[2] else (
                ("w1",) if name.startswith("w13") else ("w2",))
            want = getattr(layer, name).shape[0] * len(shards)
            if len(got) < want:
                have = {(e, s) for e, s in got}
                missing = next((f"expert {e} {s}" for e in range(layer.global_num_experts) for s in shards
                                if (e, s) not in have and layer._map_global_expert_id_to_local_expert_id(e) >= 0),
                               "?")
                raise ValueError(f"kbit: {self.prefix}.{name} is missing from the checkpoint "
                                 f"({len(got)} of {want} expert shards loaded; first missing: {missing})")

    def process_weights_after_loading(self, layer) -> None:
        bits, cb = self.config.bits, self.config.codebook
        if layer.kbit_mode == "online":
            self._check_all_loaded(layer, ("w13_weight", "w2_weight"))
            tensors = {}
            for src, dst in (("w13_weight", "w13"), ("w2_weight", "w2")):
                w = getattr(layer, src).data
                qs, abs_ = zip(*[ops.quantize(w[e], bits, cb, name=f"{self.prefix}.{e}.{dst}")[:2]
                                 for e in range(w.shape[0])])
                tensors[dst] = (torch.stack(qs), torch.stack(abs_))
                delattr(layer, src)
        else:
            if layer.kbit_mode == "dummy":
                for w in ("w13", "w2"):
                    fill_dummy(getattr(layer, f"{w}_qweight").data, getattr(layer, f"{w}_absmax").data)
            else:
                self._check_all_loaded(layer, ("w13_qweight", "w13_absmax", "w2_qweight", "w2_absmax"))
            tensors = {w: (getattr(layer, f"{w}_qweight").data, getattr(layer, f"{w}_absmax").data)
                       for w in ("w13", "w2")}
        per_expert = {}
        if hasattr(layer, "w13_codebook"):  # quantization_config.codebook_per_layer
            self._check_all_loaded(layer, ("w13_codebook", "w2_codebook"))
            for w in ("w13", "w2"):
                per_expert[w] = getattr(layer, f"{w}_codebook").data.float()
                delattr(layer, f"{w}_codebook")
        for w, (q, a) in tensors.items():
            packed, absmax = repack_experts(q, a, bits)
            for name, t in ((f"{w}_qweight", packed), (f"{w}_absmax", absmax)):
                param = torch.nn.Parameter(t, requires_grad=False)
                if hasattr(layer, name):
                    replace_parameter(layer, name, param)
                else:
                    layer.register_parameter(name, param)
        device = layer.w13_qweight.device
        layer.register_buffer("kbit_codebook", per_expert.get("w13", cb).to(device), persistent=False)
        layer.register_buffer("kbit_w2_codebook", per_expert["w2"].to(device) if per_expert else None,
                              persistent=False)
        hid, inter, gated = layer.kbit_dims
        layer.kbit_dense_chunk = dense_chunk_size(hid, (2 if gated else 1) * inter, inter)
        layer.kbit_dense_maps = dense_expert_maps(layer.expert_map, layer.global_num_experts,
                                                  layer.w13_qweight.shape[0], layer.kbit_dense_chunk, device)
        layer.kbit_experts = self.experts(layer)

    # -- forward

    def get_fused_moe_quant_config(self, layer):
        # apply() calls no quantized vLLM kernel (fused_experts runs on dequantized experts);
        # not None, so that vLLM does not ask again on every forward
        return FUSED_MOE_UNQUANTIZED_CONFIG

    def experts(self, layer) -> KbitExperts:
        hid, inter, gated = layer.kbit_dims
        return KbitExperts(w13=layer.w13_qweight, w13_absmax=layer.w13_absmax, w2=layer.w2_qweight,
                           w2_absmax=layer.w2_absmax, codebook=layer.kbit_codebook, bits=self.config.bits,
                           hidden=hid, inter=inter, gated=gated, activation=layer.activation,
                           global_num_experts=layer.global_num_experts, expert_map=layer.expert_map,
                           dense_maps=layer.kbit_dense_maps, dense_chunk=layer.kbit_dense_chunk,
                           w2_codebook=layer.kbit_w2_codebook)

    def select_gemm_impl(self, prepare_finalize, layer):
        # vLLM asks for a modular experts kernel where it wraps the MoE layer: LoRA on the
        # experts (FusedMoEWithLoRA), or an all-to-all expert-parallel backend. kbit experts
        # run in apply() only, and vLLM's default message here speaks of its own kernel setup.
        raise ValueError(
            f"kbit MoE layer {self.prefix}: vLLM asks for a modular MoE kernel (LoRA on the experts, "
            f"or an all-to-all expert-parallel backend), which kbit experts do not provide. With "
            f"--enable-lora, leave the experts out of --lora-target-modules (e.g. --lora-target-modules "
            f"q_proj k_proj v_proj o_proj); or list the layer in quantization_config.ignore")

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        # the MoE runner runs the shared experts itself (this method has no modular kernel)
        return experts_forward(layer.kbit_experts, x, topk_weights, topk_ids,
                               apply_router_weight_on_input=layer.apply_router_weight_on_input)
