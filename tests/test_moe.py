"""kbit MoE: the two MoE ops against float64 per-pair loops, the routed-experts forward (both
paths) against float64 experts through the same routing, and KbitMoEMethod inside vLLM's real
MoE layer (loading through vLLM's expert loader, tensor / expert parallel sharding, online and
dummy modes, clear errors).

Runs on the CPU (the ops' reference path and torch stand-ins for vLLM's CUDA MoE pieces) and,
unchanged, on a GPU with the CUDA kernels and vLLM's MoE ops."""
import contextlib
import json
import zlib
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm")

import vllm_kbit  # noqa: E402
from vllm_kbit import format as kf  # noqa: E402
from vllm_kbit import ops  # noqa: E402

vllm_kbit.register()

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod  # noqa: E402

from vllm_kbit.config import KbitConfig  # noqa: E402
from vllm_kbit.moe import (KbitExperts, KbitMoEMethod, align_block_size, dense_expert_maps,  # noqa: E402
                           experts_forward, repack_experts)
from vllm_kbit.moe_cpu import align_block_size_torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


pytestmark = pytest.mark.usefixtures("vllm_single_process")


def rel_err(y, ref):
    return ((y.double().cpu() - ref).norm() / ref.norm()).item()


def random_experts(num, n, k, bits, gen, cb=None):
    """Checkpoint tensors of `num` random experts [n, k] and their float64 dequantization."""
    qs, abs_ = zip(*[kf.quantize(torch.randn(n, k, generator=gen) * 0.05, bits, cb) for _ in range(num)])
    q, a = torch.stack(qs), torch.stack(abs_)
    w = torch.stack([kf.dequantize(q[e], a[e], bits, cb, dtype=torch.float64) for e in range(num)])
    return q, a, w


def routing(m, num_experts, top_k, gen, mode="random"):
    logits = torch.randn(m, num_experts, generator=gen)
    if mode == "one_expert":  # every token's first choice is expert 1
        logits[:, 1] += 100
    if mode == "skip_odd":  # odd experts get no token (when top_k allows)
        logits[:, 1::2] -= 100
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


# ----------------------------------------------------------------------------- ops

def _pair_reference(x, w, local_ids, top_k, weights=None):
    """float64 loop over pairs: y[p] = x[p // top_k] @ W[e]^T (* weight), 0 where e < 0."""
    num_pairs = x.shape[0] * top_k
    y = torch.zeros(num_pairs, w.shape[1], dtype=torch.float64)
    flat_w = None if weights is None else weights.reshape(-1).double()
    for p in range(num_pairs):
        e = int(local_ids.reshape(-1)[p])
        if e < 0:
            continue
        y[p] = x[p // top_k].double() @ w[e].t()
        if flat_w is not None:
            y[p] *= flat_w[p]
    return y


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
@pytest.mark.parametrize("case", ["odd", "one_expert", "idle_experts", "expert_parallel", "skipped_blocks"])
def test_moe_gemm_equals_float64_pair_loop(case, bits, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(f"moe_gemm-{case}-{bits}".encode()))
    num, n, k, top_k, m = {"odd": (5, 96, 64, 3, 7), "one_expert": (3, 64, 96, 2, 33),
                           "idle_experts": (6, 64, 64, 2, 5), "expert_parallel": (7, 64, 64, 2, 9),
                           "skipped_blocks": (4, 64, 64, 2, 11)}[case]
    q, a, w = random_experts(num, n, k, bits, gen)
    weights, ids = routing(m, num, top_k, gen, {"one_expert": "one_expert", "idle_experts": "skip_odd"}.get(case, "random"))
    expert_map = None
    local = ids.long()
    if case == "expert_parallel":  # this rank holds global experts 1, 3, 4 as local 0, 1, 2
        expert_map = torch.full((num,), -1, dtype=torch.int32)
        expert_map[torch.tensor([1, 3, 4])] = torch.arange(3, dtype=torch.int32)
        local = expert_map.long()[ids.long()]
        q, a, w = q[[1, 3, 4]], a[[1, 3, 4]], w[[1, 3, 4]]
    block_m = 16 if case != "odd" else 5
    sorted_ids, expert_ids, num_post = align_block_size_torch(ids, block_m, num, expert_map)
    if case == "skipped_blocks":  # blocks of expert 2 marked off-rank (-1), as vLLM's map does
        local = torch.where(local == 2, -1, local)
        expert_ids = torch.where(expert_ids == 2, -1, expert_ids)
    assert (sorted_ids == m * top_k).any(), "the layout must contain padding ids"
    packed, absmax = repack_experts(q.to(DEVICE), a.to(DEVICE), bits)
    x = torch.randn(m, k, generator=gen).to(dtype)
    cb = kf.default_codebook(bits).to(DEVICE)
    dev = {t: t.to(DEVICE) for t in (sorted_ids, expert_ids, num_post)}
    for tw in (None, weights):
        y = torch.ops.kbit.moe_gemm(x.to(DEVICE), packed, absmax, cb, bits, n, k, dev[sorted_ids], dev[expert_ids],
                         dev[num_post], block_m, top_k, None if tw is None else tw.to(DEVICE))
        ref = _pair_reference(x, w, local, top_k, tw)
        assert y.dtype == dtype and y.shape == (m * top_k, n)
        dropped = local.reshape(-1) < 0
        assert torch.equal(y.cpu()[dropped], torch.zeros_like(y.cpu()[dropped])), "uncovered pairs must be 0"
        assert torch.isfinite(y).all() and rel_err(y, ref) < TOL[dtype]


def test_moe_gemm_skips_blocks_past_num_tokens_post_padded():
    gen = torch.Generator().manual_seed(1)
    q, a, w = random_experts(3, 64, 64, 4, gen)
    _, ids = routing(6, 3, 1, gen)
    sorted_ids, expert_ids, num_post = align_block_size_torch(ids, 4, 3)
    last = int(num_post) - 4  # the last used block's start: only its pairs go missing
    cut = torch.tensor([last], dtype=torch.int32)
    packed, absmax = repack_experts(q.to(DEVICE), a.to(DEVICE), 4)
    x = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    y = torch.ops.kbit.moe_gemm(x.to(DEVICE), packed, absmax, kf.default_codebook(4).to(DEVICE), 4, 64, 64,
                     sorted_ids.to(DEVICE), expert_ids.to(DEVICE), cut.to(DEVICE), 4, 1).cpu()
    gone = sorted_ids[last:last + 4]
    gone = gone[gone < 6].long()
    kept = torch.ones(6, dtype=torch.bool)
    kept[gone] = False
    assert gone.numel() > 0 and torch.equal(y[gone], torch.zeros_like(y[gone]))
    ref = _pair_reference(x, w, ids.long(), 1)
    assert rel_err(y[kept], ref[kept]) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
def test_dequantize_experts(bits, dtype):
    gen = torch.Generator().manual_seed(100 + bits)
    q, a, w = random_experts(5, 96, 64, bits, gen)
    packed, absmax = repack_experts(q.to(DEVICE), a.to(DEVICE), bits)
    cb = kf.default_codebook(bits).to(DEVICE)
    out = torch.ops.kbit.dequantize_experts(packed, absmax, cb, bits, 96, 64, dtype)
    assert out.shape == (5, 96, 64) and out.dtype == dtype
    # the codebook value times the scale in float32, rounded to dtype: exactly format.dequantize
    want = torch.stack([kf.dequantize(q[e], a[e], bits, cb.cpu(), dtype=dtype) for e in range(5)])
    assert torch.equal(out.cpu(), want)
    assert (out.cpu().double() - w).abs().max() <= w.abs().max() * 2.0 ** -7
    part = torch.ops.kbit.dequantize_experts(packed[1:4], absmax[1:4], cb, bits, 96, 64, dtype)  # a chunk of experts
    assert torch.equal(part.cpu(), want[1:4])


def test_op_fake_impls_and_reference_errors():
    gen = torch.Generator().manual_seed(2)
    q, a, _ = random_experts(3, 64, 64, 3, gen)
    packed, absmax = repack_experts(q.to(DEVICE), a.to(DEVICE), 3)
    cb = kf.default_codebook(3).to(DEVICE)
    _, ids = routing(5, 3, 2, gen)
    s, e, p = (t.to(DEVICE) for t in align_block_size_torch(ids, 16, 3))
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    tw = torch.rand(5, 2, generator=gen).to(DEVICE)
    torch.library.opcheck(torch.ops.kbit.moe_gemm.default, (x, packed, absmax, cb, 3, 64, 64, s, e, p, 16, 2, tw),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.kbit.dequantize_experts.default, (packed, absmax, cb, 3, 64, 64, torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor"))
    if not ops.HAS_CUDA_KERNELS:
        with pytest.raises(ValueError, match=r"moe_gemm: packed is .*expects int32 \[E, 96, 6\]"):
            torch.ops.kbit.moe_gemm(x, packed, absmax, cb, 3, 96, 64, s, e, p, 16, 2)


def test_align_block_size_layout():
    """The torch alignment (CPU) lays pairs out as vLLM's op does: each pair once, in blocks of
    one expert, padded with num_pairs; with an expert map, pairs of other ranks' experts left out."""
    gen = torch.Generator().manual_seed(3)
    _, ids = routing(13, 6, 2, gen)
    expert_map = torch.tensor([0, -1, 1, -1, 2, 3], dtype=torch.int32)
    for emap in (None, expert_map):
        s, e, n = align_block_size_torch(ids, 4, 6, emap)
        local = ids.reshape(-1).long() if emap is None else emap.long()[ids.reshape(-1).long()]
        used = s[:int(n)]
        real = used[used < 26].long()
        assert sorted(real.tolist()) == sorted((local >= 0).nonzero().flatten().tolist())
        blocks = e[:int(n) // 4].long()
        assert (blocks >= 0).all() and torch.equal(local[real], blocks.repeat_interleave(4)[used < 26])
        if DEVICE == "cuda":  # vLLM's CUDA op: the same pairs in the same blocks (order within may differ)
            s2, e2, n2 = align_block_size(ids.to(DEVICE), 4, 6, None if emap is None else emap.to(DEVICE))
            assert int(n2) == int(n) and torch.equal(e2[:int(n) // 4].cpu(), e[:int(n) // 4])


# ----------------------------------------------------------------------------- forward

def _experts_reference(x, w13, w2, weights, ids, activation, local=None, on_input=False):
    """float64: sum_k weight_k * down(act(gate_up(x))) of expert ids[:, k]."""
    x = x.double()
    local = ids.long() if local is None else local
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    act = {MoEActivation.SILU: lambda h: torch.nn.functional.silu(h[:, :h.shape[1] // 2]) * h[:, h.shape[1] // 2:],
           MoEActivation.GELU_NO_MUL: torch.nn.functional.gelu}[activation]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(local[t, j])
            if e < 0:
                continue
            xin = x[t:t + 1] * weights[t, j].double() if on_input else x[t:t + 1]
            y = act(xin @ w13[e].t()) @ w2[e].t()
            out[t] += y[0] * (1.0 if on_input else weights[t, j].double())
    return out


def make_experts(num, hidden, inter, bits, gen, activation=MoEActivation.SILU, expert_map=None, dense_chunk=0):
    gated = activation.is_gated
    q13, a13, w13 = random_experts(num, (2 if gated else 1) * inter, hidden, bits, gen)
    q2, a2, w2 = random_experts(num, hidden, inter, bits, gen)
    p13, b13 = repack_experts(q13.to(DEVICE), a13.to(DEVICE), bits)
    p2, b2 = repack_experts(q2.to(DEVICE), a2.to(DEVICE), bits)
    global_e = num if expert_map is None else expert_map.numel()
    ex = KbitExperts(p13, b13, p2, b2, kf.default_codebook(bits).to(DEVICE), bits, hidden, inter, gated,
                     activation, global_e, None if expert_map is None else expert_map.to(DEVICE))
    if dense_chunk:
        ex.dense_chunk = dense_chunk
        ex.dense_maps = dense_expert_maps(expert_map, global_e, num, dense_chunk, DEVICE)
    return ex, w13, w2


def skip_unavailable(path):
    """The grouped path runs the reference op on the CPU, its kernel on a Hopper GPU only."""
    if path == "grouped" and DEVICE == "cuda" and not ops.has_moe_grouped():
        pytest.skip("no grouped MoE kernel on this build / GPU")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
@pytest.mark.parametrize("path", ["gemm", "grouped", "dense"])
def test_experts_forward_equals_float64_experts(path, bits, dtype):
    skip_unavailable(path)
    gen = torch.Generator().manual_seed(zlib.crc32(f"forward-{path}-{bits}".encode()))
    num, hidden, inter, top_k, m = 5, 64, 96, 2, 7
    ex, w13, w2 = make_experts(num, hidden, inter, bits, gen, dense_chunk=2)  # 3 chunks: 2 + 2 + 1
    weights, ids = routing(m, num, top_k, gen)
    x = torch.randn(m, hidden, generator=gen).to(dtype)
    y = experts_forward(ex, x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), path=path)
    assert y.shape == (m, hidden) and y.dtype == dtype and torch.isfinite(y).all()
    assert rel_err(y, _experts_reference(x, w13, w2, weights, ids, MoEActivation.SILU)) < 2 * TOL[dtype]


@pytest.mark.parametrize("path", ["gemm", "grouped", "dense"])
@pytest.mark.parametrize("variant", ["expert_parallel", "router_weight_on_input", "no_mul"])
def test_experts_forward_variants(variant, path):
    skip_unavailable(path)
    gen = torch.Generator().manual_seed(zlib.crc32(f"variant-{variant}-{path}".encode()))
    dtype, bits, hidden, inter = torch.bfloat16, 4, 64, 64
    act = MoEActivation.GELU_NO_MUL if variant == "no_mul" else MoEActivation.SILU
    expert_map = None
    num_global, top_k = 6, (1 if variant == "router_weight_on_input" else 3)
    if variant == "expert_parallel":  # this rank: global experts 0, 2, 5
        expert_map = torch.full((6,), -1, dtype=torch.int32)
        expert_map[torch.tensor([0, 2, 5])] = torch.arange(3, dtype=torch.int32)
    ex, w13, w2 = make_experts(3 if expert_map is not None else 6, hidden, inter, bits, gen, act, expert_map,
                               dense_chunk=2)
    weights, ids = routing(9, num_global, top_k, gen)
    local = None if expert_map is None else expert_map.long()[ids.long()]
    x = torch.randn(9, hidden, generator=gen).to(dtype)
    on_input = variant == "router_weight_on_input"
    y = experts_forward(ex, x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), on_input, path=path)
    ref = _experts_reference(x, w13, w2, weights, ids, act, local, on_input)
    assert rel_err(y, ref) < 3e-2


def test_sparse_blocks_skip_the_align():
    """Few pairs and no expert map: every pair is its own block (no moe_align_block_size), with
    the same result as the sorted blocks; two tokens on one expert included."""
    gen = torch.Generator().manual_seed(5)
    ex, _, _ = make_experts(8, 64, 64, 3, gen)
    ids = torch.tensor([[2, 5], [5, 7]], dtype=torch.int32)
    weights = torch.rand(2, 2, generator=gen)
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    args = (ex, x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE))
    with mock.patch("vllm_kbit.moe.align_block_size", side_effect=RuntimeError("aligned")):
        sparse = experts_forward(*args)  # 4 pairs <= 0.5 * 8 experts
    with mock.patch("vllm_kbit.moe.SPARSE_MAX_PAIRS_PER_EXPERT", 0):
        aligned = experts_forward(*args)
    assert rel_err(sparse, aligned.double()) < 1e-2


def test_path_switch_and_errors():
    gen = torch.Generator().manual_seed(4)
    ex, _, _ = make_experts(4, 64, 64, 4, gen, dense_chunk=4)
    weights, ids = routing(3, 4, 2, gen)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="apply_router_weight_on_input needs top_k = 1"):
        experts_forward(ex, x, weights.to(DEVICE), ids.to(DEVICE), True)
    with pytest.raises(ValueError, match="path must be"):
        experts_forward(ex, x, weights.to(DEVICE), ids.to(DEVICE), path="fast")
    with pytest.raises(ValueError, match="path must be one of 'gemm', 'grouped', 'dense'"):
        experts_forward(ex, x, weights.to(DEVICE), ids.to(DEVICE), path="Grouped")
    with mock.patch("vllm_kbit.moe._forward_dense", side_effect=RuntimeError("dense")), \
            mock.patch("vllm_kbit.moe._forward_grouped", side_effect=RuntimeError("grouped")):
        experts_forward(ex, x, weights.to(DEVICE), ids.to(DEVICE))  # 6 pairs: the gemm path
        with mock.patch("vllm_kbit.moe.DENSE_MIN_PAIRS_PER_EXPERT", 1), \
                mock.patch("vllm_kbit.moe.GROUPED_MIN_PAIRS_PER_EXPERT", 1), \
                mock.patch("vllm_kbit.moe.GROUPED_CHOSEN", True):
            with mock.patch("vllm_kbit.ops.has_moe_grouped", return_value=False), \
                    pytest.raises(RuntimeError, match="dense"):
                experts_forward(ex, x, weights.to(DEVICE), ids.to(DEVICE))  # no grouped kernel: dense
            with mock.patch("vllm_kbit.ops.has_moe_grouped", return_value=True), \
                    pytest.raises(RuntimeError, match="grouped"):
                experts_forward(ex, x, weights.to(DEVICE), ids.to(DEVICE))  # Hopper: the grouped kernel
            with pytest.raises(RuntimeError, match="dense"):
                experts_forward(ex, x, weights.to(DEVICE), ids.to(DEVICE), path="dense")  # still forced


def test_grouped_path_choices():
    """The path by pairs per expert and kernel, the block_m by pairs per expert, and the
    activations the grouped kernel fuses: every one the layer accepts, the same function as the
    activation vLLM runs between the GEMMs."""
    from vllm_kbit import moe
    from vllm_kbit.moe_cpu import ACTIVATIONS, moe_activation
    low, high = moe.GROUPED_MIN_PAIRS_PER_EXPERT, moe.DENSE_MIN_PAIRS_PER_EXPERT
    with mock.patch("vllm_kbit.ops.has_moe_grouped", return_value=True), mock.patch("vllm_kbit.moe.GROUPED_CHOSEN", True):
        assert moe.choose_path((low - 1) * 8, 8) == "gemm" and moe.choose_path(low * 8, 8) == "grouped"
        assert moe.choose_path(high * 8, 8) == "grouped"
    with mock.patch("vllm_kbit.ops.has_moe_grouped", return_value=True), mock.patch("vllm_kbit.moe.GROUPED_CHOSEN", False):
        assert moe.choose_path(high * 8, 8) == "dense"  # until it has run on a GPU: the measured paths
    with mock.patch("vllm_kbit.ops.has_moe_grouped", return_value=False):
        assert moe.choose_path(low * 8, 8) == "gemm"
        assert moe.choose_path((high - 1) * 8, 8) == "gemm" and moe.choose_path(high * 8, 8) == "dense"
    mid, tall = moe.GROUPED_MT128_MIN_PAIRS_PER_EXPERT, moe.GROUPED_MT256_MIN_PAIRS_PER_EXPERT
    assert [moe.grouped_block_m(p * 8, 8) for p in (mid - 1, mid, tall - 1, tall)] == [64, 128, 128, 256]
    assert set(moe.GROUPED_ACTIVATIONS) == set(ACTIVATIONS)
    h = torch.randn(5, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for act, code in moe.GROUPED_ACTIVATIONS.items():
        assert ops.moe_activation_gated(code) == act.is_gated, act
        torch.testing.assert_close(ops.moe_activation_apply(code, h.float()), moe_activation(act, h.float()))


def test_grouped_op_fake_and_reference_errors():
    gen = torch.Generator().manual_seed(6)
    q, a, _ = random_experts(3, 128, 64, 3, gen)
    packed, absmax = repack_experts(q.to(DEVICE), a.to(DEVICE), 3)
    cb = kf.default_codebook(3).to(DEVICE)
    _, ids = routing(5, 3, 2, gen)
    s, e, p = (t.to(DEVICE) for t in align_block_size_torch(ids, 64, 3))
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    tw = torch.rand(5, 2, generator=gen).to(DEVICE)
    if DEVICE == "cpu" or ops.has_moe_grouped():
        for act in (0, 1):
            torch.library.opcheck(torch.ops.kbit.moe_gemm_grouped.default,
                                  (x, packed, absmax, cb, 3, 128, 64, s, e, p, 64, 2, tw, act, True),
                                  test_utils=("test_schema", "test_faketensor"))
        y = torch.ops.kbit.moe_gemm_grouped(x, packed, absmax, cb, 3, 128, 64, s, e, p, 64, 2, None, 1)
        assert y.shape == (10, 64)
    if not ops.HAS_CUDA_KERNELS:
        with pytest.raises(ValueError, match="block_m must be 64, 128 or 256"):
            torch.ops.kbit.moe_gemm_grouped(x, packed, absmax, cb, 3, 128, 64, s, e, p, 16, 2)
        with pytest.raises(ValueError, match="activation must be 0..7"):
            torch.ops.kbit.moe_gemm_grouped(x, packed, absmax, cb, 3, 128, 64, s, e, p, 64, 2, None, 8)
        with pytest.raises(ValueError, match="gated activation needs n"):
            torch.ops.kbit.moe_gemm_grouped(x[:, :32].contiguous(), packed, absmax, cb, 3, 64, 32, s, e, p, 64, 2,
                                            None, 1)


# ----------------------------------------------------------------------------- inside vLLM's MoE layer

PREFIX = "model.layers.0.mlp.experts"
SHARDS = (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))


def make_config(bits, ignore=(), **extra):
    return KbitConfig.from_config({"quant_method": "kbit", "bits": bits, "codebook": kf.default_codebook(bits).tolist(),
                                   "ignore": list(ignore), **extra})


@contextlib.contextmanager
def moe_rank(rank, size, expert_parallel=False):
    """Build MoE layers as rank `rank` of `size` (tensor parallel, or expert parallel) in this process."""
    vc = VllmConfig()
    vc.parallel_config.enable_expert_parallel = expert_parallel
    with set_current_vllm_config(vc), \
         mock.patch("vllm.model_executor.layers.fused_moe.config.get_tensor_model_parallel_rank", return_value=rank):
        yield vc


def checkpoint_experts(num, hidden, inter, bits, gen):
    """{(expert, ckpt name): (qweight, absmax)} and the float64 stacked w13 [E, 2I, H], w2 [E, H, I]."""
    tensors, w13, w2 = {}, [], []
    for e in range(num):
        ws = {}
        for shard, name in SHARDS:
            rows, cols = (hidden, inter) if shard == "w2" else (inter, hidden)
            q, a = kf.quantize(torch.randn(rows, cols, generator=gen) * 0.05, bits)
            tensors[(e, name)] = (q, a)
            ws[shard] = kf.dequantize(q, a, bits, dtype=torch.float64)
        w13.append(torch.cat([ws["w1"], ws["w3"]]))
        w2.append(ws["w2"])
    return tensors, torch.stack(w13), torch.stack(w2)


def build_moe(cfg, num, hidden, inter, top_k, tensors=None, tp=(0, 1), expert_parallel=False, dtype=torch.bfloat16,
              floats=None, skip=()):
    """vLLM's FusedMoE with `cfg`, its experts loaded as a model's load_weights does (vLLM's
    expert params mapping -> param.weight_loader(..., return_success=True))."""
    torch.set_default_device(DEVICE)
    try:
        with moe_rank(*tp, expert_parallel=expert_parallel):
            runner = FusedMoE(num_experts=num, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
                              quant_config=cfg, prefix=PREFIX, params_dtype=dtype, tp_size=tp[1],
                              renormalize=False)
            layer = runner.routed_experts
            params = dict(runner.named_parameters())
            mapping = FusedMoE.make_expert_params_mapping(runner, "gate_proj", "down_proj", "up_proj", num) \
                if hasattr(FusedMoE, "make_expert_params_mapping") else \
                type(layer).make_expert_params_mapping(runner, "gate_proj", "down_proj", "up_proj", num)
            source = {}
            for (e, name), (q, a) in (tensors or {}).items():
                source[f"{PREFIX}.{e}.{name}.qweight"] = q
                source[f"{PREFIX}.{e}.{name}.absmax"] = a
            for (e, name), w in (floats or {}).items():
                source[f"{PREFIX}.{e}.{name}.weight"] = w
            for ckpt, t in source.items():
                if ckpt in skip:
                    continue
                for param_prefix, fragment, expert_id, shard in mapping:
                    full_fragment = "model.layers.0.mlp." + fragment
                    if full_fragment not in ckpt:
                        continue
                    mapped = ckpt.replace(full_fragment, "model.layers.0.mlp." + param_prefix).removeprefix(PREFIX + ".")
                    param = params[mapped]
                    if param.weight_loader(param, t, mapped, shard_id=shard, expert_id=expert_id, return_success=True):
                        break
            layer.quant_method.process_weights_after_loading(layer)
    finally:
        torch.set_default_device("cpu")
    return layer


def run_layer(layer, x, weights, ids):
    return layer.quant_method.apply(layer, x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), None, None).cpu()


def test_get_quant_method_for_moe_layers_and_routers():
    gen = torch.Generator().manual_seed(5)
    tensors, _, _ = checkpoint_experts(2, 64, 64, 4, gen)
    assert isinstance(build_moe(make_config(4), 2, 64, 64, 1, tensors).quant_method, KbitMoEMethod)
    for pattern in (r"re:.*\.experts(\..*)?$", PREFIX):  # the user's pattern, or the converter's exact name
        layer = build_moe(make_config(4, ignore=[pattern]), 2, 64, 64, 1)
        assert isinstance(layer.quant_method, UnquantizedFusedMoEMethod) and hasattr(layer, "w13_weight")
    # routers stay float, even with an empty ignore list (online mode) or a gate passed a quant_config
    for cfg in (make_config(4), KbitConfig()):
        for name in ("gate", "shared_expert_gate", "router"):
            gate = ReplicatedLinear(64, 4, bias=False, quant_config=cfg, prefix=f"model.layers.0.mlp.{name}")
            assert isinstance(gate.quant_method, UnquantizedLinearMethod), name
        proj = ReplicatedLinear(64, 64, bias=False, quant_config=cfg, prefix="model.layers.0.mlp.gate_proj")
        assert not isinstance(proj.quant_method, UnquantizedLinearMethod)


@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
@pytest.mark.parametrize("m", [1, 6, 40])
def test_moe_layer_equals_float64_experts(bits, m):
    gen = torch.Generator().manual_seed(zlib.crc32(f"layer-{bits}-{m}".encode()))
    num, hidden, inter, top_k = 5, 64, 96, 2
    tensors, w13, w2 = checkpoint_experts(num, hidden, inter, bits, gen)
    layer = build_moe(make_config(bits), num, hidden, inter, top_k, tensors)
    weights, ids = routing(m, num, top_k, gen)
    x = torch.randn(m, hidden, generator=gen).to(torch.bfloat16)
    y = run_layer(layer, x, weights, ids)
    assert y.shape == (m, hidden) and y.dtype == torch.bfloat16
    assert rel_err(y, _experts_reference(x, w13, w2, weights, ids, MoEActivation.SILU)) < 3e-2


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_sum_to_one(expert_parallel):
    """Tensor parallel 2 (w13 rows and w2's I split, whole blocks) or expert parallel 2 (experts
    split, global ids mapped): the two ranks' outputs sum to the single rank's."""
    gen = torch.Generator().manual_seed(6)
    num, hidden, inter, top_k = 4, 64, 128, 2
    tensors, w13, w2 = checkpoint_experts(num, hidden, inter, 4, gen)
    weights, ids = routing(7, num, top_k, gen)
    x = torch.randn(7, hidden, generator=gen).to(torch.bfloat16)
    one = run_layer(build_moe(make_config(4), num, hidden, inter, top_k, tensors), x, weights, ids)
    ranks = [build_moe(make_config(4), num, hidden, inter, top_k, tensors, tp=(r, 2), expert_parallel=expert_parallel)
             for r in range(2)]
    if expert_parallel:
        assert [lay.w13_qweight.shape[0] for lay in ranks] == [2, 2] and ranks[1].expert_map is not None
    else:
        assert ranks[0].w2_qweight.shape[0] == num
    two = sum(run_layer(lay, x, weights, ids).double() for lay in ranks)
    ref = _experts_reference(x, w13, w2, weights, ids, MoEActivation.SILU)
    assert rel_err(two, ref) < 3e-2 and rel_err(one, two) < 3e-2


def test_tensor_parallel_split_must_keep_whole_blocks():
    with pytest.raises(ValueError, match=rf"{PREFIX}: expert intermediate size 96 split over 2 .* into 48"):
        build_moe(make_config(4), 4, 64, 96, 2, {}, tp=(0, 2))


def test_moe_layer_refuses_a_gpu_without_kernels(monkeypatch):
    """As a kbit linear layer: on a CUDA device without the extension, creating the experts
    fails naming the layer (ops.require_kernels)."""
    layer = build_moe(make_config(4), 2, 64, 64, 1, checkpoint_experts(2, 64, 64, 4, torch.Generator())[0])
    monkeypatch.setattr(ops, "HAS_CUDA_KERNELS", False)
    monkeypatch.setattr(ops, "KERNELS_ERROR", "not built (test)")
    monkeypatch.setattr(ops, "REFERENCE_REQUESTED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ops.KernelsUnavailableError, match=rf"kbit layer {PREFIX}: .*not built \(test\)"):
        layer.quant_method.create_weights(layer, 2, 64, 64, torch.bfloat16, weight_loader=None)


def test_hidden_size_must_be_whole_blocks():
    with pytest.raises(ValueError, match=rf"{PREFIX}: hidden size 48 is not a multiple of the 32-weight block"):
        build_moe(make_config(4), 4, 48, 64, 2, {})


def test_missing_and_wrong_expert_tensors_are_named():
    gen = torch.Generator().manual_seed(7)
    tensors, _, _ = checkpoint_experts(3, 64, 64, 4, gen)
    with pytest.raises(ValueError, match=rf"{PREFIX}.w13_absmax is missing from the checkpoint .*expert 2 w3"):
        build_moe(make_config(4), 3, 64, 64, 2, tensors, skip={f"{PREFIX}.2.up_proj.absmax"})
    bad = dict(tensors)
    bad[(1, "down_proj")] = kf.quantize(torch.randn(64, 64, generator=gen) * 0.05, 3)  # a 3-bit tensor
    with pytest.raises(ValueError, match=rf"{PREFIX}.1.w2.qweight .*bits=4"):
        build_moe(make_config(4), 3, 64, 64, 2, bad)
    bad = dict(tensors)
    bad[(0, "gate_proj")] = (tensors[(0, "gate_proj")][0], tensors[(0, "gate_proj")][1].to(torch.int32))
    with pytest.raises(ValueError, match=rf"{PREFIX}.0.w1.absmax .*must be torch.uint8"):
        build_moe(make_config(4), 3, 64, 64, 2, bad)


def test_online_quantization_of_float_experts():
    """`--quantization kbit` on a float MoE checkpoint: float w13/w2 loaded like vLLM's
    unquantized MoE, quantized per expert after loading."""
    gen = torch.Generator().manual_seed(8)
    num, hidden, inter = 3, 64, 64
    floats = {(e, name): (torch.randn(hidden if s == "w2" else inter, inter if s == "w2" else hidden, generator=gen)
                          * 0.05).to(torch.bfloat16) for e in range(num) for s, name in SHARDS}
    layer = build_moe(KbitConfig(), num, hidden, inter, 2, floats=floats)
    assert not hasattr(layer, "w13_weight") and layer.w13_qweight.dtype == torch.int32
    cb = layer.quant_method.config.codebook
    deq = {key: kf.dequantize(*kf.quantize(w, 4, cb), 4, cb, dtype=torch.float64) for key, w in floats.items()}
    w13 = torch.stack([torch.cat([deq[(e, "gate_proj")], deq[(e, "up_proj")]]) for e in range(num)])
    w2 = torch.stack([deq[(e, "down_proj")] for e in range(num)])
    weights, ids = routing(5, num, 2, gen)
    x = torch.randn(5, hidden, generator=gen).to(torch.bfloat16)
    assert rel_err(run_layer(layer, x, weights, ids), _experts_reference(x, w13, w2, weights, ids, MoEActivation.SILU)) < 3e-2
    with pytest.raises(ValueError, match=rf"{PREFIX}.w2_weight is missing"):
        build_moe(KbitConfig(), num, hidden, inter, 2, floats={k: v for k, v in floats.items() if k != (1, "down_proj")})


def test_dummy_load_fills_valid_kbit_experts():
    vc = VllmConfig()
    vc.load_config.load_format = "dummy"
    with set_current_vllm_config(vc), mock.patch("vllm_kbit.linear.get_current_vllm_config_or_none", return_value=vc):
        layer = build_moe(make_config(3), 4, 64, 64, 2)
    gen = torch.Generator().manual_seed(9)
    weights, ids = routing(8, 4, 2, gen)
    y = run_layer(layer, torch.randn(8, 64, generator=gen).to(torch.bfloat16), weights, ids)
    assert torch.isfinite(y).all() and y.abs().max() > 0
    if not ops.HAS_CUDA_KERNELS:
        scale = kf.decode_e4m4(layer.w2_absmax.data.cpu())
        assert 0.028 <= scale.min() and scale.max() <= 0.13


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4])
def test_experts_forward_in_a_cuda_graph(bits):
    """experts_forward captured in a CUDA graph (as vLLM captures moe_forward): no host sync, and
    replays with new inputs give the eager result, on both paths (4096 tokens: the dense one)."""
    gen = torch.Generator().manual_seed(10 + bits)
    ex, w13, w2 = make_experts(8, 256, 128, bits, gen)
    ex.dense_chunk = 3
    ex.dense_maps = dense_expert_maps(None, 8, 8, 3, DEVICE)
    for m in (1, 16, 4096):
        x, tw, ids = (torch.empty(m, 256, dtype=torch.bfloat16, device=DEVICE),
                      torch.empty(m, 2, device=DEVICE), torch.empty(m, 2, dtype=torch.int32, device=DEVICE))

        def fill():
            w, i = routing(m, 8, 2, gen)
            x.copy_(torch.randn(m, 256, generator=gen).to(torch.bfloat16))
            tw.copy_(w)
            ids.copy_(i)
        fill()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            experts_forward(ex, x, tw, ids)  # warm-up (Triton compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = experts_forward(ex, x, tw, ids)
        for _ in range(2):
            fill()
            y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.isfinite(y).all()
            torch.testing.assert_close(y, experts_forward(ex, x, tw, ids))
        if m <= 16:
            ref = _experts_reference(x.cpu(), w13, w2, tw.cpu(), ids.cpu(), MoEActivation.SILU)
            assert rel_err(y, ref) < 3e-2


# ----------------------------------------------------------------------------- a whole vLLM model

# arch -> (MoE block name, checkpoint names of gate / up / down)
MODEL_ARCHS = {"qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
               "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
               "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


def load_vllm_model(folder, quantization=None):
    """vLLM's model for `folder`, built and loaded as its engine does (its own load_weights,
    then process_weights_after_loading), without running it."""
    from vllm.config import ModelConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    mc = ModelConfig(model=str(folder), dtype="bfloat16", max_model_len=128, quantization=quantization)
    vc = VllmConfig(model_config=mc)
    torch.set_default_device(DEVICE)
    try:
        with set_current_vllm_config(vc):
            model = initialize_model(vllm_config=vc)
            get_model_loader(vc.load_config).load_weights(model, mc)
            process_weights_after_loading(model, mc, torch.device(DEVICE))
    finally:
        torch.set_default_device("cpu")
    return model


def checkpoint_tensors(folder):
    from safetensors.torch import load_file
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module", params=sorted(MODEL_ARCHS))
def moe_model(request, tmp_path_factory):
    from vllm_kbit.convert import convert
    from vllm_kbit.synthetic import make_random_model
    root = tmp_path_factory.mktemp(request.param)
    src = make_random_model(root / "src", arch=request.param, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, vocab_size=320, seed=zlib.crc32(request.param.encode()))
    convert(src, root / "kbit3", 3, progress=False, max_shard_size="100KB")
    return request.param, src, root / "kbit3"


def _assert_experts_compute(experts, deq, projections, gen):
    """A loaded layer's experts against the float64 experts deq(e, proj) decodes from the
    checkpoint (gate rows, then up rows, in w13), on random tokens and routing."""
    gate, up, down = projections
    num = experts.w13_qweight.shape[0]
    w13 = torch.stack([torch.cat([deq(e, gate), deq(e, up)]) for e in range(num)])
    w2 = torch.stack([deq(e, down) for e in range(num)])
    weights, ids = routing(9, num, experts.top_k, gen)
    x = torch.randn(9, w13.shape[2], generator=gen).to(torch.bfloat16)
    assert rel_err(run_layer(experts, x, weights, ids),
                   _experts_reference(x, w13, w2, weights, ids, MoEActivation.SILU)) < 3e-2


def test_vllm_model_loads_converted_experts(moe_model):
    """The architecture's own load_weights maps every per-expert kbit tensor into the layer
    (gate rows, then up rows), routers stay float, a shared expert is kbit; each layer's
    experts compute what the checkpoint's float64 dequantized experts compute."""
    arch, _, kbit = moe_model
    block, (gate, up, down) = MODEL_ARCHS[arch]
    model = load_vllm_model(kbit)
    ckpt = checkpoint_tensors(kbit)
    codebook = torch.tensor(json.loads((kbit / "config.json").read_text())["quantization_config"]["codebook"])
    gen = torch.Generator().manual_seed(11)
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, block)
        experts = moe.experts.routed_experts
        assert isinstance(experts.quant_method, KbitMoEMethod)
        assert isinstance(moe.gate.quant_method, UnquantizedLinearMethod)
        if arch == "qwen2_moe":
            assert type(moe.shared_expert.down_proj.quant_method).__name__ == "KbitLinearMethod"
            assert isinstance(moe.shared_expert_gate.quant_method, UnquantizedLinearMethod)

        def deq(e, proj):
            p = f"model.layers.{i}.{block}.experts.{e}.{proj}"
            return kf.dequantize(ckpt[p + ".qweight"], ckpt[p + ".absmax"], 3, codebook, dtype=torch.float64)
        _assert_experts_compute(experts, deq, (gate, up, down), gen)


def test_vllm_model_reports_a_missing_expert_tensor(moe_model, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    arch, _, kbit = moe_model
    block, (_, up, _) = MODEL_ARCHS[arch]
    broken = Path(shutil.copytree(kbit, tmp_path / "broken"))
    name = f"model.layers.1.{block}.experts.2.{up}.absmax"
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = broken / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"model\.layers\.1\.{block}\.experts\.w13_absmax is missing .*expert 2 w3"):
        load_vllm_model(broken)


def test_vllm_model_online_quantization_equals_the_converted_checkpoint(moe_model):
    """`--quantization kbit` on the float checkpoint: the same kbit experts as convert writes
    (K=4 is online mode's width and round-to-nearest its rounding; compared with such a
    conversion)."""
    from vllm_kbit.convert import convert
    arch, src, kbit = moe_model
    block = MODEL_ARCHS[arch][0]
    k4 = kbit.parent / "kbit4"
    if not k4.exists():
        convert(src, k4, 4, method="rtn", progress=False)
    online, converted = load_vllm_model(src, quantization="kbit"), load_vllm_model(k4)
    for a, b in zip(online.model.layers, converted.model.layers):
        ea, eb = getattr(a, block).experts.routed_experts, getattr(b, block).experts.routed_experts
        assert not hasattr(ea, "w13_weight")
        for name in ("w13_qweight", "w13_absmax", "w2_qweight", "w2_absmax"):
            assert torch.equal(getattr(ea, name), getattr(eb, name)), name


# ----------------------------------------------------------------------------- per-expert codebooks

def fitted_codebooks(num, bits, gen):
    """{(expert, ckpt name): codebook}: a random ascending codebook per expert, gate and up
    sharing one (as convert --fit-codebook fits one per fused pair), down its own."""
    def one():
        cb = torch.sort(torch.rand(1 << bits, generator=gen) * 2 - 1).values
        return cb / cb.abs().max()
    out = {}
    for e in range(num):
        shared = one()
        out[(e, "gate_proj")], out[(e, "up_proj")], out[(e, "down_proj")] = shared, shared.clone(), one()
    return out


def checkpoint_experts_with_codebooks(num, hidden, inter, bits, gen):
    """checkpoint_experts with one codebook per expert (fitted_codebooks): tensors[(e, name)] =
    (qweight, absmax, codebook), and the float64 w13 / w2 they decode to."""
    cbs = fitted_codebooks(num, bits, gen)
    tensors, w13, w2 = {}, [], []
    for e in range(num):
        ws = {}
        for shard, name in SHARDS:
            rows, cols = (hidden, inter) if shard == "w2" else (inter, hidden)
            q, a = kf.quantize(torch.randn(rows, cols, generator=gen) * 0.05, bits, cbs[(e, name)])
            tensors[(e, name)] = (q, a, cbs[(e, name)])
            ws[shard] = kf.dequantize(q, a, bits, cbs[(e, name)], dtype=torch.float64)
        w13.append(torch.cat([ws["w1"], ws["w3"]]))
        w2.append(ws["w2"])
    return tensors, torch.stack(w13), torch.stack(w2)


def build_moe_with_codebooks(cfg, num, hidden, inter, top_k, tensors, **kw):
    """build_moe, the codebooks loaded as a model's load_weights loads `...experts.E.PROJ.codebook`."""
    plain = {key: (q, a) for key, (q, a, _) in tensors.items()}
    codebooks = {key: cb for key, (_, _, cb) in tensors.items() if cb is not None}
    with mock.patch.object(KbitMoEMethod, "process_weights_after_loading", lambda self, layer: None):
        layer = build_moe(cfg, num, hidden, inter, top_k, plain, **kw)
    names = {n: s for s, n in SHARDS}
    for (e, name), cb in codebooks.items():
        param = layer.w2_codebook if names[name] == "w2" else layer.w13_codebook
        param.weight_loader(param, cb, f"{PREFIX}.{e}.{name}.codebook", shard_id=names[name], expert_id=e,
                            return_success=True)
    torch.set_default_device(DEVICE)
    try:
        layer.quant_method.process_weights_after_loading(layer)
    finally:
        torch.set_default_device("cpu")
    return layer


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_moe_ops_take_one_codebook_per_expert(bits, dtype):
    """moe_gemm and dequantize_experts with codebook [E, 2^bits]: expert e decodes with row e
    (each expert's own codebook, against format.dequantize with it); a wrong shape is named."""
    gen = torch.Generator().manual_seed(40 + bits)
    num, n, k, top_k, m = 4, 96, 64, 2, 6
    cbs = torch.stack([torch.sort(torch.rand(1 << bits, generator=gen) * 2 - 1).values for _ in range(num)])
    cbs = cbs / cbs.abs().amax(1, keepdim=True)
    qa = [kf.quantize(torch.randn(n, k, generator=gen) * 0.05, bits, cbs[e]) for e in range(num)]
    q, a = torch.stack([t[0] for t in qa]), torch.stack([t[1] for t in qa])
    w = torch.stack([kf.dequantize(q[e], a[e], bits, cbs[e], dtype=torch.float64) for e in range(num)])
    packed, absmax = repack_experts(q.to(DEVICE), a.to(DEVICE), bits)
    out = torch.ops.kbit.dequantize_experts(packed, absmax, cbs.to(DEVICE), bits, n, k, dtype)
    assert torch.equal(out.cpu(), torch.stack([kf.dequantize(q[e], a[e], bits, cbs[e], dtype=dtype)
                                               for e in range(num)]))
    weights, ids = routing(m, num, top_k, gen)
    sorted_ids, expert_ids, num_post = (t.to(DEVICE) for t in align_block_size_torch(ids, 4, num))
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = torch.ops.kbit.moe_gemm(x.to(DEVICE), packed, absmax, cbs.to(DEVICE), bits, n, k, sorted_ids, expert_ids,
                                num_post, 4, top_k, weights.to(DEVICE))
    assert rel_err(y, _pair_reference(x, w, ids.long(), top_k, weights)) < TOL[dtype]
    for bad in (cbs[:-1], cbs[:, :-1], cbs.reshape(-1)):
        with pytest.raises((ValueError, RuntimeError), match="codebook has shape"):
            torch.ops.kbit.moe_gemm(x.to(DEVICE), packed, absmax, bad.to(DEVICE).contiguous(), bits, n, k, sorted_ids,
                                    expert_ids, num_post, 4, top_k)
        with pytest.raises((ValueError, RuntimeError), match="codebook has shape"):
            torch.ops.kbit.dequantize_experts(packed, absmax, bad.to(DEVICE).contiguous(), bits, n, k, dtype)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_layer_serves_per_expert_codebooks(expert_parallel):
    """codebook_per_layer: each expert's own codebooks (gate/up one, down another) are loaded
    and used by both paths (moe_gemm and dequantize + fused_experts); the layer equals the
    float64 experts decoded with them, and differs from what the config's codebook would give."""
    from vllm_kbit.moe import experts_forward
    gen = torch.Generator().manual_seed(41)
    num, hidden, inter, top_k, bits = 4, 64, 96, 2, 3
    tensors, w13, w2 = checkpoint_experts_with_codebooks(num, hidden, inter, bits, gen)
    weights, ids = routing(9, num, top_k, gen)
    x = torch.randn(9, hidden, generator=gen).to(torch.bfloat16)
    ref = _experts_reference(x, w13, w2, weights, ids, MoEActivation.SILU)
    ranks = [build_moe_with_codebooks(make_config(bits, codebook_per_layer=True), num, hidden, inter, top_k, tensors,
                                      tp=(r, 2 if expert_parallel else 1), expert_parallel=expert_parallel)
             for r in range(2 if expert_parallel else 1)]
    for path in ("gemm", "dense"):
        y = sum(experts_forward(lay.kbit_experts, x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE),
                                path=path).cpu().double() for lay in ranks)
        assert rel_err(y, ref) < 3e-2, path
    # the same tensors decoded with the config's codebook are far off: the check can fail
    shared = {key: (q, a, None) for key, (q, a, _) in tensors.items()}
    wrong = build_moe_with_codebooks(make_config(bits), num, hidden, inter, top_k, shared)
    assert rel_err(run_layer(wrong, x, weights, ids), ref) > 0.1


def test_per_expert_codebook_errors_name_the_tensor():
    gen = torch.Generator().manual_seed(42)
    tensors, _, _ = checkpoint_experts_with_codebooks(3, 64, 64, 3, gen)
    cfg = make_config(3, codebook_per_layer=True)
    bad = dict(tensors)
    q, a, cb = bad[(1, "up_proj")]
    bad[(1, "up_proj")] = (q, a, cb.flip(0).neg() * 0.5)  # still a valid codebook, but not gate's
    with pytest.raises(ValueError, match=rf"{PREFIX}\.1\.w3\.codebook .*differs .*expert 1"):
        build_moe_with_codebooks(cfg, 3, 64, 64, 2, bad)
    bad = dict(tensors)
    bad[(2, "down_proj")] = (*tensors[(2, "down_proj")][:2], None)
    with pytest.raises(ValueError, match=rf"{PREFIX}\.w2_codebook is missing .*expert 2 w2"):
        build_moe_with_codebooks(cfg, 3, 64, 64, 2, bad)
    bad = dict(tensors)
    bad[(0, "gate_proj")] = (*tensors[(0, "gate_proj")][:2], torch.linspace(1, -1, 8))
    with pytest.raises(ValueError, match=rf"{PREFIX}\.0\.w1\.codebook .*ascending"):
        build_moe_with_codebooks(cfg, 3, 64, 64, 2, bad)


def test_vllm_model_serves_fitted_expert_codebooks(moe_model):
    """convert --fit-codebook on an MoE model writes a codebook per expert projection (gate and
    up one per expert); vLLM's own load_weights puts each into the layer, and every layer's
    experts compute what the float64 experts decoded with their own codebooks compute."""
    from vllm_kbit.convert import convert
    arch, src, kbit = moe_model
    block, (gate, up, down) = MODEL_ARCHS[arch]
    fitted = kbit.parent / "kbit3_fit"
    if not fitted.exists():
        convert(src, fitted, 3, method="rtn", fit_codebook=True, progress=False)
    ckpt = checkpoint_tensors(fitted)
    config_cb = torch.tensor(json.loads((fitted / "config.json").read_text())["quantization_config"]["codebook"])
    model = load_vllm_model(fitted)
    gen = torch.Generator().manual_seed(12)
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer, block).experts.routed_experts
        p = f"model.layers.{i}.{block}.experts"
        num = experts.w13_qweight.shape[0]
        for e in range(num):
            assert torch.equal(ckpt[f"{p}.{e}.{gate}.codebook"], ckpt[f"{p}.{e}.{up}.codebook"])
        assert not torch.equal(ckpt[f"{p}.0.{down}.codebook"], config_cb)

        def deq(e, proj):
            q = f"{p}.{e}.{proj}"
            return kf.dequantize(ckpt[q + ".qweight"], ckpt[q + ".absmax"], 3, ckpt[q + ".codebook"],
                                 dtype=torch.float64)
        _assert_experts_compute(experts, deq, (gate, up, down), gen)
