"""vLLM's fused-MoE pieces that vllm_kbit/moe.py composes, with torch stand-ins where vLLM
has only CUDA kernels: alignment (moe_align_block_size), the activation, moe_sum and the
unquantized fused_experts. On a CUDA tensor each calls vLLM's kernel; on the CPU it runs the
torch equivalent, so the kbit MoE layer runs (and is tested) on a CPU machine unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe.activation import MoEActivation

# Activations whose vLLM kernel (apply_moe_activation) takes no clamp parameters, with the
# torch equivalent the CPU path runs.
ACTIVATIONS = {
    MoEActivation.SILU: lambda g, u: F.silu(g) * u,
    MoEActivation.GELU: lambda g, u: F.gelu(g) * u,
    MoEActivation.GELU_TANH: lambda g, u: F.gelu(g, approximate="tanh") * u,
    MoEActivation.SILU_NO_MUL: F.silu,
    MoEActivation.GELU_NO_MUL: F.gelu,
    MoEActivation.GELU_TANH_NO_MUL: lambda t: F.gelu(t, approximate="tanh"),
    MoEActivation.RELU2_NO_MUL: lambda t: F.relu(t).square(),
}


def align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int,
                     expert_map: torch.Tensor | None):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) as vLLM's moe_align_block_size
    with ignore_invalid_experts=True (pairs of experts not on this rank are left out; expert ids
    are local). `num_experts` is the global count. On the CPU, a torch equivalent."""
    if topk_ids.is_cuda:
        from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
        return moe_align_block_size(topk_ids, block_m, num_experts, expert_map, ignore_invalid_experts=True)
    return align_block_size_torch(topk_ids, block_m, num_experts, expert_map)


def align_block_size_torch(topk_ids, block_m, num_experts, expert_map=None):
    """moe_align_block_size in torch (host-synchronising; CPU and tests): each expert's pairs in
    ascending order, padded with num_pairs to a multiple of block_m; unused blocks get -1."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    size = num_pairs + num_experts * (block_m - 1)
    if num_pairs < num_experts:
        size = min(num_pairs * block_m, size)
    local = expert_map.long()[flat] if expert_map is not None else flat
    sorted_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=flat.device)
    expert_ids = torch.full((-(-size // block_m),), -1, dtype=torch.int32, device=flat.device)
    pos = 0
    for e in range(num_experts):
        pairs = (local == e).nonzero().flatten()
        if pairs.numel() == 0:
            continue
        sorted_ids[pos:pos + pairs.numel()] = pairs.to(torch.int32)
        blocks = -(-pairs.numel() // block_m)
        expert_ids[pos // block_m:pos // block_m + blocks] = e
        pos += blocks * block_m
    return sorted_ids, expert_ids, torch.tensor([pos], dtype=torch.int32, device=flat.device)


def moe_activation(activation: MoEActivation, h: torch.Tensor) -> torch.Tensor:
    """vLLM's MoE activation of the w13 output [P, N13] -> [P, I]."""
    gated = activation.is_gated
    out = h.new_empty((h.shape[0], h.shape[1] // 2 if gated else h.shape[1]))
    if h.is_cuda:
        from vllm.model_executor.layers.fused_moe.activation import apply_moe_activation
        apply_moe_activation(activation, out, h)
        return out
    fn = ACTIVATIONS[activation]
    hf = h.float()
    out.copy_(fn(*hf.chunk(2, dim=-1)) if gated else fn(hf))
    return out


def moe_sum(y: torch.Tensor) -> torch.Tensor:
    """[M, top_k, H] -> [M, H]: vLLM's moe_sum on the GPU."""
    if y.is_cuda:
        from vllm import _custom_ops
        out = y.new_empty((y.shape[0], y.shape[2]))
        _custom_ops.moe_sum(y, out)
        return out
    return y.sum(dim=1)


def fused_experts_torch(x, w13, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
                         expert_map):
    """vLLM's fused_experts (unquantized, with an expert map) in torch, for the CPU."""
    m, top_k = topk_ids.shape
    local = expert_map.long()[topk_ids.long()] if expert_map is not None else topk_ids.long()
    rows = x.float().repeat_interleave(top_k, dim=0)
    tw = topk_weights.float().reshape(-1, 1)
    if apply_router_weight_on_input:
        rows = rows * tw
    y = torch.zeros(m * top_k, w2.shape[1], dtype=torch.float32)
    for e in range(w13.shape[0]):
        h = (rows @ w13[e].float().t()).to(x.dtype)
        a = moe_activation(activation, h)
        y = torch.where((local.reshape(-1) == e).unsqueeze(1), (a.float() @ w2[e].float().t()), y)
    if not apply_router_weight_on_input:
        y = y * tw
    return y.to(x.dtype).reshape(m, top_k, -1).sum(1)
