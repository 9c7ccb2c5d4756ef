"""GPU tests of the kbit MoE expert kernels (vllm_kbit._C): kbit::moe_gemm, the grouped GEMV over
the blocks of moe_align_block_size's sorted pair ids, and kbit::dequantize_experts.

Skipped cleanly without a GPU or without the built extension. Experts are random float weights
quantized with ops.quantize and tiled with ops.repack, one row of the stacked [E, P] / [E, U]
tensors each; the sorted ids come from vLLM's moe_align_block_size where it runs, else from the
pure-torch equivalent in moe_cases (whose tail past num_tokens_post_padded holds a real pair id
and a wrong expert, which the kernel must not read). References:
  * moe_gemm: float64 x[p // top_k] @ W_e^T (* topk_weights[p]) computed from the routing
    itself; every element of a covered row within the bound of tests/kernel_check.py (derived
    from the dtype and K; one wrong block fails it); rows whose expert is off this rank exactly
    0; every output finite. The caching allocator's blocks are NaN-filled before each call, so
    a row the op leaves unwritten shows up.
  * dequantize_experts: bit-exact against format.dequantize of each expert.
"""
import functools

import pytest
import torch

from vllm_kbit import format as kf
from vllm_kbit import ops

import gemm_cases
import kernel_check as kc
import moe_cases as mc

HAVE_KERNELS = torch.cuda.is_available() and ops.HAS_CUDA_KERNELS
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAVE_KERNELS, reason="needs a CUDA GPU and the built vllm_kbit._C")]

DEV = "cuda"
BITS = [2, 3, 4, 5]
DTYPES = [torch.float16, torch.bfloat16]
# (experts, top_k, n, k): 200 columns end inside a 64-column slab, k = 96 / 1056 end half a
# 64-k unit in; with 128 experts and top-8 most experts get no token at small M
SHAPES = [(7, 2, 200, 96), (128, 8, 192, 1056)]


def _poison_allocator():
    """NaN-fill a block of each caching-allocator pool and free it: the op's output reuses it."""
    for nbytes in (1 << 20, 64 << 20):
        t = torch.empty(nbytes // 4, dtype=torch.float32, device=DEV)
        t.fill_(float("nan"))
        del t


@functools.lru_cache(maxsize=8)
def _experts(num_experts, n, k, bits):
    """(qweight, absmax, packed [E, P], absmax_packed [E, U], codebook, W float64 [E, n, k])."""
    qweight, absmax, cb, w64 = mc.make_experts(num_experts, n, k, bits, DEV, seed=1000 * bits + num_experts + n + k)
    packed, ap = mc.stack_tiled(qweight, absmax, bits)
    return qweight, absmax, packed, ap, cb, w64


def _moe(x, experts, bits, n, k, aligned, block_m, top_k, weights):
    _, _, packed, ap, cb, _ = experts
    sorted_ids, expert_ids, ntpp = aligned
    _poison_allocator()
    return torch.ops.kbit.moe_gemm(x, packed, ap, cb, bits, n, k, sorted_ids, expert_ids, ntpp, block_m, top_k,
                                   weights)


def _check(y, ref, dtype, where, off=None):
    """Shape, dtype, finite; rows in `off` (bool [num_pairs]) exactly 0; every element within
    kernel_check's bound of ref (a Reference, moe_cases.moe_expected; off rows' is 0)."""
    assert y.shape == ref.value.shape and y.dtype == dtype, where
    assert bool(torch.isfinite(y).all()), f"non-finite output (unwritten row?) {where}"
    if off is not None:
        assert bool((y[off] == 0).all()), f"rows no block covers are not 0 {where}"
    kc.assert_close(y, ref, dtype, where)


def _case(bits, dtype, shape, m, block_m, weighted, seed, aligner=mc.align):
    num_experts, top_k, n, k = shape
    experts = _experts(num_experts, n, k, bits)
    ids, weights = mc.routing(m, num_experts, top_k, DEV, seed)
    tw = weights if weighted else None
    x = torch.randn(m, k, device=DEV).to(dtype)
    y = _moe(x, experts, bits, n, k, aligner(ids, block_m, num_experts), block_m, top_k, tw)
    ref = mc.moe_expected(x, ids, tw, experts[5], top_k)
    _check(y, ref, dtype, f"bits={bits} {dtype} E={num_experts} top_k={top_k} n={n} k={k} m={m} block_m={block_m} "
           f"weighted={weighted}")
    return x, y


# ------------------------------------------------------------------------------ moe_gemm

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_moe_gemm(bits, dtype, shape):
    """M = 1, 3, 16, 64 at block_m = 16 (the decode path's) and 5, topk_weights given and not."""
    for i, m in enumerate([1, 3, 16, 64]):
        for block_m in (16, 5):
            _case(bits, dtype, shape, m, block_m, weighted=bool((i + block_m) % 2), seed=m + block_m)


@pytest.mark.parametrize("bits", BITS)
def test_moe_gemm_block_sizes(bits):
    """Every real-row count around the one / two n8-tile border (block_m 1, 2, 8, 9, 15, 16), with
    the pure-torch align (its misleading tail past num_tokens_post_padded)."""
    for block_m in (1, 2, 8, 9, 15, 16):
        _case(bits, torch.float16, SHAPES[0], 24, block_m, weighted=True, seed=block_m, aligner=mc.align_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_moe_gemm_one_expert(bits, dtype):
    """Every token on one expert (top_k = 1): full blocks of 16 real rows and a partial one."""
    num_experts, _, n, k = SHAPES[0]
    experts = _experts(num_experts, n, k, bits)
    for m in (64, 13):
        ids = torch.full((m, 1), 3, dtype=torch.int32, device=DEV)
        weights = torch.rand(m, 1, device=DEV)
        x = torch.randn(m, k, device=DEV).to(dtype)
        y = _moe(x, experts, bits, n, k, mc.align(ids, 16, num_experts), 16, 1, weights)
        _check(y, mc.moe_expected(x, ids, weights, experts[5], 1), dtype, f"one expert bits={bits} m={m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_moe_gemm_expert_parallel_and_down(bits, dtype):
    """Experts off this rank (expert_map -1, expert_ids -1): their rows exactly 0. Then the down
    projection's call: x one row a pair, top_k = 1, the [M, top_k] weights flat, same sorted ids."""
    global_experts, top_k, n, k = 7, 2, 200, 96
    expert_map = torch.tensor([0, -1, 1, -1, 2, 3, -1], dtype=torch.int32, device=DEV)
    experts = _experts(4, n, k, bits)
    for m in (1, 16, 64):
        ids, weights = mc.routing(m, global_experts, top_k, DEV, seed=m)
        aligned = mc.align(ids, 16, global_experts, expert_map)
        off = expert_map[ids.reshape(-1).long()] < 0
        x = torch.randn(m, k, device=DEV).to(dtype)
        y = _moe(x, experts, bits, n, k, aligned, 16, top_k, None)
        _check(y, mc.moe_expected(x, ids, None, experts[5], top_k, expert_map), dtype, f"EP up m={m}", off)
        x2 = torch.randn(m * top_k, k, device=DEV).to(dtype)
        y2 = _moe(x2, experts, bits, n, k, aligned, 16, 1, weights)
        ref2 = mc.moe_expected(x2, ids.reshape(-1, 1), weights, experts[5], 1, expert_map)
        _check(y2, ref2, dtype, f"EP down m={m}", off)


@pytest.mark.parametrize("bits", BITS)
def test_moe_gemm_padding_anywhere(bits):
    """Padding ids anywhere in a block (the entries of every block shuffled): the real rows are
    compacted, the result is the same."""
    num_experts, top_k, n, k = SHAPES[0]
    experts = _experts(num_experts, n, k, bits)
    m, block_m = 16, 16
    ids, weights = mc.routing(m, num_experts, top_k, DEV, seed=7)
    sorted_ids, expert_ids, ntpp = mc.align(ids, block_m, num_experts)
    end = int(ntpp[0])
    g = torch.Generator(device=DEV).manual_seed(bits)
    head = sorted_ids[:end].view(-1, block_m)
    perm = torch.argsort(torch.rand(head.shape, generator=g, device=DEV), dim=1)
    shuffled = sorted_ids.clone()
    shuffled[:end] = torch.gather(head, 1, perm).reshape(-1)
    assert not torch.equal(shuffled, sorted_ids)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    y = _moe(x, experts, bits, n, k, (shuffled, expert_ids, ntpp), block_m, top_k, weights)
    _check(y, mc.moe_expected(x, ids, weights, experts[5], top_k), torch.bfloat16, "shuffled blocks")


def test_moe_gemm_vllm_align_agrees():
    """The pure-torch align the other tests fall back on gives the results vLLM's does."""
    if mc.vllm_align() is None:
        pytest.skip("vLLM's moe_align_block_size does not run here")
    bits, dtype, (num_experts, top_k, n, k) = 4, torch.float16, SHAPES[1]
    experts = _experts(num_experts, n, k, bits)
    for m in (1, 16, 64):
        ids, weights = mc.routing(m, num_experts, top_k, DEV, seed=m)
        x = torch.randn(m, k, device=DEV).to(dtype)
        ya = _moe(x, experts, bits, n, k, mc.align(ids, 16, num_experts), 16, top_k, weights)
        yb = _moe(x, experts, bits, n, k, mc.align_ref(ids, 16, num_experts), 16, top_k, weights)
        ref = mc.moe_expected(x, ids, weights, experts[5], top_k)
        _check(ya, ref, dtype, f"vLLM align m={m}")
        _check(yb, ref, dtype, f"torch align m={m}")


@pytest.mark.parametrize("m", [1, 16])
def test_moe_gemm_cuda_graph_replay_equals_eager(m):
    """Captured once; replayed with new x and new routing copied into the static inputs (the
    sorted ids' length depends on the shapes only): equal to eager each time, bitwise."""
    bits, dtype, (num_experts, top_k, n, k) = 4, torch.bfloat16, SHAPES[1]
    _, _, packed, ap, cb, _ = _experts(num_experts, n, k, bits)
    ids, weights = mc.routing(m, num_experts, top_k, DEV, seed=0)
    static = [t.clone() for t in mc.align(ids, 16, num_experts)] + [weights.clone()]
    x_static = torch.randn(m, k, device=DEV, dtype=dtype)

    def call(x, sorted_ids, expert_ids, ntpp, tw):
        return torch.ops.kbit.moe_gemm(x, packed, ap, cb, bits, n, k, sorted_ids, expert_ids, ntpp, 16, top_k, tw)

    graph, y_static = gemm_cases.capture_graph(lambda: call(x_static, *static))
    for r in range(3):
        ids, weights = mc.routing(m, num_experts, top_k, DEV, seed=r + 1)
        new = list(mc.align(ids, 16, num_experts)) + [weights]
        x_new = torch.randn(m, k, device=DEV, dtype=dtype)
        x_static.copy_(x_new)
        for s, t in zip(static, new):
            assert s.shape == t.shape
            s.copy_(t)
        gemm_cases.replay_poisoned(graph, y_static)
        assert torch.equal(y_static, call(x_new, *new)), f"replay {r} differs from eager"


def test_moe_gemm_deterministic():
    """Same input twice: bitwise equal outputs (fixed-order reduction); fresh x: different."""
    bits, dtype, (num_experts, top_k, n, k) = 3, torch.float16, SHAPES[1]
    experts = _experts(num_experts, n, k, bits)
    ids, weights = mc.routing(64, num_experts, top_k, DEV, seed=3)
    aligned = mc.align(ids, 16, num_experts)
    x = torch.randn(64, k, device=DEV, dtype=dtype)
    y1 = _moe(x, experts, bits, n, k, aligned, 16, top_k, weights)
    y2 = _moe(x, experts, bits, n, k, aligned, 16, top_k, weights)
    assert torch.equal(y1, y2)
    y3 = _moe(torch.randn_like(x), experts, bits, n, k, aligned, 16, top_k, weights)
    assert not torch.equal(y1, y3)


def test_moe_gemm_matches_cpu_reference():
    """The CUDA op and the ops.py reference on the checkpoint layout (CPU tensors) both within
    the bound of float64."""
    bits, dtype, (num_experts, top_k, n, k) = 5, torch.bfloat16, SHAPES[0]
    qweight, absmax, packed, ap, cb, w64 = _experts(num_experts, n, k, bits)
    ids, weights = mc.routing(16, num_experts, top_k, DEV, seed=11)
    aligned = mc.align(ids, 16, num_experts)
    x = torch.randn(16, k, device=DEV, dtype=dtype)
    y = _moe(x, _experts(num_experts, n, k, bits), bits, n, k, aligned, 16, top_k, weights)
    cpu = [t.cpu() for t in aligned]
    y_ref = torch.ops.kbit.moe_gemm(x.cpu(), qweight.cpu(), absmax.cpu(), cb.cpu(), bits, n, k, *cpu, 16, top_k,
                                    weights.cpu())
    ref = mc.moe_expected(x.cpu(), ids.cpu(), weights.cpu(), w64.cpu(), top_k)
    kc.assert_close(y.cpu(), ref, dtype, "CUDA op")
    kc.assert_close(y_ref, ref, dtype, "reference op")


def test_moe_gemm_errors():
    bits, (num_experts, top_k, n, k) = 4, SHAPES[0]
    _, _, packed, ap, cb, _ = _experts(num_experts, n, k, bits)
    ids, weights = mc.routing(4, num_experts, top_k, DEV, seed=0)
    sorted_ids, expert_ids, ntpp = mc.align(ids, 16, num_experts)
    x = torch.randn(4, k, device=DEV, dtype=torch.float16)

    def call(**kw):
        a = dict(x=x, packed=packed, absmax=ap, block_m=16, top_k=top_k, tw=weights, expert_ids=expert_ids)
        a.update(kw)
        return torch.ops.kbit.moe_gemm(a["x"], a["packed"], a["absmax"], cb, bits, n, k, sorted_ids,
                                       a["expert_ids"], ntpp, a["block_m"], a["top_k"], a["tw"])

    call()  # the valid call passes
    with pytest.raises(RuntimeError, match="packed"):
        call(packed=packed[:, :-128].contiguous())
    with pytest.raises(RuntimeError, match="packed"):
        call(packed=packed.reshape(-1))
    with pytest.raises(RuntimeError, match="absmax"):
        call(absmax=ap[:-1])
    with pytest.raises(RuntimeError, match="block_m"):
        call(block_m=17)
    with pytest.raises(RuntimeError, match="block_m"):
        call(block_m=0)
    with pytest.raises(RuntimeError, match="topk_weights"):
        call(tw=weights[:-1])
    with pytest.raises(RuntimeError, match="topk_weights"):
        call(tw=weights.half())
    with pytest.raises(RuntimeError, match="expert_ids"):
        call(expert_ids=expert_ids[:1])
    with pytest.raises(RuntimeError, match="x"):
        call(x=torch.randn(4, k + 32, device=DEV, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="x must be float16 or bfloat16"):
        call(x=x.float())


# ------------------------------------------------------------------------------ dequantize_experts

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_experts_bit_exact(bits, dtype):
    """Every expert equals format.dequantize of its checkpoint tensors; a contiguous slice of
    experts is a valid input (chunking by experts)."""
    for num_experts, n, k in [(7, 200, 96), (5, 192, 1056)]:
        qweight, absmax, packed, ap, cb, _ = _experts(num_experts, n, k, bits)
        w = torch.ops.kbit.dequantize_experts(packed, ap, cb, bits, n, k, dtype)
        assert w.shape == (num_experts, n, k) and w.dtype == dtype
        for e in range(num_experts):
            assert torch.equal(w[e], kf.dequantize(qweight[e], absmax[e], bits, cb, dtype=dtype)), f"expert {e}"
        part = torch.ops.kbit.dequantize_experts(packed[2:5], ap[2:5], cb, bits, n, k, dtype)
        assert torch.equal(part, w[2:5])


def test_dequantize_experts_errors():
    bits, (num_experts, _, n, k) = 3, SHAPES[0]
    _, _, packed, ap, cb, _ = _experts(num_experts, n, k, bits)
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.kbit.dequantize_experts(packed[:, 1:], ap, cb, bits, n, k, torch.float16)
    with pytest.raises(RuntimeError, match="absmax"):
        torch.ops.kbit.dequantize_experts(packed, ap[:3], cb, bits, n, k, torch.float16)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.kbit.dequantize_experts(packed, ap, cb, bits, n, k, torch.int32)


# ------------------------------------------------------------------------------ one codebook per expert

def _per_expert(num_experts, n, k, bits, seed):
    """Experts quantized each with its own random codebook (convert --fit-codebook's case):
    (qweight, absmax, packed, ap, codebooks [E, 2^bits], W float64)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    cbs = torch.rand(num_experts, 1 << bits, generator=g, device=DEV).sort(-1).values * 2 - 1
    cbs = cbs / cbs.abs().amax(-1, keepdim=True)
    qa = [ops.quantize(torch.randn(n, k, generator=g, device=DEV) * 0.02 * (1 + e % 3), bits, cbs[e])[:2]
          for e in range(num_experts)]
    qweight, absmax = torch.stack([q for q, _ in qa]), torch.stack([a for _, a in qa])
    w64 = torch.stack([kf.dequantize(qweight[e], absmax[e], bits, cbs[e], dtype=torch.float64)
                       for e in range(num_experts)])
    packed, ap = mc.stack_tiled(qweight, absmax, bits)
    return qweight, absmax, packed, ap, cbs, w64


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_moe_gemm_codebook_per_expert(bits, dtype, shape):
    """codebook [E, 2^bits]: every block decodes with its expert's row (M = 1, 16, 64, block_m 16
    and 1); the layer's one codebook in its place gives a different result (the check can fail)."""
    num_experts, top_k, n, k = shape
    qweight, absmax, packed, ap, cbs, w64 = _per_expert(num_experts, n, k, bits, seed=bits + n)
    for m in (1, 16, 64):
        ids, weights = mc.routing(m, num_experts, top_k, DEV, seed=m)
        x = torch.randn(m, k, device=DEV).to(dtype)
        ref = mc.moe_expected(x, ids, weights, w64, top_k)
        for block_m in (16, 1):
            _poison_allocator()
            y = torch.ops.kbit.moe_gemm(x, packed, ap, cbs, bits, n, k, *mc.align(ids, block_m, num_experts),
                                        block_m, top_k, weights)
            _check(y, ref, dtype, f"per-expert codebooks bits={bits} m={m} block_m={block_m}")
        y0 = torch.ops.kbit.moe_gemm(x, packed, ap, cbs[0].contiguous(), bits, n, k, *mc.align(ids, 16, num_experts),
                                     16, top_k, weights)
        assert kc.compare(y0, ref, dtype) is not None, "expert 0's codebook for all passed"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_experts_codebook_per_expert(bits, dtype):
    """codebook [E, 2^bits]: each expert bit-exact with format.dequantize with its own codebook,
    a slice of experts with the slice of codebooks too."""
    num_experts, n, k = 8, 200, 1056
    qweight, absmax, packed, ap, cbs, _ = _per_expert(num_experts, n, k, bits, seed=7 * bits)
    w = torch.ops.kbit.dequantize_experts(packed, ap, cbs, bits, n, k, dtype)
    for e in range(num_experts):
        assert torch.equal(w[e], kf.dequantize(qweight[e], absmax[e], bits, cbs[e], dtype=dtype)), f"expert {e}"
    part = torch.ops.kbit.dequantize_experts(packed[2:5], ap[2:5], cbs[2:5], bits, n, k, dtype)
    assert torch.equal(part, w[2:5])


def test_codebook_shape_errors_name_the_codebook():
    bits, (num_experts, top_k, n, k) = 3, SHAPES[0]
    _, _, packed, ap, cbs, _ = _per_expert(num_experts, n, k, bits, seed=5)
    ids, weights = mc.routing(4, num_experts, top_k, DEV, seed=0)
    aligned = mc.align(ids, 16, num_experts)
    x = torch.randn(4, k, device=DEV, dtype=torch.float16)
    for bad in (cbs[:-1].contiguous(), cbs[:, :-1].contiguous(), cbs.reshape(-1), cbs[0, :-1].contiguous()):
        with pytest.raises(RuntimeError, match="codebook has shape"):
            torch.ops.kbit.moe_gemm(x, packed, ap, bad, bits, n, k, *aligned, 16, top_k, weights)
        with pytest.raises(RuntimeError, match="codebook has shape"):
            torch.ops.kbit.dequantize_experts(packed, ap, bad, bits, n, k, torch.float16)
