"""GPU tests of kbit::moe_gemm_grouped (vllm_kbit._C): the grouped wgmma MoE GEMM over blocks of
64, 128 or 256 sorted pair ids (Hopper, sm_90a builds), and the MoE layer's "grouped" path.

Skipped cleanly without a GPU, without the built extension, or where the build / GPU has no
grouped kernel (ops.has_moe_grouped). Experts as in test_moe_kernels_gpu.py (random float
weights through ops.quantize and ops.repack, stacked). References:
  * without an activation: float64 x[p // top_k] @ W_e^T (* topk_weights[p]), every element of a
    covered row within tests/kernel_check.py's bound; with zero_uncovered, rows of experts off
    this rank exactly 0;
  * with a fused activation: float64 act(h) (gated: act(gate) * up), within kernel_check's bound
    carried through the activation (moe_cases.activation_outside);
  * every output finite; the caching allocator's blocks NaN-filled before each call, so a row the
    op leaves unwritten shows up.
"""
import functools

import pytest
import torch

from vllm_kbit import format as kf
from vllm_kbit import ops

import gemm_cases
import kernel_check as kc
import moe_cases as mc

HAVE_KERNELS = torch.cuda.is_available() and ops.HAS_CUDA_KERNELS and ops.has_moe_grouped()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAVE_KERNELS, reason="needs a Hopper GPU and vllm_kbit._C built for sm_90a")]

DEV = "cuda"
BITS = [2, 3, 4, 5]
DTYPES = [torch.float16, torch.bfloat16]
BLOCK_MS = [64, 128, 256]
# (block_m, overrides): the kernels, the 64-token tile built for one CTA per SM and for two
# (csrc/generate_instantiations.py builds no two-per-SM kernel at K=2)
BUILDS = [(64, "moe.one_per_sm=1"), (64, "moe.one_per_sm=0"), (128, ""), (256, "")]


def _builds(bits):
    return [(bm, o) for bm, o in BUILDS if not (bits == 2 and o == "moe.one_per_sm=0")]
# (experts, top_k, n, k): 200 columns end inside a 64-column slab, 100 is not a multiple of 8
# (the element-by-element store), k = 96 / 1056 end half a 64-k unit in; with 128 experts and
# top-8 most experts get no token at small M
SHAPES = [(7, 2, 200, 96), (128, 8, 192, 1056), (5, 2, 100, 64)]


def _poison_allocator():
    """NaN-fill a block of each caching-allocator pool and free it: the op's output reuses it."""
    for nbytes in (1 << 20, 64 << 20):
        t = torch.empty(nbytes // 4, dtype=torch.float32, device=DEV)
        t.fill_(float("nan"))
        del t


@functools.lru_cache(maxsize=8)
def _experts(num_experts, n, k, bits):
    """(packed [E, P], absmax_packed [E, U], codebook, W float64 [E, n, k])."""
    qweight, absmax, cb, w64 = mc.make_experts(num_experts, n, k, bits, DEV, seed=1000 * bits + num_experts + n + k)
    packed, ap = mc.stack_tiled(qweight, absmax, bits)
    return packed, ap, cb, w64


def _per_expert(num_experts, n, k, bits, seed):
    """Experts each quantized with its own random codebook: (packed, ap, codebooks [E, 2^bits], W)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    cbs = torch.rand(num_experts, 1 << bits, generator=g, device=DEV).sort(-1).values * 2 - 1
    cbs = cbs / cbs.abs().amax(-1, keepdim=True)
    qa = [ops.quantize(torch.randn(n, k, generator=g, device=DEV) * 0.02 * (1 + e % 3), bits, cbs[e])[:2]
          for e in range(num_experts)]
    qweight, absmax = torch.stack([q for q, _ in qa]), torch.stack([a for _, a in qa])
    w64 = torch.stack([kf.dequantize(qweight[e], absmax[e], bits, cbs[e], dtype=torch.float64)
                       for e in range(num_experts)])
    packed, ap = mc.stack_tiled(qweight, absmax, bits)
    return packed, ap, cbs, w64


def _grouped(x, packed, ap, cb, bits, n, k, aligned, block_m, top_k, weights, activation=0, zero_uncovered=True,
             overrides=""):
    _poison_allocator()
    return torch.ops.kbit.moe_gemm_grouped(x, packed, ap, cb, bits, n, k, *aligned, block_m, top_k, weights,
                                           activation, zero_uncovered, overrides)


def _check(y, ref, dtype, where, covered=None, off=None):
    """Shape, dtype; rows in `covered` (bool [num_pairs], default all) finite and within
    kernel_check's bound of ref; rows in `off` exactly 0."""
    assert y.shape == ref.value.shape and y.dtype == dtype, where
    rows = slice(None) if covered is None else covered
    assert bool(torch.isfinite(y[rows]).all()), f"non-finite output (unwritten row?) {where}"
    if off is not None:
        assert bool((y[off] == 0).all()), f"rows no block covers are not 0 {where}"
    kc.assert_close(y[rows], kc.Reference(*(t[rows] for t in ref)), dtype, where)


# ------------------------------------------------------------------------------ the GEMM

@pytest.mark.parametrize("build", BUILDS, ids=lambda b: f"bm{b[0]}{'_' + b[1] if b[1] else ''}")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_grouped_gemm(bits, dtype, shape, build):
    """Every kernel: M = 1, 40, 300 (partial and full blocks, experts with no token),
    topk_weights given and not."""
    if build not in _builds(bits):
        pytest.skip("no two-per-SM build at K=2")
    block_m, overrides = build
    num_experts, top_k, n, k = shape
    packed, ap, cb, w64 = _experts(num_experts, n, k, bits)
    for i, m in enumerate([1, 40, 300]):
        ids, weights = mc.routing(m, num_experts, top_k, DEV, seed=m + block_m)
        tw = weights if i % 2 == 0 else None
        x = torch.randn(m, k, device=DEV).to(dtype)
        y = _grouped(x, packed, ap, cb, bits, n, k, mc.align(ids, block_m, num_experts), block_m, top_k, tw,
                     overrides=overrides)
        _check(y, mc.moe_expected(x, ids, tw, w64, top_k), dtype,
               f"bits={bits} {dtype} E={num_experts} top_k={top_k} n={n} k={k} m={m} block_m={block_m} {overrides}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_grouped_one_expert_and_idle_experts(bits, dtype):
    """Every token on one expert (top_k = 1): full blocks and a partial one, every other expert
    without a token; then only even experts routed (odd ones idle), top_k = 2."""
    num_experts, _, n, k = SHAPES[0]
    packed, ap, cb, w64 = _experts(num_experts, n, k, bits)
    for block_m in BLOCK_MS:
        for m in (300, 13):
            ids = torch.full((m, 1), 3, dtype=torch.int32, device=DEV)
            weights = torch.rand(m, 1, device=DEV)
            x = torch.randn(m, k, device=DEV).to(dtype)
            y = _grouped(x, packed, ap, cb, bits, n, k, mc.align(ids, block_m, num_experts), block_m, 1, weights)
            _check(y, mc.moe_expected(x, ids, weights, w64, 1), dtype, f"one expert bits={bits} m={m} bm={block_m}")
        m = 150
        g = torch.Generator(device=DEV).manual_seed(bits)
        ids = (2 * torch.randint(0, 4, (m, 2), generator=g, device=DEV)).to(torch.int32)
        ids[:, 1] = (ids[:, 0] + 2) % 8
        x = torch.randn(m, k, device=DEV).to(dtype)
        y = _grouped(x, packed, ap, cb, bits, n, k, mc.align(ids, block_m, num_experts), block_m, 2, None)
        _check(y, mc.moe_expected(x, ids, None, w64, 2), dtype, f"idle odd experts bits={bits} bm={block_m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_grouped_expert_parallel_and_down(bits, dtype):
    """Experts off this rank (expert_map -1): with zero_uncovered their rows are exactly 0,
    without it the covered rows are still right. Then the down projection's call: x one row a
    pair, top_k = 1, the [M, top_k] weights flat, the same sorted ids."""
    global_experts, top_k, n, k = 7, 2, 200, 96
    expert_map = torch.tensor([0, -1, 1, -1, 2, 3, -1], dtype=torch.int32, device=DEV)
    packed, ap, cb, w64 = _experts(4, n, k, bits)
    for block_m, o in _builds(bits):
        for m in (16, 200):
            ids, weights = mc.routing(m, global_experts, top_k, DEV, seed=m)
            aligned = mc.align(ids, block_m, global_experts, expert_map)
            off = expert_map[ids.reshape(-1).long()] < 0
            x = torch.randn(m, k, device=DEV).to(dtype)
            ref = mc.moe_expected(x, ids, None, w64, top_k, expert_map)
            y = _grouped(x, packed, ap, cb, bits, n, k, aligned, block_m, top_k, None, overrides=o)
            _check(y, ref, dtype, f"EP up m={m} bm={block_m} {o}", off=off)
            y = _grouped(x, packed, ap, cb, bits, n, k, aligned, block_m, top_k, None, zero_uncovered=False,
                         overrides=o)
            _check(y, ref, dtype, f"EP up, uncovered rows left m={m} bm={block_m} {o}", covered=~off)
            x2 = torch.randn(m * top_k, k, device=DEV).to(dtype)
            y2 = _grouped(x2, packed, ap, cb, bits, n, k, aligned, block_m, 1, weights, overrides=o)
            ref2 = mc.moe_expected(x2, ids.reshape(-1, 1), weights, w64, 1, expert_map)
            _check(y2, ref2, dtype, f"EP down m={m} bm={block_m} {o}", off=off)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_grouped_codebook_per_expert(bits, dtype):
    """codebook [E, 2^bits]: every block decodes with its expert's row; the layer's one codebook
    in its place gives a different result (the check can fail)."""
    num_experts, top_k, n, k = 8, 2, 200, 1056
    packed, ap, cbs, w64 = _per_expert(num_experts, n, k, bits, seed=bits + n)
    for block_m in BLOCK_MS:
        m = 120
        ids, weights = mc.routing(m, num_experts, top_k, DEV, seed=m + block_m)
        x = torch.randn(m, k, device=DEV).to(dtype)
        ref = mc.moe_expected(x, ids, weights, w64, top_k)
        aligned = mc.align(ids, block_m, num_experts)
        y = _grouped(x, packed, ap, cbs, bits, n, k, aligned, block_m, top_k, weights)
        _check(y, ref, dtype, f"per-expert codebooks bits={bits} bm={block_m}")
        y0 = _grouped(x, packed, ap, cbs[0].contiguous(), bits, n, k, aligned, block_m, top_k, weights)
        assert kc.compare(y0, ref, dtype) is not None, "expert 0's codebook for all passed"


# ------------------------------------------------------------------------------ fused activations

@pytest.mark.parametrize("activation", range(1, len(ops.MOE_ACTIVATIONS)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4])
def test_grouped_fused_activation(bits, dtype, activation):
    """Each fused activation against float64, gated ones on n = 2 x 192 (two column groups, the
    last half-used) and 2 x 128, the others on n = 328 and 200 (partial slabs); the bound
    fails for the halves swapped (up as gate)."""
    name = ops.MOE_ACTIVATIONS[activation]
    gated = ops.moe_activation_gated(activation)
    for num_experts, top_k, n, k in [(7, 2, 384, 96), (16, 4, 256, 1056)]:
        if not gated:
            n = n - 56  # a partial slab
        packed, ap, cb, w64 = _experts(num_experts, n, k, bits)
        for (block_m, o), m in zip(_builds(bits), (70, 90, 300, 600)):
            ids, weights = mc.routing(m, num_experts, top_k, DEV, seed=m + activation)
            x = torch.randn(m, k, device=DEV).to(dtype)
            aligned = mc.align(ids, block_m, num_experts)
            tw = weights if block_m == 64 else None
            y = _grouped(x, packed, ap, cb, bits, n, k, aligned, block_m, top_k, tw, activation, overrides=o)
            assert y.shape == (m * top_k, n // 2 if gated else n) and bool(torch.isfinite(y).all()), name
            bad = mc.activation_outside(y, x, ids, tw, w64, top_k, activation, dtype)
            assert not bool(bad.any()), f"{name}: {int(bad.sum())} of {bad.numel()} outside, bits={bits} n={n} m={m}"
            if gated:
                swapped = torch.cat(w64.chunk(2, dim=1)[::-1], dim=1)
                assert bool(mc.activation_outside(y, x, ids, tw, swapped, top_k, activation, dtype).any())


# ------------------------------------------------------------------------------ graphs, determinism, errors

@pytest.mark.parametrize("block_m", BLOCK_MS)
def test_grouped_cuda_graph_replay_equals_eager(block_m):
    """Captured once (gate/up with the fused activation, then down with the router weights);
    replayed with new x and new routing copied into the static inputs: equal to eager each
    time, bitwise."""
    bits, dtype, num_experts, top_k, n, k = 4, torch.bfloat16, 16, 4, 256, 1056
    packed, ap, cb, _ = _experts(num_experts, n, k, bits)
    packed2, ap2, cb2, _ = _experts(num_experts, 160, n // 2, bits)  # down: k = the activation's n / 2
    m = 200
    ids, weights = mc.routing(m, num_experts, top_k, DEV, seed=0)
    static = [t.clone() for t in mc.align(ids, block_m, num_experts)] + [weights.clone()]
    x_static = torch.randn(m, k, device=DEV, dtype=dtype)

    def call(x, sorted_ids, expert_ids, ntpp, tw):
        a = torch.ops.kbit.moe_gemm_grouped(x, packed, ap, cb, bits, n, k, sorted_ids, expert_ids, ntpp, block_m,
                                            top_k, None, 1, False)
        return torch.ops.kbit.moe_gemm_grouped(a, packed2, ap2, cb2, bits, 160, 128, sorted_ids, expert_ids, ntpp,
                                               block_m, 1, tw, 0, True)

    graph, y_static = gemm_cases.capture_graph(lambda: call(x_static, *static))
    for r in range(3):
        ids, weights = mc.routing(m, num_experts, top_k, DEV, seed=r + 1)
        new = list(mc.align(ids, block_m, num_experts)) + [weights]
        x_new = torch.randn(m, k, device=DEV, dtype=dtype)
        x_static.copy_(x_new)
        for s, t in zip(static, new):
            assert s.shape == t.shape
            s.copy_(t)
        gemm_cases.replay_poisoned(graph, y_static)
        assert bool(torch.isfinite(y_static).all())
        assert torch.equal(y_static, call(x_new, *new)), f"replay {r} differs from eager"


def test_grouped_deterministic():
    bits, dtype, (num_experts, top_k, n, k) = 3, torch.float16, SHAPES[1]
    packed, ap, cb, _ = _experts(num_experts, n, k, bits)
    ids, weights = mc.routing(300, num_experts, top_k, DEV, seed=3)
    aligned = mc.align(ids, 64, num_experts)
    x = torch.randn(300, k, device=DEV, dtype=dtype)
    y1 = _grouped(x, packed, ap, cb, bits, n, k, aligned, 64, top_k, weights)
    y2 = _grouped(x, packed, ap, cb, bits, n, k, aligned, 64, top_k, weights)
    assert torch.equal(y1, y2)
    y3 = _grouped(torch.randn_like(x), packed, ap, cb, bits, n, k, aligned, 64, top_k, weights)
    assert not torch.equal(y1, y3)


def test_grouped_errors():
    bits, (num_experts, top_k, n, k) = 4, SHAPES[0]
    packed, ap, cb, _ = _experts(num_experts, n, k, bits)
    ids, weights = mc.routing(4, num_experts, top_k, DEV, seed=0)
    sorted_ids, expert_ids, ntpp = mc.align(ids, 64, num_experts)
    x = torch.randn(4, k, device=DEV, dtype=torch.float16)

    def call(**kw):
        a = dict(x=x, packed=packed, absmax=ap, block_m=64, tw=weights, act=0, n=n)
        a.update(kw)
        return torch.ops.kbit.moe_gemm_grouped(a["x"], a["packed"], a["absmax"], cb, bits, a["n"], k, sorted_ids,
                                               expert_ids, ntpp, a["block_m"], top_k, a["tw"], a["act"])

    call()  # the valid call passes
    for o in ("moe.one_per_sm=1", "moe.one_per_sm=0"):
        torch.ops.kbit.moe_gemm_grouped(x, packed, ap, cb, bits, n, k, sorted_ids, expert_ids, ntpp, 64, top_k,
                                        weights, 0, True, o)
    with pytest.raises(RuntimeError, match="moe.one_per_sm"):
        torch.ops.kbit.moe_gemm_grouped(x, packed, ap, cb, bits, n, k, sorted_ids, expert_ids, ntpp, 64, top_k,
                                        weights, 0, True, "moe.one_per_sm=2")
    with pytest.raises(RuntimeError, match="block_m must be 64, 128 or 256"):
        call(block_m=16)
    with pytest.raises(RuntimeError, match="activation must be"):
        call(act=len(ops.MOE_ACTIVATIONS))
    with pytest.raises(RuntimeError, match="gated activation needs n"):
        call(act=1)  # n = 200
    with pytest.raises(RuntimeError, match="packed"):
        call(packed=packed[:, :-128].contiguous())
    with pytest.raises(RuntimeError, match="topk_weights"):
        call(tw=weights[:-1])
    with pytest.raises(RuntimeError, match="x must be float16 or bfloat16"):
        call(x=x.float())


# ------------------------------------------------------------------------------ the layer's grouped path

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_experts_forward_grouped(bits, dtype):
    """vllm_kbit.moe.experts_forward(path="grouped") (every block size, with and without an
    expert map) against float64 experts through the same routing: within tests/test_moe.py's
    tolerance, and about as close as path="gemm" (which rounds h before vLLM's activation)."""
    from vllm_kbit import moe
    hidden, inter, num_experts, top_k = 256, 192, 8, 2
    w13 = _experts(num_experts, 2 * inter, hidden, bits)
    w2 = _experts(num_experts, hidden, inter, bits)
    for expert_map in (None, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int32, device=DEV).roll(1)):
        ex = moe.KbitExperts(w13=w13[0], w13_absmax=w13[1], w2=w2[0], w2_absmax=w2[1], codebook=w13[2], bits=bits,
                             hidden=hidden, inter=inter, gated=True, global_num_experts=num_experts,
                             expert_map=expert_map)
        for m in (100, 1000, 2100):  # block_m 64, 128, 256 (vllm_kbit.moe.grouped_block_m)
            ids, weights = mc.routing(m, num_experts, top_k, DEV, seed=m + bits)
            x = torch.randn(m, hidden, device=DEV).to(dtype)
            y = moe.experts_forward(ex, x, weights, ids, path="grouped")
            y_gemm = moe.experts_forward(ex, x, weights, ids, path="gemm")
            local = (ids.long() if expert_map is None else expert_map.long()[ids.long()]).reshape(-1)
            rows = x.double().repeat_interleave(top_k, dim=0)
            h = torch.zeros(m * top_k, 2 * inter, dtype=torch.float64, device=DEV)
            out = torch.zeros(m * top_k, hidden, dtype=torch.float64, device=DEV)
            for e in range(num_experts):
                h[local == e] = rows[local == e] @ w13[3][e].t()
            a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            for e in range(num_experts):
                out[local == e] = a[local == e] @ w2[3][e].t()
            ref = (out * weights.reshape(-1, 1).double()).view(m, top_k, hidden).sum(1)
            err = float((y.double() - ref).norm() / ref.norm())
            err_gemm = float((y_gemm.double() - ref).norm() / ref.norm())
            tol = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}[dtype]
            assert err < tol and err <= 2 * err_gemm + 1e-4, (bits, dtype, m, err, err_gemm)
