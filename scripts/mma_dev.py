"""Dev harness for the tensor-core kbit GEMM (csrc/kbit_mma.cuh) without the torch extension.

Builds csrc/kbit_mma.cu + csrc/generated/mma_k*.cu + csrc/kbit_repack.cu + scripts/mma_capi.cu
into a shared library with nvcc (parallel), then through ctypes:
  check  - correctness vs a float64 reference of the dequantized weight, on an independent
           Python implementation of the tiled layout (kbit_layout.cuh), NaN-poisoned
           outputs, bitwise determinism on repeat; cross-checks launch_repack's output;
  bench  - K=4 fp16 timings vs cuBLAS fp16 (torch.matmul) on the issue's shapes.
usage: python3 scripts/mma_dev.py [check] [bench] [--out DIR]
"""
import ctypes
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from vllm_kbit import format as kf  # noqa: E402

VARIANT = os.environ.get("KBIT_DEV_VARIANT", "")  # "", NODEQUANT, NOSHFL (dev ceiling probes)
LIB = f"/tmp/kbit_mma_dev{VARIANT}/libkbitmma.so"


def build():
    out = os.path.dirname(LIB)
    os.makedirs(out, exist_ok=True)
    srcs = ["csrc/kbit_mma.cu", "csrc/kbit_repack.cu", "scripts/mma_capi.cu"] + [
        f"csrc/generated/mma_k{b}.cu" for b in (2, 3, 4, 5)]
    flags = ["-arch=sm_90", "-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr",
             "-Xcompiler", "-fPIC", "-Icsrc", "-Xptxas", "-v"] + ([f"-DKBIT_MMA_DEV_{VARIANT}"] if VARIANT else [])
    t0 = time.time()

    def one(s):
        o = os.path.join(out, os.path.basename(s) + ".o")
        r = subprocess.run(["nvcc", *flags, "-c", os.path.join(ROOT, s), "-o", o], cwd=ROOT,
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"nvcc {s} failed:\n{r.stderr}")
        return o, r.stderr

    with ThreadPoolExecutor(8) as ex:
        res = list(ex.map(one, srcs))
    objs = [o for o, _ in res]
    with open(os.path.join(out, "ptxas.log"), "w") as f:
        for (_, log), s in zip(res, srcs):
            f.write(f"== {s}\n{log}\n")
    subprocess.run(["nvcc", "-shared", "-arch=sm_90", *objs, "-o", LIB], check=True)
    print(f"built {LIB} in {time.time() - t0:.1f}s", flush=True)


_lib = None


def lib():
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL(LIB)
        _lib.kbit_mma_ws_c.restype = ctypes.c_size_t
    return _lib


def ptr(t):
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


NUM_SMS = None


def plan(m, n, k, bits):
    out = (ctypes.c_int * 5)()
    lib().kbit_mma_plan_c(m, n, k, bits, NUM_SMS, out)
    return dict(cfg=out[0], splits=out[1], kps=out[2], items=out[3], grid=out[4])


def mma(x, packed, absmax, cb, bits, n, k, bias=None, y=None):
    m = x.shape[0]
    if y is None:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    wsb = lib().kbit_mma_ws_c(m, n, k, bits, NUM_SMS)
    ws = torch.empty(max(wsb, 16), dtype=torch.uint8, device=x.device)
    err = lib().kbit_mma_c(0 if x.dtype == torch.float16 else 1, ptr(x), ptr(packed), ptr(absmax), ptr(cb),
                           ptr(bias), ptr(y), ptr(ws), m, n, k, bits, NUM_SMS,
                           ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if err:
        raise RuntimeError(f"launch_mma error {err}")
    return y


# ----------------------------------------------------------------------------- layout (spec)

def tiled_from_indices(idx, codes, bits):
    """Independent implementation of kbit_layout.cuh: idx uint8 [N, K], codes uint8 [N, K/32]
    -> (packed int32 [units * bits*128], absmax uint8 [units * 128])."""
    dev = idx.device
    n, k = idx.shape
    nu, ku = (n + 63) // 64, (k + 63) // 64
    ip = torch.zeros(nu * 64, ku * 64, dtype=torch.int64, device=dev)
    ip[:n, :k] = idx.long()
    ip = ip.view(nu, 64, ku, 64).permute(0, 2, 1, 3)  # [nu, ku, c, k]
    L = torch.arange(32, device=dev).view(32, 1, 1, 1)
    W = torch.arange(4, device=dev).view(1, 4, 1, 1)
    Q = torch.arange(4, device=dev).view(1, 1, 4, 1)
    E = torch.arange(8, device=dev).view(1, 1, 1, 8)
    cl = (8 * (4 * (W & 1) + Q) + (L >> 2)).expand(32, 4, 4, 8)
    kl = (32 * (W >> 1) + 16 * (E >> 2) + 8 * ((E >> 1) & 1) + 2 * (L & 3) + (E & 1)).expand(32, 4, 4, 8)
    vals = ip[:, :, cl, kl]  # [nu, ku, 32, 4, 4, 8]
    planes = []
    for b in range(bits):
        byte = (((vals >> b) & 1) << E).sum(-1)  # [nu, ku, 32, 4, 4]
        word = (byte << (8 * Q.view(1, 1, 4))).sum(-1)  # [nu, ku, 32, 4]
        planes.append(word)
    packed = torch.stack(planes, 2)  # [nu, ku, bits, 32, 4]
    from vllm_kbit import layout as klayout  # what the slots hold (K = 3..5: nibble words)
    packed = klayout.planes_to_slots(packed & 0xFFFFFFFF, bits)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).reshape(-1)
    cp = torch.zeros(nu * 64, ku * 2, dtype=torch.int64, device=dev)
    cp[:n, :k // 32] = codes.long()
    G = torch.arange(8, device=dev).view(8, 1, 1)
    W2 = torch.arange(4, device=dev).view(1, 4, 1)
    Q2 = torch.arange(4, device=dev).view(1, 1, 4)
    col = 8 * (4 * (W2 & 1) + Q2) + G  # [8,4,4]
    blk = (W2 >> 1).expand(8, 4, 4)
    cpu = cp.view(nu, 64, ku, 2).permute(0, 2, 1, 3)  # [nu, ku, 64, 2]
    am = cpu[:, :, col, blk].to(torch.uint8).reshape(-1)
    return packed, am


def make_weight(n, k, bits, dev, tiny=False, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    idx = torch.randint(0, 1 << bits, (n, k), generator=g, device=dev, dtype=torch.int64).to(torch.uint8)
    if tiny:  # subnormal E4M4 codes only (e == 0)
        codes = torch.randint(1, 16, (n, k // 32), generator=g, device=dev, dtype=torch.int64).to(torch.uint8)
    else:  # realistic range: absmax ~ 0.01 .. 0.5
        codes = torch.randint(0x48, 0xA0, (n, k // 32), generator=g, device=dev, dtype=torch.int64).to(torch.uint8)
    return idx, codes


def dequant64(idx, codes, cb):
    scale = kf.decode_e4m4(codes).double().repeat_interleave(32, dim=1)
    return cb.double()[idx.long()] * scale


# ----------------------------------------------------------------------------- check

def check(log):
    dev = "cuda"
    fails = 0
    rows = []
    weights = {}

    def get_w(n, k, bits, tiny=False):
        key = (n, k, bits, tiny)
        if key not in weights:
            idx, codes = make_weight(n, k, bits, dev, tiny, seed=n * 7 + k * 13 + bits)
            packed, am = tiled_from_indices(idx, codes, bits)
            cb = kf.normal_float_codebook(bits, dev)
            w64 = dequant64(idx, codes, cb)
            weights.clear()
            weights[key] = (idx, codes, packed, am, cb, w64)
        return weights[key]

    def case(m, n, k, bits, dtype, bias=False, tiny=False, repeat=True):
        nonlocal fails
        idx, codes, packed, am, cb, w64 = get_w(n, k, bits, tiny)
        x = (torch.randn(m, k, device=dev) * (1.0 if not tiny else 64.0)).to(dtype)
        b = (torch.randn(n, device=dev) * 0.1).to(dtype) if bias else None
        y = torch.full((m, n), float("nan"), dtype=dtype, device=dev)
        mma(x, packed, am, cb, bits, n, k, bias=b, y=y)
        ref = x.double() @ w64.t()
        if b is not None:
            ref = ref + b.double()
        err = ((y.double() - ref).norm() / ref.norm()).item()
        finite = bool(torch.isfinite(y).all())
        tol = 2e-3 if dtype == torch.float16 else 1e-2
        det = True
        if repeat:
            y2 = torch.full((m, n), float("nan"), dtype=dtype, device=dev)
            mma(x, packed, am, cb, bits, n, k, bias=b, y=y2)
            det = torch.equal(y.view(torch.int16), y2.view(torch.int16))
        ok = finite and err < tol and det
        fails += not ok
        pl = plan(m, n, k, bits)
        r = (f"{'ok ' if ok else 'FAIL'} m={m:5d} n={n:5d} k={k:5d} bits={bits} {str(dtype)[6:]:8s} "
             f"bias={int(bias)} tiny={int(tiny)} cfg={pl['cfg']} splits={pl['splits']:2d} grid={pl['grid']:3d} "
             f"relerr={err:.2e} finite={int(finite)} det={int(det)}")
        rows.append(r)
        print(r, file=log, flush=True)
        if not ok:
            print(r, flush=True)

    # repack cross-check against the spec implementation
    for (n, k, bits) in [(200, 96, 3), (4104, 4128, 4), (130, 160, 5), (64, 64, 2)]:
        idx, codes = make_weight(n, k, bits, dev, seed=1)
        packed, am = tiled_from_indices(idx, codes, bits)
        q = kf.pack_bitplanes(idx.cpu(), bits).to(dev)
        p2 = torch.empty_like(packed)
        a2 = torch.empty_like(am)
        err = lib().kbit_repack_c(ptr(q), ptr(codes.contiguous()), ptr(p2), ptr(a2), n, k, bits,
                                  ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
        same = err == 0 and torch.equal(packed, p2) and torch.equal(am, a2)
        print(f"repack n={n} k={k} bits={bits}: launch_repack {'matches' if same else 'DIFFERS from'} the spec",
              flush=True)
        print(f"repack n={n} k={k} bits={bits}: same={same}", file=log)

    ms = [17, 31, 32, 33, 48, 64, 127, 128, 255, 256, 512, 1000, 1024, 4096]
    for m in ms:  # all M on one odd shape
        case(m, 4104, 4128, 4, torch.float16, bias=(m % 2 == 1))
    for bits in (2, 3, 4, 5):
        for dtype in (torch.float16, torch.bfloat16):
            for m in ([33, 256, 1000] if bits != 4 else [64, 512]):
                case(m, 4104, 4128, bits, dtype, bias=True)
            case(127, 200, 96, bits, dtype, bias=True)
            case(64, 4096, 4096, bits, dtype)
            case(48, 1000, 2080, bits, dtype, tiny=True)
    case(5, 300, 512, 4, torch.float16)
    case(1, 64, 32, 4, torch.bfloat16)
    print(f"check: {len(rows) - fails} passed, {fails} failed", flush=True)
    return fails


# ----------------------------------------------------------------------------- bench

SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)]


def bench_graph(call, n_copies, reps=20):
    """Median per-call time (us) of `call(i)` (i = copy index) replayed from a CUDA graph of
    `reps` calls rotating over the copies: no host launch overhead, weights past L2."""
    call(0)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        call(1 % n_copies)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for i in range(reps):
                call(i % n_copies)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    g.replay()
    en.record()
    torch.cuda.synchronize()
    one = st.elapsed_time(en)
    iters = max(1, min(20, int(60.0 / max(one, 1e-3))))
    ts = []
    for _ in range(5):
        st.record()
        for _ in range(iters):
            g.replay()
        en.record()
        torch.cuda.synchronize()
        ts.append(st.elapsed_time(en) / iters / reps * 1000)
    ts.sort()
    return ts[2]


def bench(log, ms=(64, 256, 1024, 4096), bits=4, shapes=None):
    dev = "cuda"
    print(f"{'N':>6} {'K':>6} {'M':>5} {'cfg':>3} {'spl':>3} {'kbit_us':>9} {'cublas_us':>9} {'ratio':>6} {'TFLOPs':>7}",
          flush=True)
    for (n, k) in (shapes or SHAPES):
        idx, codes = make_weight(n, k, bits, dev)
        packed, am = tiled_from_indices(idx, codes, bits)
        del idx
        cb = kf.normal_float_codebook(bits, dev)
        wbytes = packed.numel() * 4
        reps = max(1, (256 << 20) // wbytes)  # rotate weight copies past the 60 MB L2
        copies = [(packed.clone(), am.clone()) for _ in range(min(reps, 8))]
        wf = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
        wfs = [wf] + [wf.clone() for _ in range(min(max(1, (256 << 20) // (n * k * 2)), 4) - 1)]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            y = torch.empty(m, n, device=dev, dtype=torch.float16)
            wsb = lib().kbit_mma_ws_c(m, n, k, bits, NUM_SMS)
            ws = torch.empty(max(wsb, 16), dtype=torch.uint8, device=dev)

            def run_kbit(i):
                p, a = copies[i]
                err = lib().kbit_mma_c(0, ptr(x), ptr(p), ptr(a), ptr(cb), None, ptr(y), ptr(ws), m, n, k, bits,
                                       NUM_SMS, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
                assert err == 0, err

            def run_cublas(i):
                torch.matmul(x, wfs[i].t(), out=y)

            t_k = bench_graph(run_kbit, len(copies))
            t_c = bench_graph(run_cublas, len(wfs))
            pl = plan(m, n, k, bits)
            tf = 2 * m * n * k / t_k / 1e6
            r = (f"{n:6d} {k:6d} {m:5d} {pl['cfg']:3d} {pl['splits']:3d} {t_k:9.1f} {t_c:9.1f} "
                 f"{t_c / t_k:6.3f} {tf:7.1f}")
            print(r, flush=True)
            print(r, file=log, flush=True)
        del copies, wfs, wf


def sweep(log, ms=(64, 256, 1024, 4096), bits=4, shapes=None):
    """Every valid (tile config, split) per shape and M: calibrates make_plan's cost model."""
    dev = "cuda"
    lib().kbit_mma_forced_ws_c.restype = ctypes.c_size_t
    tile_m = {0: 32, 1: 64, 2: 128}
    hdr = f"{'N':>6} {'K':>6} {'M':>5} | {'heur':>9} {'us':>8} | {'best':>9} {'us':>8} | {'cublas':>8} {'ratio':>6} | all"
    print(hdr, flush=True)
    print(hdr, file=log)
    for (n, k) in (shapes or SHAPES):
        idx, codes = make_weight(n, k, bits, dev)
        packed, am = tiled_from_indices(idx, codes, bits)
        del idx
        cb = kf.normal_float_codebook(bits, dev)
        reps = max(1, (256 << 20) // (packed.numel() * 4))
        copies = [(packed.clone(), am.clone()) for _ in range(min(reps, 8))]
        wf = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
        wfs = [wf] + [wf.clone() for _ in range(min(max(1, (256 << 20) // (n * k * 2)), 4) - 1)]
        kt = (k + 63) // 64
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            y = torch.empty(m, n, device=dev, dtype=torch.float16)
            res = {}
            for cfg in (0, 1, 2):
                if (cfg == 0 and m > 64) or (cfg == 2 and m < 64) or (cfg == 1 and m > 1024):
                    continue
                seen = set()
                for sp in (1, 2, 3, 4, 6, 8, 12, 16):
                    kps = -(-kt // sp)
                    se = -(-kt // kps)
                    if se in seen or (se > 1 and kps < 4):
                        continue
                    seen.add(se)
                    if cfg == 2 and m >= 1024 and se > 4:
                        continue
                    wsb = lib().kbit_mma_forced_ws_c(m, n, k, NUM_SMS, cfg, se)
                    ws = torch.empty(max(wsb, 16), dtype=torch.uint8, device=dev)

                    def run(i, cfg=cfg, se=se, ws=ws):
                        p, a = copies[i]
                        err = lib().kbit_mma_forced_c(0, ptr(x), ptr(p), ptr(a), ptr(cb), None, ptr(y), ptr(ws),
                                                      m, n, k, bits, NUM_SMS, cfg, se,
                                                      ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
                        assert err == 0, err

                    res[(cfg, se)] = bench_graph(run, len(copies))
            t_c = bench_graph(lambda i: torch.matmul(x, wfs[i].t(), out=y), len(wfs))
            pl = plan(m, n, k, bits)
            hk = (pl["cfg"], pl["splits"])
            best = min(res, key=res.get)
            allstr = " ".join(f"{c}/{sp}:{t:.0f}" for (c, sp), t in sorted(res.items()))
            r = (f"{n:6d} {k:6d} {m:5d} | {str(hk):>9} {res.get(hk, float('nan')):8.1f} | {str(best):>9} "
                 f"{res[best]:8.1f} | {t_c:8.1f} {t_c / res[best]:6.3f} | {allstr}")
            print(r, flush=True)
            print(r, file=log, flush=True)
        del copies, wfs, wf


def main():
    global NUM_SMS
    args = sys.argv[1:]
    out = args[args.index("--out") + 1] if "--out" in args else "/tmp"
    if not os.path.exists(LIB) or "--rebuild" in args:
        build()
    NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count
    fails = 0
    with open(os.path.join(out, "mma_dev.log"), "a") as log:
        if "check" in args:
            fails = check(log)
        if "bench" in args:
            ms = (64, 256, 1024, 4096)
            if "--ms" in args:
                ms = tuple(int(v) for v in args[args.index("--ms") + 1].split(","))
            shapes = None
            if "--shapes" in args:
                shapes = [tuple(int(v) for v in sh.split("x")) for sh in args[args.index("--shapes") + 1].split(",")]
            bench(log, ms, shapes=shapes)
        if "sanitize" in args:  # tests/sanitize_mma.py's cases through this library
            for m, n, k, bits, dtype, force in [(5, 200, 96, 3, torch.float16, None), (33, 130, 4128, 4, torch.bfloat16, None),
                                                (64, 64, 2048, 2, torch.float16, None), (100, 200, 1056, 5, torch.bfloat16, "1,3"),
                                                (130, 300, 320, 5, torch.bfloat16, None), (257, 520, 1024, 4, torch.float16, None)]:
                if force:
                    os.environ["KBIT_MMA_FORCE"] = force
                else:
                    os.environ.pop("KBIT_MMA_FORCE", None)
                idx, codes = make_weight(n, k, bits, "cuda")
                packed, am = tiled_from_indices(idx, codes, bits)
                cb = kf.normal_float_codebook(bits, "cuda")
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                y = mma(x, packed, am, cb, bits, n, k)
                ref = x.double() @ dequant64(idx, codes, cb).t()
                print(f"sanitize m={m} n={n} k={k}: relerr {((y.double() - ref).norm() / ref.norm()).item():.2e}")
            os.environ.pop("KBIT_MMA_FORCE", None)
        if "profile" in args:  # one launch per shape, for ncu
            for (m, n, k) in [(2048, 8192, 8192), (64, 28672, 4096)]:
                idx, codes = make_weight(n, k, 4, "cuda")
                packed, am = tiled_from_indices(idx, codes, 4)
                cb = kf.normal_float_codebook(4, "cuda")
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                mma(x, packed, am, cb, 4, n, k)
                torch.cuda.synchronize()
        if "sweep" in args:
            ms = (64, 256, 1024, 4096)
            if "--ms" in args:
                ms = tuple(int(v) for v in args[args.index("--ms") + 1].split(","))
            sweep(log, ms)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
