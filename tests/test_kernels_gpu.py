"""GPU tests of the kbit CUDA kernels (vllm_kbit._C): repack, quantize, dequantize, gemm.

Skipped cleanly without a GPU or without the built extension. References:
  * repack / quantize / dequantize: bit-exact against vllm_kbit/layout.py and format.py;
  * gemm: every element against float64 x @ dequantize(W, float64)^T (+ bias) within the bound
    of tests/kernel_check.py (derived from the dtype and K; one wrong block fails it).
Every gemm call sees fresh random inputs and an output buffer the caching allocator hands
back from a NaN-filled block (so an unwritten element shows up as NaN).
"""
import functools
import os
import subprocess
import sys

import pytest
import torch

from vllm_kbit import format as kf
from vllm_kbit import layout as kl
from vllm_kbit import ops

import gemm_cases
import kernel_check as kc

HAVE_KERNELS = torch.cuda.is_available() and ops.HAS_CUDA_KERNELS
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAVE_KERNELS, reason="needs a CUDA GPU and the built vllm_kbit._C")]

DEV = "cuda"
ALL_M = [1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 33, 64, 256, 1024]
PATH_AUTO, PATH_GEMV, PATH_MMA, PATH_DEQUANT, PATH_WGMMA = ops.Path.AUTO, ops.Path.GEMV, ops.Path.MMA, ops.Path.DEQUANT, ops.Path.WGMMA


def _poison_allocator():
    """Fill a block of each caching-allocator pool (small <= 1 MiB, large) with NaN and free
    them: the op's next allocations reuse that memory."""
    for nbytes in (1 << 20, 64 << 20):
        t = torch.empty(nbytes // 4, dtype=torch.float32, device=DEV)
        t.fill_(float("nan"))
        del t


def _random_weight(n, k, bits, seed):
    """A random tiled weight: random indices, E4M4 codes spread over ~2^-9 .. 2^-1 plus a few
    zero / subnormal blocks."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 32 * bits), generator=g, device=DEV, dtype=torch.int32)
    absmax = torch.randint(0x28, 0xA8, (n, k // 32), generator=g, device=DEV, dtype=torch.int32)
    special = torch.rand(n, k // 32, generator=g, device=DEV) < 0.01
    absmax = torch.where(special, torch.randint(0, 16, (n, k // 32), generator=g, device=DEV, dtype=torch.int32),
                         absmax).to(torch.uint8)
    return qweight, absmax


@functools.lru_cache(maxsize=2)
def _case(n, k, bits, seed=0):
    """(qweight, absmax, packed, absmax_packed, W64, codebook) for a shape, cached."""
    qweight, absmax = _random_weight(n, k, bits, seed)
    cb = kf.normal_float_codebook(bits, DEV)
    packed, ap = torch.ops.kbit.repack(qweight, absmax, bits)
    w64 = kf.dequantize(qweight, absmax, bits, cb, dtype=torch.float64)
    return qweight, absmax, packed, ap, w64, cb


def _close(y, ref, dtype, where=""):
    """kernel_check's comparison of y with a Reference saved by a script (a plain tuple)."""
    kc.assert_close(y, kc.Reference(*ref), dtype, str(where))


def _check_gemm(n, k, bits, dtype, m, path=PATH_AUTO, bias=False, splits=0, seed=0):
    _, _, packed, ap, w64, cb = _case(n, k, bits, seed)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    b = torch.randn(n, device=DEV, dtype=dtype) if bias else None
    _poison_allocator()
    if path == PATH_AUTO and splits == 0:
        y = torch.ops.kbit.gemm(x, packed, ap, cb, bits, n, k, b)
    else:
        y = torch.ops.kbit.gemm_path(x, packed, ap, cb, bits, n, k, b, path, splits)
    assert y.shape == (m, n) and y.dtype == dtype
    assert torch.isfinite(y).all(), f"non-finite output (unwritten?) n={n} k={k} bits={bits} m={m} path={path}"
    kc.assert_close(y, kc.matmul(x, w64, b), dtype,
                    f"n={n} k={k} bits={bits} {dtype} m={m} path={path} splits={splits}")
    return x, y


# ------------------------------------------------------------------------------ layout kernels

@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("n,k", [(64, 64), (200, 96), (4104, 4128), (72, 1056)])
def test_repack_bit_exact(bits, n, k):
    qweight, absmax = _random_weight(n, k, bits, seed=n * 7 + k + bits)
    packed, ap = torch.ops.kbit.repack(qweight, absmax, bits)
    ref_p, ref_a = kl.repack_ref(qweight, absmax, bits)
    assert packed.dtype == torch.int32 and ap.dtype == torch.uint8
    assert torch.equal(packed, ref_p)
    assert torch.equal(ap, ref_a)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(200, 4128), (4104, 96)])  # a half unit at the end of K; 65 slabs
def test_dequantize_tiled_bit_exact(bits, dtype, n, k):
    qweight, absmax = _random_weight(n, k, bits, seed=bits + n)
    cb = kf.normal_float_codebook(bits, DEV)
    packed, ap = torch.ops.kbit.repack(qweight, absmax, bits)
    w = torch.ops.kbit.dequantize_tiled(packed, ap, cb, bits, n, k, dtype)
    assert torch.equal(w, kf.dequantize(qweight, absmax, bits, cb, dtype=dtype))


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_bit_exact(bits, dtype):
    n, k = 96, 4128
    g = torch.Generator(device=DEV).manual_seed(bits)
    # rows with scales from tiny (E4M4 subnormals / underflow) to large (near 31)
    row_scale = torch.logspace(-6, 1, n, device=DEV).unsqueeze(1)
    w = (torch.randn(n, k, generator=g, device=DEV) * row_scale).clamp(-30, 30)
    w[0, :32] = 0                                      # all-zero block
    w[1, :32] = 0; w[1, 0] = 1.03125                   # amax exactly between two E4M4 codes
    w[2, :64] = torch.linspace(-1, 1, 64, device=DEV)  # many codebook midpoints
    w = w.to(dtype)
    cb = kf.normal_float_codebook(bits, DEV)
    q, a = torch.ops.kbit.quantize(w, cb, bits)
    q_ref, a_ref = kf.quantize(w, bits, cb)
    assert torch.equal(a, a_ref)
    assert torch.equal(q, q_ref)
    # through the public wrapper (checks + underflow count) as well
    q2, a2, _ = ops.quantize(w, bits, cb)
    assert torch.equal(q2, q_ref) and torch.equal(a2, a_ref)


def test_quantize_custom_codebook():
    bits = 3
    cb = torch.tensor([-1.0, -0.5, -0.2, -0.05, 0.0, 0.1, 0.4, 0.9], device=DEV)
    w = torch.randn(64, 256, device=DEV, dtype=torch.float16)
    q, a = torch.ops.kbit.quantize(w, cb, bits)
    q_ref, a_ref = kf.quantize(w, bits, cb)
    assert torch.equal(q, q_ref) and torch.equal(a, a_ref)


# ------------------------------------------------------------------------------ gemm

@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemm_llama_square_all_m(bits, dtype):
    """Every M of the list on 4096 x 4096, through the op's own dispatch; bias on odd M."""
    for m in ALL_M:
        _check_gemm(4096, 4096, bits, dtype, m, bias=bool(m % 2))


@pytest.mark.parametrize("n,k", [(4096, 14336), (6144, 4096), (200, 96), (4104, 4128), (72, 1056)])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemm_shapes(n, k, bits, dtype):
    ms = [1, 3, 8, 9, 16, 17, 64, 256] if n * k < 2 ** 25 else [1, 4, 16, 17, 256]
    for i, m in enumerate(ms):
        _check_gemm(n, k, bits, dtype, m, bias=bool(i % 2))


@pytest.mark.parametrize("bits", [2, 4, 5])
def test_gemv_forced_splits(bits):
    """The GEMV path with every split-K factor (cluster sizes 1..8) on awkward shapes, at M = 1
    and at 8 < M <= 16 (16-warp CTAs staging x in shared memory, rows past M zero-filled)."""
    for n, k in [(4104, 4128), (200, 96), (72, 1056)]:
        for splits in range(1, 9):
            for m in (1, 9, 16):
                _check_gemm(n, k, bits, torch.float16, m, path=PATH_GEMV, splits=splits, bias=True)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_cta_sizes(bits, dtype):
    """M <= 8 runs 16-warp CTAs where 64-column slabs x splits fit one per SM, 4-warp CTAs
    (four per SM) where the slabs fit four per SM, 8-warp CTAs (two per SM) beyond
    (csrc/dispatch/gemv_plan.h): shapes in each range and on their edges, forced splits included. The
    16-warp CTAs read the wide-row pair table (K=3,4; at M > 8 K=3 only, csrc/gemv/gemv_kernel.cuh)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k, splits in [(1000, 2080, 0), (64 * sms // 2 - 24, 1056, 2), (64 * 2 * sms + 8, 1056, 0),
                         (64 * sms + 8, 544, 2), (64 * sms + 8, 2080, 0), (64 * 4 * sms, 1056, 0),
                         (64 * 4 * sms + 8, 1056, 0)]:
        for m in (1, 6, 8, 12):
            _check_gemm(n, k, bits, dtype, m, path=PATH_GEMV, splits=splits, bias=(m == 6))


# The start of the scripts the tests below run in subprocesses (fresh processes: first calls,
# cold caches); OV is the plan overrides string each forced call passes (argv[2]).
_SCRIPT_PRELUDE = r"""
import sys
import torch
OV = sys.argv[2] if len(sys.argv) > 2 else ""
from vllm_kbit import format as kf
from vllm_kbit import ops  # (registers torch.ops.kbit)
from gemm_cases import capture_graph, replay_poisoned  # tests/ is on PYTHONPATH (_run_script)
import kernel_check as kc


def expected(x, w64, bias=None):  # kc.matmul as a plain tuple of CPU tensors (torch.load reads it)
    return tuple(t.cpu() for t in kc.matmul(x, w64, bias))


def weight(n, k, bits, g):  # a random tiled weight (_random_weight without the special blocks)
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 32 * bits), generator=g, device="cuda", dtype=torch.int32)
    absmax = torch.randint(0x28, 0xA8, (n, k // 32), generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)
    packed, ap = torch.ops.kbit.repack(qweight, absmax, bits)
    cb = kf.normal_float_codebook(bits, "cuda")
    return packed, ap, cb, kf.dequantize(qweight, absmax, bits, cb, dtype=torch.float64)
"""


def _run_script(script, out, timeout=300, overrides=None, **env):
    """Run one of the scripts below in a fresh process with `env` added and `overrides` (plan
    overrides, ops.plan_overrides) as its OV, and return what it saved to `out`."""
    path = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-c", script, str(out), ops.plan_overrides(overrides)], check=True,
                   timeout=timeout, env=dict(os.environ, PYTHONPATH=path, **env))
    return torch.load(out)


_GEMV_OUTPUTS = _SCRIPT_PRELUDE + r"""
out = []
# 16 slabs (16-warp CTAs), 200 slabs (four 4-warp CTAs per SM on 132 SMs); half a unit at the
# end of K; 9 slabs, the last one partial, over 224 units of K (x resident at M = 1 with S = 2,
# 112 of at most 144 units; at M = 13, 16 no K range of S <= 2 fits, so the plan is the classic one)
for n, k in ((1000, 2080), (12800, 2080), (520, 14336)):
    for bits in (2, 3, 4, 5):
        g = torch.Generator(device="cuda").manual_seed(bits)
        packed, ap, cb, w64 = weight(n, k, bits, g)
        for m in (1, 13, 16):
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            y = torch.ops.kbit.gemm_path(x, packed, ap, cb, bits, n, k, None, ops.Path.GEMV, 0, OV)
            out.append((y.cpu(), expected(x, w64)))
torch.save(out, sys.argv[1])
"""


GEMV_VARIANTS = (("default", {}), ("packed", {"gemv.wide_table": 0}),
                 ("x_regs", {"gemv.x_resident": 0, "gemv.x_smem": 0}), ("x_ring", {"gemv.x_resident": 0}),
                 *((f"x_resident_{g}", {"gemv.slabs": g}) for g in (2, 4, 15, 16)),
                 *((f"x_resident_{g}_packed", {"gemv.slabs": g, "gemv.wide_table": 0}) for g in (4, 15, 16)))


def test_gemv_variants(tmp_path):
    """The GEMV's per-device choices: the wide-row pair table (K=3,4, CTAs alone on their SM;
    M <= 8) against the packed one that sm_86 / sm_89 take (gemv.wide_table=0) must give the
    same bits (same values, same order). At 8 < M <= 16, the 8-warp kernel with x in registers
    that those devices run (gemv.x_smem=0), the per-warp x ring (gemv.x_resident=0), and x
    resident with 2, 4, 15 and 16 slabs per CTA (gemv.slabs; other summation orders) must each
    meet the float64 reference like the default. One subprocess each, three shapes, K = 2..5,
    M = 1, 13 (rows past M zero-filled), 16. x resident in 4, 15 or 16 slabs reads the wide-row table
    where the K range fits beside it (K=3,4): bit-identical to the packed table's results too."""
    outs = {}
    for name, overrides in GEMV_VARIANTS:
        outs[name] = _run_script(_GEMV_OUTPUTS, tmp_path / f"{name}.pt", overrides=overrides)
        assert len(outs[name]) == 36
    for i in range(36):
        y, ref = outs["default"][i]
        assert torch.equal(outs["packed"][i][0], y), i
        for g in (4, 15, 16):
            assert torch.equal(outs[f"x_resident_{g}_packed"][i][0], outs[f"x_resident_{g}"][i][0]), (g, i)
        for name, _ in GEMV_VARIANTS:
            y = outs[name][i][0]
            assert torch.isfinite(y).all(), (name, i)
            _close(y, ref, torch.bfloat16, (name, i))


_GEMV_XR_SPLITS = _SCRIPT_PRELUDE + r"""
# x resident with G = gemv.slabs (OV) slabs per CTA and every split S = 1..4 (clusters of S
# along K; G = 15, S = 4 is what the plan takes for 28672x4096 from M = 1 at K = 3, 4, M = 11
# at K=5), fp16 and bf16, M = 1, 13, 16.
out = []
for n, k in ((1000, 2080), (12800, 2080)):
    for bits in (2, 4, 5):
        g = torch.Generator(device="cuda").manual_seed(n + bits)
        packed, ap, cb, w64 = weight(n, k, bits, g)
        for splits in (1, 2, 3, 4):
            for m in (1, 13, 16):
                dtype = torch.float16 if (m + splits) % 2 else torch.bfloat16
                x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
                torch.full((m, n), float("nan"), device="cuda", dtype=dtype)  # freed: the block y reuses
                y = torch.ops.kbit.gemm_path(x, packed, ap, cb, bits, n, k, None, ops.Path.GEMV, splits, OV)
                out.append((y.cpu(), expected(x, w64), str(dtype)))
torch.save(out, sys.argv[1])
"""


@pytest.mark.parametrize("slabs", [2, 4, 15, 16])
def test_gemv_resident_splits(tmp_path, slabs):
    """x resident in CTAs of 2, 4, 15 (15 warps), 16 slabs (the override gemv.slabs)
    with every split-K cluster size 1..4 meets the float64 reference."""
    outs = _run_script(_GEMV_XR_SPLITS, tmp_path / "out.pt", overrides={"gemv.slabs": slabs})
    assert len(outs) == 2 * 3 * 4 * 3
    for i, (y, ref, dtype) in enumerate(outs):
        assert torch.isfinite(y).all(), (slabs, i)
        _close(y, ref, torch.float16 if dtype == str(torch.float16) else torch.bfloat16, (slabs, i))


# clusters of 1..8 one-per-SM CTAs the H200 runs at once: tests/cpp/gemv_plan_test.cu replays
# the GEMV plan with these
H200_CLUSTERS = [132, 66, 39, 30, 22, 17, 15, 15]


def test_gemv_plan_on_device():
    """The GEMV plan as launched (kbit::gemv_plan): the device's cluster capacity is at most
    SMs / s for clusters of s, never larger for a larger s, and on an H200 it is the table the CPU
    replay assumes; there the plans the measurements chose: Llama-3-8B's gate_up at M = 16 in
    15-slab CTAs of 15 warps, clusters of four; a 2048-column layer (32 slabs) at S = 3, not 4
    (32 clusters of four would run in two waves); Phi-3-mini's qkv in 4-warp CTAs at S = 3."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    def plan(m, n, k, bits):
        p = ops.gemv_plan(m, n, k, bits)
        return [p.splits, p.warps, p.slabs]

    p = ops.gemv_plan(16, 28672, 4096, 4)
    cl = list(p.clusters)
    assert len(cl) == 8 and (p.bits, p.mt, p.chunk) == (4, 2, -(-64 // p.splits)), p
    if torch.cuda.get_device_capability()[0] < 9:
        assert cl == [0] * 8 and p.splits == 1
        return
    assert cl[0] == sms, cl
    assert all(cl[s - 1] <= sms // s for s in range(1, 9)), cl
    assert all(a >= b for a, b in zip(cl, cl[1:])), cl
    if "H200" in torch.cuda.get_device_name() and sms == 132:
        assert cl == H200_CLUSTERS
        assert plan(16, 28672, 4096, 4) == [4, 15, 15]
        assert plan(16, 2048, 8192, 4) == [3, 16, 0]
        assert plan(1, 28672, 4096, 3) == [4, 15, 15]  # K=3: resident at every M
        assert plan(1, 28672, 4096, 4) == [4, 15, 15]  # K=4 too
        assert plan(1, 4096, 4096, 4) == [2, 16, 0]
        assert plan(16, 9216, 3072, 4) == [3, 4, 0]  # gemv_narrow_min_units


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_short_k_narrow_plan(dtype, bits):
    """Phi-3-mini's qkv (9216x3072: 144 slabs of 48 units) through the op's own dispatch: on an
    H200 four 4-warp CTAs per SM at S = 3, four units a warp (csrc/dispatch/gemv_plan.h, gemv_narrow_min_units)."""
    for m in (1, 5, 8, 9, 16):
        _check_gemm(9216, 3072, bits, dtype, m, bias=bool(m % 2))


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_wide_layer_plan(dtype, bits):
    """28672x4096 (Llama-3-8B's gate_up, 448 slabs) through the op's own dispatch at every M the
    GEMV's plans differ on (on an H200, tests/cpp/gemv_plan_test.cu pins which): classic 4-warp
    CTAs, x resident in CTAs of four slabs, and of fifteen slabs in clusters of four (from M = 1
    at K = 3, 4, M = 11 at K=5; never at K=2)."""
    for m in (1, 4, 6, 8, 9, 11, 12, 16):
        _check_gemm(28672, 4096, bits, dtype, m, bias=bool(m % 2))


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_subnormal_scales(dtype, bits):
    """Every block's absmax an E4M4 subnormal, through the GEMV at M = 1 (one n8 tile) and 9, 16
    (two): where the block scale multiplies the decoded pairs (csrc/gemv/gemv_kernel.cuh, scale_weights) it
    is built from the code bits as fp16 / bf16 subnormals, and a flushed one would give zeros."""
    for m in (1, 9, 16):
        gemm_cases.check(PATH_GEMV, m, 1000, 2080, bits, dtype, tiny=True, x_scale=256.0)


_DEQUANT_CHUNKS = _SCRIPT_PRELUDE + r"""
out = []
k = 4128  # a half unit at the end of K
for n in (200, 1000):  # neither a multiple of 64: the last chunk ends inside a slab
    for bits in (2, 3, 4, 5):
        g = torch.Generator(device="cuda").manual_seed(n + bits)
        packed, ap, cb, w64 = weight(n, k, bits, g)
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(33, k, generator=g, device="cuda").to(dtype)
            b = torch.randn(n, generator=g, device="cuda").to(dtype)
            for nbytes in (1 << 20, 64 << 20):  # NaN in the blocks the scratch and y will reuse
                torch.full((nbytes // 4,), float("nan"), device="cuda")
            y = torch.ops.kbit.gemm_path(x, packed, ap, cb, bits, n, k, b, 3, 0, OV)
            out.append((y.cpu(), expected(x, w64, b)))
torch.save(out, sys.argv[1])
"""


def test_dequant_path_row_chunks(tmp_path):
    """The dequantize + cuBLAS path with a 1 MiB scratch (the override dequant.chunk_mib): W is dequantized and multiplied 64 rows at a time, so every
    chunk but the first starts at n_begin > 0 and the last ends inside a 64-column slab.
    K = 2..5, fp16 and bf16, with bias, against float64."""
    outs = _run_script(_DEQUANT_CHUNKS, tmp_path / "chunks.pt", overrides={"dequant.chunk_mib": 1})
    assert len(outs) == 16
    for i, (y, ref) in enumerate(outs):
        dtype = torch.float16 if i % 2 == 0 else torch.bfloat16
        assert torch.isfinite(y).all(), i
        _close(y, ref, dtype, i)


_PDL_CHAIN = _SCRIPT_PRELUDE + r"""
out = []
n = k = 2080  # square, so one layer's output feeds the next; a half unit at the end of K
for bits in (2, 4, 5):
    g = torch.Generator(device="cuda").manual_seed(bits)
    packed, ap, cb, w64 = weight(n, k, bits, g)
    for m in (1, 16, 64, 200):  # GEMV, GEMV with the x ring, wgmma 2-CTA tiles, 128-token tiles
        x_static = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        gemm = lambda a: torch.ops.kbit.gemm_path(a, packed, ap, cb, bits, n, k, None, ops.Path.AUTO, 0, OV)  # the op's own path
        chain = lambda: (lambda y1: (y1, gemm(y1)))(gemm(x_static * 2))
        graph, (y1, y2) = capture_graph(chain)
        for _ in range(2):
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            x_static.copy_(x)
            replay_poisoned(graph, y1, y2)
            out.append((y1.cpu(), y2.cpu(), expected(2 * x.double(), w64), expected(y1, w64)))
torch.save(out, sys.argv[1])
"""


def test_pdl_launch_chain(tmp_path):
    """Programmatic dependent launch (on sm_90 unless the override pdl=0; a subprocess each way): in a CUDA graph, a torch kernel writes x, a GEMM reads it, and a second GEMM reads
    the first one's output, so each GEMM's griddepcontrol.wait is what keeps it from reading its
    input early; at M = 1 the first GEMM also lets the second launch before it has reduced and
    written (allow_dependents; pdl_trigger=0 is the third run). K = 2, 4, 5, M = 1, 16 (GEMV),
    64, 200 (wgmma), outputs NaN-filled before every replay: the same bits in all three runs, and
    both layers meet the float64 reference (the second one on the first one's actual output)."""
    outs = {}
    for name, overrides in (("pdl", {}), ("no_pdl", {"pdl": 0}), ("no_trigger", {"pdl_trigger": 0})):
        outs[name] = _run_script(_PDL_CHAIN, tmp_path / f"{name}.pt", overrides=overrides)
        assert len(outs[name]) == 24
    for i, (y1, y2, ref1, ref2) in enumerate(outs["pdl"]):
        for other in ("no_pdl", "no_trigger"):
            assert torch.equal(y1, outs[other][i][0]) and torch.equal(y2, outs[other][i][1]), (i, other)
        for y, ref in ((y1, ref1), (y2, ref2)):
            assert torch.isfinite(y).all(), i
            _close(y, ref, torch.bfloat16, i)


_INDUCTOR_PDL = _SCRIPT_PRELUDE + r"""
out = []
n = k = 2080
for bits in (2, 4):
    g = torch.Generator(device="cuda").manual_seed(10 + bits)
    packed, ap, cb, w64 = weight(n, k, bits, g)

    def layer(a, r):  # Triton writes x, the GEMM reads it, Triton reads y and writes over r
        y = torch.ops.kbit.gemm(a * 2.0 + r, packed, ap, cb, bits, n, k, None)
        r.mul_(0.5)
        return y * 0.5 + 1.0

    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    for m in (1, 4, 16):  # GEMV with the early trigger (M <= 8), without (the x ring)
        a = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        r = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        graph, y = capture_graph(lambda: compiled(a, r))  # r is rewritten before each replay
        for _ in range(2):
            a.copy_(torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16))
            r0 = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            r.copy_(r0)
            replay_poisoned(graph, y)
            x = (a.float() * 2.0 + r0.float()).to(torch.bfloat16).double()  # the GEMM's input as Inductor rounds it
            ref = kc.matmul(x, w64)  # then * 0.5 + 1.0: scales the bound, the 1.0 adds like a bias
            ref = kc.Reference(ref.value * 0.5 + 1.0, ref.spread * 0.5, ref.xnorm * 0.5, ref.magnitude * 0.5 + 1.0)
            out.append((y.cpu(), tuple(t.cpu() for t in ref), r.cpu(), (r0.double() * 0.5).cpu()))
torch.save(out, sys.argv[1])
"""


def test_inductor_pdl_neighbours(tmp_path):
    """The GEMM between two Triton kernels of a torch.compile graph replayed from a CUDA graph, as
    in vLLM, with Inductor's own PDL (TORCHINDUCTOR_ENABLE_PDL=1: its kernels wait with
    gdc_wait and let their successor launch after their last load, before their stores) and
    without: the GEMM must wait for the kernel that writes its input, and the kernel after it
    (launched early at M <= 8, allow_dependents) must see its output. K = 2, 4, M = 1, 4, 16,
    outputs NaN-filled before every replay: the same bits either way, and within the bf16
    tolerance of the float64 reference."""
    outs = {}
    for name, flag in (("pdl", "1"), ("no_pdl", "0")):
        outs[name] = _run_script(_INDUCTOR_PDL, tmp_path / f"{name}.pt", timeout=600, TORCHINDUCTOR_ENABLE_PDL=flag)
        assert len(outs[name]) == 12
    for i, (y, ref, r, r_ref) in enumerate(outs["pdl"]):
        assert torch.equal(y, outs["no_pdl"][i][0]) and torch.equal(r, outs["no_pdl"][i][2]), i
        assert torch.isfinite(y).all(), i
        _close(y, ref, torch.bfloat16, i)
        assert torch.equal(r.double(), r_ref.to(torch.bfloat16).double()), i


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_forced_paths(bits, dtype):
    n, k = 4104, 4128
    for m in (1, 5, 16):
        _check_gemm(n, k, bits, dtype, m, path=PATH_GEMV, bias=True)
    for m in (1, 17, 100):
        _check_gemm(n, k, bits, dtype, m, path=PATH_DEQUANT, bias=True)
    if torch.ops.kbit.has_mma():
        for m in (1, 16, 17, 300):
            _check_gemm(n, k, bits, dtype, m, path=PATH_MMA, bias=True)


@pytest.mark.parametrize("bits", [2, 4, 5])
def test_auto_dispatch_thresholds(bits):
    """kbit::gemm's own choice around each threshold gives the bits of the path it names, and
    the named paths follow csrc/dispatch/path_rule.h: GEMV up to 16 rows on every layer, wide ones (a
    64-column slab per SM) included."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k = 2048
    narrow, wide = 1000, 64 * sms + 8
    g, d = torch.ops.kbit.gemv_max_m(bits), torch.ops.kbit.dequant_min_m(bits)
    wg = torch.ops.kbit.has_wgmma()
    expect = [(1, narrow, PATH_GEMV), (8, wide, PATH_GEMV), (9, narrow, PATH_GEMV), (g, narrow, PATH_GEMV),
              (9, wide, PATH_GEMV), (g, wide, PATH_GEMV)]
    if wg:  # Hopper builds with 9.0a: wgmma from the GEMV limit to wgmma_short_max_m, then to
        # wgmma_max_m where its plan takes 256-token tiles, then dequantize + cuBLAS
        s, w = torch.ops.kbit.wgmma_short_max_m(bits), torch.ops.kbit.wgmma_max_m(bits)
        assert d <= s < w
        tall = ops.wgmma_plan(w, narrow, k, bits, torch.float16).tile_m == 256
        expect += [(g + 1, narrow, PATH_WGMMA), (d, narrow, PATH_WGMMA), (s, narrow, PATH_WGMMA),
                   (w, narrow, PATH_WGMMA if tall else PATH_DEQUANT), (w + 1, narrow, PATH_DEQUANT)]
    else:  # elsewhere the mma.sync kernel up to dequant_min_m
        expect += [(d, narrow, PATH_DEQUANT)]
        if torch.ops.kbit.has_mma():
            expect += [(g + 1, narrow, PATH_MMA), (d - 1, narrow, PATH_MMA)]
    cases = {}
    for m, n, path in expect:
        assert torch.ops.kbit.auto_path(m, n, k, bits, torch.float16) == path, (m, n)
        if n not in cases:
            cases[n] = _case(n, k, bits)
        _, _, packed, ap, _, cb = cases[n]
        x = torch.randn(m, k, device=DEV, dtype=torch.float16)
        auto = torch.ops.kbit.gemm(x, packed, ap, cb, bits, n, k)
        forced = torch.ops.kbit.gemm_path(x, packed, ap, cb, bits, n, k, None, path, 0)
        assert torch.equal(auto, forced), f"M={m} N={n}: auto dispatch is not path {path}"


def test_gemm_new_input_new_result_and_deterministic():
    n, k, bits = 4096, 4096, 4
    for m in (1, 16, 64):
        x1, y1 = _check_gemm(n, k, bits, torch.float16, m)
        _, _, packed, ap, _, cb = _case(n, k, bits)
        y1b = torch.ops.kbit.gemm(x1, packed, ap, cb, bits, n, k)
        assert torch.equal(y1, y1b), "same input, different output: reduction is not deterministic"
        x2, y2 = _check_gemm(n, k, bits, torch.float16, m)
        assert not torch.equal(y1, y2)


@pytest.mark.parametrize("m", [1, 4, 16, 64, 256])  # 256: dequantize + cuBLAS, scratch in the graph pool
def test_cuda_graph_replay_equals_eager(m):
    n, k, bits, dtype = 4104, 4128, 4, torch.bfloat16
    _, _, packed, ap, _, cb = _case(n, k, bits)
    bias = torch.randn(n, device=DEV, dtype=dtype)
    x_static = torch.randn(m, k, device=DEV, dtype=dtype)
    graph, y_static = gemm_cases.capture_graph(lambda: torch.ops.kbit.gemm(x_static, packed, ap, cb, bits, n, k, bias))
    for _ in range(3):
        x_new = torch.randn(m, k, device=DEV, dtype=dtype)
        x_static.copy_(x_new)
        gemm_cases.replay_poisoned(graph, y_static)
        eager = torch.ops.kbit.gemm(x_new, packed, ap, cb, bits, n, k, bias)
        assert torch.equal(y_static, eager)


def test_torch_compile():
    n, k, bits, dtype = 4096, 4096, 4, torch.float16
    _, _, packed, ap, w64, cb = _case(n, k, bits)

    def layer(x):
        return ops.gemm(x, packed, ap, cb, bits, n, k) * 2.0 + 1.0

    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for m in (1, 7, 64):
        x = torch.randn(2, m, k, device=DEV, dtype=dtype)
        y = compiled(x)
        assert y.shape == (2, m, n)
        torch.testing.assert_close(y, layer(x), rtol=1e-3, atol=1e-3)
        ref = kc.matmul(x.reshape(-1, k), w64)  # then * 2 + 1: scales the bound, the 1 adds like a bias
        ref = kc.Reference(ref.value * 2.0 + 1.0, ref.spread * 2.0, ref.xnorm * 2.0, ref.magnitude * 2.0 + 1.0)
        kc.assert_close(y.reshape(-1, n), ref, dtype, f"m={m}")


# ------------------------------------------------------------------------------ checks

def test_arch_check_message():
    with pytest.raises(RuntimeError, match="compute capability 8.0"):
        torch.ops.kbit.check_arch(7, 5)
    torch.ops.kbit.check_arch(8, 0)
    torch.ops.kbit.check_arch(9, 0)


def test_bad_arguments_raise():
    n, k, bits = 200, 96, 4
    _, _, packed, ap, _, cb = _case(n, k, bits)
    x = torch.randn(3, k, device=DEV, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.kbit.gemm(torch.randn(3, k + 32, device=DEV, dtype=torch.float16), packed, ap, cb, bits, n, k)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        torch.ops.kbit.gemm(x.float(), packed, ap, cb, bits, n, k)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.kbit.gemm(torch.randn(k, 3, device=DEV, dtype=torch.float16).t(), packed, ap, cb, bits, n, k)
    with pytest.raises(RuntimeError, match="tiled layout"):
        torch.ops.kbit.gemm(x, packed[:-1], ap, cb, bits, n, k)
    with pytest.raises(RuntimeError, match="codebook"):
        torch.ops.kbit.gemm(x, packed, ap, cb[:-1], bits, n, k)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.kbit.gemm(x, packed, ap, cb, bits, n, k, torch.randn(n + 1, device=DEV, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.ops.kbit.gemm(x, packed.cpu(), ap, cb, bits, n, k)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.kbit.quantize(torch.randn(4, 48, device=DEV), cb, bits)
    y = torch.ops.kbit.gemm(x[:0], packed, ap, cb, bits, n, k)
    assert y.shape == (0, n)
