"""Shared checks of the tensor-core kbit paths (test_mma_gpu.py, test_wgmma_gpu.py).

Weights are random codebook indices and E4M4 codes in the checkpoint layout (format.py),
tiled by kbit::repack, so a check covers repack + kernel end to end against a float64 matmul
of the dequantized weight, element by element within kernel_check's bound (one wrong block
fails it). Every output element must be written: the block the op's output will land in is
NaN-filled first (caching allocator), and each case runs twice with fresh x.
"""
import torch

from vllm_kbit import format as kf

import kernel_check as kc

_cache = {}
# Plan overrides every forced-path call here passes (kbit::gemm_path's `overrides`, keys in
# csrc/dispatch/overrides.h): tests set entries with monkeypatch.setitem, so they reset.
OVERRIDES = {}


def overrides():
    from vllm_kbit import ops
    return ops.plan_overrides(OVERRIDES)


def random_codes(n, k, bits, seed, codes=(0x70, 0xA0)):
    """(indices uint8 [n, k], E4M4 codes uint8 [n, k/32]) on the GPU: random codebook indices and
    codes in [codes[0], codes[1]). The default codes are realistic absmax values 2^-4 .. 2^-1."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.randint(0, 1 << bits, (n, k), generator=g, device="cuda").to(torch.uint8)
    e4m4 = torch.randint(codes[0], codes[1], (n, k // 32), generator=g, device="cuda").to(torch.uint8)
    return idx, e4m4


def random_weight(n, k, bits, seed, codes=(0x70, 0xA0)):
    """(packed, absmax_packed, codebook, W float64 [n, k]): random_codes in the checkpoint
    layout, tiled by kbit::repack."""
    idx, e4m4 = random_codes(n, k, bits, seed, codes)
    packed, absmax = torch.ops.kbit.repack(kf.pack_bitplanes(idx, bits), e4m4, bits)
    cb = kf.normal_float_codebook(bits, "cuda")
    w = cb.double()[idx.long()] * kf.decode_e4m4(e4m4).double().repeat_interleave(32, dim=1)
    return packed, absmax, cb, w


def weight(n, k, bits, tiny=False):
    """random_weight for (n, k, bits), cached; `tiny`: subnormal E4M4 codes only, which the
    bf16 paths turn into bf16 subnormal scales."""
    key = (n, k, bits, tiny)
    if key not in _cache:
        _cache.clear()
        _cache[key] = random_weight(n, k, bits, 1000 * bits + n + 7 * k + tiny, (1, 16) if tiny else (0x70, 0xA0))
    return _cache[key]


def sanitize_case(path, m, n, k, bits, dtype, bias, splits=0):
    """One small forced-path run for the compute-sanitizer scripts: (within the bound, relative
    norm error)."""
    packed, absmax, cb, w = random_weight(n, k, bits, m + n + k + bits)
    x = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if bias else None
    y = torch.ops.kbit.gemm_path(x, packed, absmax, cb, bits, n, k, b, path, splits, overrides())
    ref = kc.matmul(x, w, b)
    err = ((y.double() - ref.value).norm() / ref.value.norm()).item()
    return kc.compare(y, ref) is None, err


def poison(rows, cols, dtype):
    """NaN-fill the block the op's next output of this size will be allocated from (same size,
    same stream: the caching allocator hands it out again)."""
    p = torch.full((rows, cols), float("nan"), dtype=dtype, device="cuda")
    del p


def run(path, x, packed, absmax, cb, bits, n, k, bias=None, splits=0):
    poison(x.shape[0], n, x.dtype)
    return torch.ops.kbit.gemm_path(x, packed, absmax, cb, bits, n, k, bias, path, splits, overrides())


def check(path, m, n, k, bits, dtype, bias=False, tiny=False, x_scale=1.0, splits=0, describe=lambda: ""):
    """Two runs with fresh x against float64; returns ([(x, y)], (packed, absmax, cb, bias))."""
    packed, absmax, cb, w = weight(n, k, bits, tiny)
    b = (torch.randn(n, device="cuda") * 0.5).to(dtype) if bias else None
    outs = []
    for _ in range(2):  # fresh x each time: a stale output from the last call cannot pass
        x = (torch.randn(m, k, device="cuda") * x_scale).to(dtype)
        y = run(path, x, packed, absmax, cb, bits, n, k, b, splits)
        where = f"m={m} n={n} k={k} bits={bits} {dtype} splits={splits} {describe()}"
        assert torch.isfinite(y).all(), f"non-finite output (unwritten?) {where}"
        kc.assert_close(y, kc.matmul(x, w, b), dtype, where)
        outs.append((x, y))
    return outs, (packed, absmax, cb, b)


def have(op_name):
    """True on a CUDA machine whose vllm_kbit._C reports torch.ops.kbit.<op_name>() true."""
    if not torch.cuda.is_available():
        return False
    try:
        from vllm_kbit import ops
        return ops.HAS_CUDA_KERNELS and bool(getattr(torch.ops.kbit, op_name)())
    except (ImportError, AttributeError, RuntimeError):
        return False


def capture_graph(fn, warmups=2):
    """(graph, what the captured fn() returned): fn warmed up on a side stream first, as
    torch.cuda.graphs asks, so lazy initialisation stays out of the capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_poisoned(graph, *outs):
    """Replay with the outputs NaN-filled first, so a store the replay skips cannot pass."""
    for y in outs:
        y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


def check_graph_capture(path, m=64, n=4096, k=4096, bits=4):
    """The path captured in a CUDA graph and replayed on fresh x equals float64 each time."""
    packed, absmax, cb, w = weight(n, k, bits)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    g, y = capture_graph(lambda: torch.ops.kbit.gemm_path(x, packed, absmax, cb, bits, n, k, None, path, 0, overrides()))
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        replay_poisoned(g, y)
        kc.assert_close(y, kc.matmul(x, w), torch.float16, "graph replay")
