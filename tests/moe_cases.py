"""Shared pieces of the kbit MoE tests (test_moe_kernels_gpu.py, test_moe_grouped_gpu.py,
test_moe_ref.py, sanitize_moe.py).

* align_ref: a pure-torch moe_align_block_size with vLLM's contract: the (token, expert) pairs
  p = t * top_k + j grouped by expert (ascending p inside an expert), each expert's run padded
  to a multiple of block_m with the padding id num_pairs, expert_ids per block (mapped through
  expert_map: -1 for experts not on this rank), num_tokens_post_padded = the padded length.
  The tail past num_tokens_post_padded is filled with deliberately misleading entries (a real
  pair id, a real expert): vLLM leaves that tail unspecified, so a kernel must not read it.
* align: vLLM's moe_align_block_size where it runs (a CUDA build of vLLM), else align_ref.
* moe_reference: float64 y[p] = x[p // top_k] @ W_e^T (* topk_weights[p]) from the routing
  itself (independent of the sorting), rows of experts off this rank 0; moe_expected: the same
  as a kernel_check.Reference, the per-element comparison every MoE kernel test makes.
* activation_outside: the same comparison for kbit::moe_gemm_grouped's fused activations, the
  bound carried through the activation.
"""
import functools

import torch

from vllm_kbit import format as kf
from vllm_kbit import ops

import kernel_check as kc

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def align_ref(topk_ids, block_m, num_experts, expert_map=None):
    flat = topk_ids.reshape(-1).long()
    dev = flat.device
    num_pairs = flat.numel()
    size = num_pairs + num_experts * (block_m - 1)
    if num_pairs < num_experts:
        size = min(num_pairs * block_m, size)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    run_start = torch.cumsum(padded, 0) - padded           # where each expert's run begins
    first_pair = torch.cumsum(counts, 0) - counts          # rank of the expert's first pair in `order`
    order = torch.argsort(flat, stable=True)               # pairs by expert, ascending pair id
    e_sorted = flat[order]
    pos = run_start[e_sorted] + torch.arange(num_pairs, device=dev) - first_pair[e_sorted]
    ntpp = int(padded.sum())
    blocks = (size + block_m - 1) // block_m
    # the tail past ntpp: a real pair and an expert it is not routed to (see the module doc)
    decoy_expert = (int(flat[0]) + 1) % num_experts if num_pairs else 0
    sorted_ids = torch.zeros(size, dtype=torch.int32, device=dev)
    sorted_ids[:ntpp] = num_pairs
    sorted_ids[pos] = order.to(torch.int32)
    expert_ids = torch.full((blocks,), decoy_expert, dtype=torch.int32, device=dev)
    expert_ids[:ntpp // block_m] = torch.repeat_interleave(torch.arange(num_experts, device=dev),
                                                           padded // block_m).to(torch.int32)
    if expert_map is not None:
        expert_ids[:ntpp // block_m] = expert_map.to(dev)[expert_ids[:ntpp // block_m].long()].to(torch.int32)
    return sorted_ids, expert_ids, torch.tensor([ntpp], dtype=torch.int32, device=dev)


@functools.lru_cache(maxsize=None)
def vllm_align():
    """vLLM's moe_align_block_size if it runs here (a CUDA build of vLLM on a GPU), else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
        moe_align_block_size(torch.zeros(1, 1, dtype=torch.int32, device="cuda"), 16, 4)
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 (not built for CUDA, or any import problem: the pure-torch one serves)
        return None
    return moe_align_block_size


def align(topk_ids, block_m, num_experts, expert_map=None):
    fn = vllm_align() if topk_ids.is_cuda else None
    if fn is None:
        return align_ref(topk_ids, block_m, num_experts, expert_map)
    return fn(topk_ids.to(torch.int32), block_m, num_experts, expert_map)


def routing(m, num_experts, top_k, device, seed):
    """(topk_ids int32 [m, top_k], topk_weights float32 [m, top_k]) as vLLM's fused_topk makes
    them: top-k of random logits, softmax weights renormalised."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(m, num_experts, generator=g, device=device)
    w, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def make_experts(num_experts, n, k, bits, device, seed):
    """Random float experts quantized with ops.quantize: (qweight [E, n, k/32*bits], absmax
    [E, n, k/32], codebook, W float64 [E, n, k]). Row scales differ per expert."""
    g = torch.Generator(device=device).manual_seed(seed)
    cb = kf.normal_float_codebook(bits, device)
    qs, as_ = [], []
    for e in range(num_experts):
        w = torch.randn(n, k, generator=g, device=device) * (0.02 * (1 + e % 5))
        q, a, _ = ops.quantize(w, bits, cb)
        qs.append(q)
        as_.append(a)
    qweight, absmax = torch.stack(qs), torch.stack(as_)
    w64 = torch.stack([kf.dequantize(qweight[e], absmax[e], bits, cb, dtype=torch.float64)
                       for e in range(num_experts)])
    return qweight, absmax, cb, w64


def stack_tiled(qweight, absmax, bits):
    """Each expert through ops.repack, stacked: (packed [E, P], absmax [E, U])."""
    tiles = [ops.repack(qweight[e], absmax[e], bits) for e in range(qweight.shape[0])]
    return torch.stack([p for p, _ in tiles]), torch.stack([a for _, a in tiles])


def moe_reference(x, topk_ids, topk_weights, w64, top_k, expert_map=None):
    """float64 [num_pairs, n]; x holds T = num_pairs / top_k rows (top_k = 1: one row a pair)."""
    flat = topk_ids.reshape(-1).long()
    y = torch.zeros(flat.numel(), w64.shape[1], dtype=torch.float64, device=x.device)
    for e in flat.unique().tolist():
        local = int(expert_map[e]) if expert_map is not None else e
        if local < 0:
            continue
        pairs = (flat == e).nonzero().squeeze(1)
        y[pairs] = x[pairs // top_k].double() @ w64[local].t()
    if topk_weights is not None:
        y *= topk_weights.reshape(-1, 1).double()
    return y


def moe_expected(x, topk_ids, topk_weights, w64, top_k, expert_map=None):
    """moe_reference as a kernel_check.Reference (the bound of each element from its own pair)."""
    return kc.reference(lambda a, w: moe_reference(a, topk_ids, None, w, top_k, expert_map), x, w64,
                        row_weights=topk_weights)


def row_errors(y, ref):
    """Relative error of each row (rows whose reference is 0 compare absolutely)."""
    d = (y.double() - ref).norm(dim=1)
    r = ref.norm(dim=1)
    return torch.where(r > 0, d / r.clamp_min(1e-300), d)


# Largest slope of each activation (its derivative's supremum; relu2's grows with |t|: 2 |t|).
ACT_SLOPE = {"none": 1.0, "silu": 1.1, "gelu": 1.13, "gelu_tanh": 1.13}  # silu' <= 1.0998, gelu' <= 1.1290


def activation_outside(y, x, topk_ids, topk_weights, w64, top_k, activation, dtype, expert_map=None):
    """bool, y's shape: the elements of kbit::moe_gemm_grouped's output with fused `activation`
    (ops.MOE_ACTIVATIONS code) outside the bound of the float64 reference. The bound carries
    kernel_check's bound b of each pre-activation element h through the activation: |act(h) -
    act(h')| <= slope * b, and for the gated ones act(g) u within slope b_g (|u| + b_u) +
    |act(g)| b_u; then the router weight and one output rounding."""
    ref = kc.reference(lambda a, w: moe_reference(a, topk_ids, None, w, top_k, expert_map), x, w64)
    h, b = ref.value, kc.bound(ref, dtype)
    name = ops.MOE_ACTIVATIONS[activation]
    gated = name.endswith("_and_mul")
    base = name[:-len("_and_mul")] if gated else name
    fn = ops.MOE_ACTIVATION_FNS[base]
    if gated:
        g, u = h.chunk(2, dim=-1)
        bg, bu = b.chunk(2, dim=-1)
        slope = 2 * (g.abs() + bg) if base == "relu2" else ACT_SLOPE[base]
        value = fn(g) * u
        err = slope * bg * (u.abs() + bu) + fn(g).abs() * bu
    else:
        slope = 2 * (h.abs() + b) if base == "relu2" else ACT_SLOPE[base]
        value, err = fn(h), slope * b
    if topk_weights is not None:
        r = topk_weights.reshape(-1, 1).double()
        value, err = value * r, err * r.abs()
    fi = torch.finfo(dtype)
    lim = err + fi.eps * value.abs() + fi.smallest_normal
    return ~((y.double() - value).abs() <= lim)
