"""Benchmark of the kbit GEMM (torch.ops.kbit.gemm) against cuBLAS fp16 and, when vLLM is
importable in the same process, Marlin W4 (g128, g32) and Machete W4 g128.

Method (see /work/.library/device/METHOD.md): every timed call is preceded by a write of a
512 MiB buffer (flushes the 50 MB L2, and its ~0.15 ms hides the host launch latency of the
call that follows); CUDA events around the call; the median of many calls. Reported per
(shape, M, method): microseconds, GB/s of the bytes that must move (weights incl. scales /
absmax, x, y), % of the device-to-device copy bandwidth measured in the same run, and the
time ratio of kbit to each baseline. Writes a JSON and a PNG stamped with GPU, date, commit
and command into --out, and prints a short table last.

  python benchmarks/bench_gemm.py                 # everything
  python benchmarks/bench_gemm.py --quick         # two shapes, M <= 64
  python benchmarks/bench_gemm.py --path gemv     # force a kbit path (auto|gemv|mma|dequant|wgmma)
  python benchmarks/bench_gemm.py --also-paths mma,wgmma   # + forced paths beside auto
  python benchmarks/bench_gemm.py --sweep-splits  # split-K factors: GEMV 1..8, --path wgmma 1..16 (tuning)
  python benchmarks/bench_gemm.py --dequant-only  # the dequantize kernel alone (fp16 out), GB/s
  python benchmarks/bench_gemm.py --peers all --ms 1,16,64,256   # + GemLite, tinygemm, vLLM GPTQ / ExLlama
                                  # (benchmarks/peers.py; writes bench_gemm_peers_<gpu>.json / .png)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

import torch

import peers as pe
from vllm_kbit.ops import Path

SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)]  # N x K
QUICK_SHAPES = [(4096, 4096), (57344, 8192)]
MS = [1, 4, 16, 64, 256, 1024, 4096]
PATH_NAMES = [p.name.lower() for p in Path]  # --path / --also-paths spell ops.Path in lower case
DT = torch.float16


def log(*a):
    print(*a, flush=True)


class Timer:
    def __init__(self, flush_mib=512):
        self.flush = torch.empty(flush_mib << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn, min_reps=10, max_reps=60, budget_s=0.25):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        # estimate, then take as many reps as the budget allows
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.flush.zero_()
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        est = max(s.elapsed_time(e) * 1e-3 + 2e-4, 1e-6)
        reps = int(min(max_reps, max(min_reps, budget_s / est)))
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in evs:
            self.flush.zero_()
            a.record(); fn(); b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) * 1e3 for a, b in evs)  # microseconds


def copy_bandwidth(timer):
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src), min_reps=10, max_reps=20)
    del src, dst
    return 2 * n / (us * 1e-6) / 1e9  # GB/s, read + write


# ------------------------------------------------------------------------------ methods

def kbit_method(n, k, bits, path, splits=0, overrides=""):
    from vllm_kbit import format as kf
    from vllm_kbit import layout as kl
    from vllm_kbit import ops
    g = torch.Generator(device="cuda").manual_seed(bits)
    packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (kl.packed_numel(n, k, bits),), generator=g, device="cuda",
                           dtype=torch.int32)
    ap = torch.randint(0x30, 0x90, (kl.absmax_numel(n, k),), generator=g, device="cuda",
                       dtype=torch.int32).to(torch.uint8)
    cb = kf.normal_float_codebook(bits, "cuda")
    wbytes = packed.numel() * 4 + ap.numel()
    def run(x, path=path, splits=splits, overrides=overrides):
        if path == 0 and splits == 0 and not overrides:
            return torch.ops.kbit.gemm(x, packed, ap, cb, bits, n, k, None)
        return torch.ops.kbit.gemm_path(x, packed, ap, cb, bits, n, k, None, path, splits, overrides)
    run.tensors = (packed, ap, cb)
    # the kernel (its key, csrc/core/kernel_keys.h) a call of M rows runs
    run.kernel_at = lambda m, sp=splits: ops.gemm_kernel(m, n, k, bits, DT, path, sp, overrides)
    return run, wbytes


# ------------------------------------------------------------------------------ main

def git_commit():
    """$KBIT_GIT_COMMIT if set (the device machine's copy of the tree may carry a stale .git),
    else HEAD (+ "-dirty"), else a hash of the kernel sources."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.environ.get("KBIT_GIT_COMMIT"):
        return os.environ["KBIT_GIT_COMMIT"]
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, cwd=root,
                                       stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD"], cwd=root, stderr=subprocess.DEVNULL)
        return head + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        pass
    import glob
    import hashlib
    h = hashlib.sha1()
    for f in sorted(glob.glob(os.path.join(root, "csrc", "**", "*.*"), recursive=True)):
        with open(f, "rb") as fh:
            h.update(fh.read())
    return "src-" + h.hexdigest()[:10]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two shapes, M <= 64")
    ap.add_argument("--path", default="auto", choices=PATH_NAMES, help="force the kbit path")
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--ms", default=None, help="comma list of M (default: all)")
    ap.add_argument("--shapes", default=None, help="e.g. 4096x4096,57344x8192 (N x K)")
    ap.add_argument("--no-baselines", action="store_true", help="kbit only")
    ap.add_argument("--compare-paths", action="store_true", help="also time gemv and mma separately for M <= 16")
    ap.add_argument("--also-paths", default="", help="comma list of forced paths timed beside --path (gemv: M <= 16)")
    ap.add_argument("--sweep-splits", action="store_true",
                    help="split-K factors: GEMV 1..8 at M in {1, 16}, or with --path wgmma 1..16 at --ms")
    ap.add_argument("--dequant-only", action="store_true",
                    help="time the dequantize kernel (tiled layout -> fp16 W) alone, recorded as M = 0")
    pe.add_arguments(ap)
    ap.add_argument("--overrides", default="",
                    help="plan overrides for every kbit call, e.g. wgmma.one_per_sm=1 (csrc/dispatch/overrides.h)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    peer_list = pe.from_args(args)

    from vllm_kbit import ops  # noqa: F401  (schemas + extension)
    assert ops.HAS_CUDA_KERNELS, "vllm_kbit._C is not built"
    bits_list = [int(b) for b in args.bits.split(",")]
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")] if args.ms else [m for m in MS if not args.quick or m <= 64]
    gpu = torch.cuda.get_device_name()
    timer = Timer()
    copy_bw = copy_bandwidth(timer)
    log(f"# {gpu}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs, torch {torch.__version__}; "
        f"device-to-device copy: {copy_bw:.0f} GB/s")

    have_vllm = False
    if not args.no_baselines:
        try:
            import vllm._custom_ops  # noqa: F401
            have_vllm = True
        except Exception as e:  # noqa: BLE001
            log(f"# vLLM not importable ({type(e).__name__}: {e}); Marlin / Machete skipped")

    results = []
    errors = []  # peers that could not be built or run: {"method", "n", "k", "m", "error"}

    def record(n, k, m, method, us, wbytes, **extra):
        moved = wbytes + m * k * 2 + m * n * 2
        r = {"n": n, "k": k, "m": m, "method": method, "us": us, "gbs": moved / (us * 1e-6) / 1e9,
             "pct_copy": 100.0 * moved / (us * 1e-6) / 1e9 / copy_bw, "bytes": moved, **extra}
        results.append(r)
        log(f"{n:>6}x{k:<6} M={m:<5} {method:<14} {us:10.1f} us {r['gbs']:8.0f} GB/s {r['pct_copy']:6.1f}%"
            + (f"  {r['kernel']}" if "kernel" in r else ""))
        return r

    if args.dequant_only:
        for n, k in shapes:
            for bits in bits_list:
                run, wb = kbit_method(n, k, bits, 0)
                packed, ap_, cb = run.tensors
                fn = lambda: torch.ops.kbit.dequantize_tiled(packed, ap_, cb, bits, n, k, DT)  # noqa: E731
                # bytes moved: the tiled weights read + the fp16 W written (M = 0: no x, no y)
                record(n, k, 0, f"kbit{bits}-dequantize", timer(fn), wb + n * k * 2, bits=bits)
                del run, packed, ap_
                torch.cuda.empty_cache()
    elif args.sweep_splits:
        sweep_path = "wgmma" if args.path == "wgmma" else "gemv"
        # the plan overrides this run was given (e.g. wgmma.one_per_sm=1), with every record
        extra = {"overrides": args.overrides} if args.overrides else {}
        for n, k in shapes:
            for bits in bits_list:
                run, wb = kbit_method(n, k, bits, Path[sweep_path.upper()], 0, args.overrides)
                for m in (ms if sweep_path == "wgmma" else (1, 16)):
                    x = torch.randn(m, k, dtype=DT, device="cuda")
                    record(n, k, m, f"kbit{bits}-{sweep_path}-auto", timer(lambda: run(x, Path[sweep_path.upper()], 0)), wb,
                           bits=bits, splits=0, kernel=run.kernel_at(m, 0), **extra)
                    for sp in range(1, 17 if sweep_path == "wgmma" else 9):
                        record(n, k, m, f"kbit{bits}-{sweep_path}-s{sp}", timer(lambda: run(x, Path[sweep_path.upper()], sp)),
                               wb, bits=bits, splits=sp, kernel=run.kernel_at(m, sp), **extra)
                del run
                torch.cuda.empty_cache()
    else:
        pe.GEMLITE.ms = tuple(ms)
        # forced paths timed beside --path: name -> largest M (the GEMV serves M <= 16 only)
        extra_paths = {p: (16 if p == "gemv" else None) for p in args.also_paths.split(",") if p}
        if args.compare_paths and args.path == "auto":
            extra_paths.update({p: 16 for p in ("gemv", "mma") if p == "gemv" or torch.ops.kbit.has_mma()})
        # Every shape's methods first, then M outer: a compute-bound kernel timed right after
        # another shape's M = 4096 calls ran up to 1.34x slower (the GPU's clock under sustained
        # load; baselines 3-14% slower alike), so each M tier is timed together, small M first.
        per_shape = []
        for n, k in shapes:
            methods = []
            for bits in bits_list:
                methods.append((f"kbit{bits}", *kbit_method(n, k, bits, Path[args.path.upper()], 0, args.overrides), {"bits": bits}))
                for extra, max_m in extra_paths.items():
                    methods.append((f"kbit{bits}-{extra}", *kbit_method(n, k, bits, Path[extra.upper()], 0, args.overrides),
                                    {"bits": bits, **({"max_m": max_m} if max_m else {})}))
            if not args.no_baselines:
                methods.append(("cublas-fp16", *pe.cublas_method(n, k), {}))
                if have_vllm:
                    for name, make in (("marlin-g128", lambda: pe.marlin_method(n, k, 128)),
                                       ("marlin-g32", lambda: pe.marlin_method(n, k, 32)),
                                       ("machete-g128", lambda: pe.machete_method(n, k, 128))):
                        try:
                            methods.append((name, *make(), {}))
                        except Exception as e:  # noqa: BLE001
                            log(f"# {name} unavailable for {n}x{k}: {type(e).__name__}: {e}")
            for p in peer_list:
                fn, wb, err = pe.try_make(p, n, k)
                if err:
                    errors.append({"method": p.name, "n": n, "k": k, "m": None, "error": err})
                    log(f"# {p.name} unavailable for {n}x{k}: {err}")
                    continue
                methods.append((p.name, fn, wb, {"bits": p.bits, "group": p.group, "bpw_format": p.bpw,
                                                 "act": "bf16" if p.dtype == torch.bfloat16 else "fp16",
                                                 **({"kernel": fn.kernel} if hasattr(fn, "kernel") else {})}))
            per_shape.append((n, k, methods))
        for m in sorted(ms):
            for n, k, methods in per_shape:
                x = torch.randn(m, k, dtype=DT, device="cuda")
                xb = x.to(torch.bfloat16)  # the activations of peers that take bf16 only (tinygemm)
                for name, run, wb, extra in methods:
                    if m > extra.get("max_m", 1 << 30):
                        continue
                    xm = xb if extra.get("act") == "bf16" else x
                    try:
                        us = timer(lambda: run(xm))
                    except Exception as e:  # noqa: BLE001
                        log(f"# {name} failed at {n}x{k} M={m}: {type(e).__name__}: {e}")
                        if peer_list:
                            errors.append({"method": name, "n": n, "k": k, "m": m, "error": pe.describe_error(e)})
                        continue
                    kernel = {"kernel": run.kernel_at(m)} if hasattr(run, "kernel_at") else {}
                    record(n, k, m, name, us, wb, bpw=wb / (n * k), **kernel,
                           **{kk: v for kk, v in extra.items() if kk != "max_m"})
        del per_shape
        torch.cuda.empty_cache()

    # ratios of kbit to each baseline (time ratio: < 1 means kbit is faster)
    base = {(r["n"], r["k"], r["m"], r["method"]): r["us"] for r in results}
    for r in results:
        if r["method"].startswith("kbit"):
            for b in ("cublas-fp16", "marlin-g128", "marlin-g32", "machete-g128"):
                if (r["n"], r["k"], r["m"], b) in base:
                    r[f"ratio_{b}"] = r["us"] / base[(r["n"], r["k"], r["m"], b)]

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    meta = {"gpu": gpu, "date": stamp, "commit": git_commit(), "command": " ".join([sys.executable] + sys.argv),
            "copy_bw_gbs": copy_bw, "torch": torch.__version__, "path": args.path,
            "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    os.makedirs(args.out, exist_ok=True)
    tag = f"bench_gemm_{gpu.replace(' ', '_')}_{stamp}"
    payload = {"meta": meta, "results": results}
    if peer_list:  # one file per GPU, the latest run's (its meta has the date, commit and command)
        tag = f"bench_gemm_peers_{pe.gpu_tag(gpu)}"
        meta.update(peers=[p.name for p in peer_list], **(pe.gemlite_record() if any(
            p.family == "gemlite" for p in peer_list) else {}))
        payload["errors"] = errors
        if pe.GEMLITE.mode == "fast" and pe.GEMLITE.loaded:
            log(f"# gemlite's tuned configs: {pe.gemlite_save(args.out)}")
    with open(os.path.join(args.out, tag + ".json"), "w") as f:
        json.dump(payload, f, indent=1)
    try:
        plot(results, meta, os.path.join(args.out, tag + ".png"))
    except Exception as e:  # noqa: BLE001
        log(f"# plot skipped: {type(e).__name__}: {e}")
    summary(results, meta)
    if peer_list:
        peers_summary(results, errors, meta)


def plot(results, meta, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = sorted({(r["n"], r["k"]) for r in results}, key=lambda s: s[0] * s[1])
    cols = min(3, len(shapes))
    rows = (len(shapes) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax, (n, k) in zip(axes.flat, shapes):
        rs = [r for r in results if (r["n"], r["k"]) == (n, k)]
        for method in sorted({r["method"] for r in rs}):
            pts = sorted((r["m"], r["us"]) for r in rs if r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=method,
                    ls="-" if method.startswith("kbit") else "--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"N={n} K={k}")
        ax.set_xlabel("M")
        ax.set_ylabel("us (median, L2 flushed)")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"kbit GEMM — {meta['gpu']} — {meta['date']} — {meta['commit']} — copy {meta['copy_bw_gbs']:.0f} GB/s"
                 f"\n{meta['command']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)  # small: results travel with the tree (e2e.py's plots alike)


def summary(results, meta):
    log("")
    log(f"# summary ({meta['gpu']}, copy {meta['copy_bw_gbs']:.0f} GB/s): us [% copy BW] and kbit/Marlin-g128 time")
    shapes = sorted({(r["n"], r["k"]) for r in results}, key=lambda s: s[0] * s[1])
    methods = sorted({r["method"] for r in results})
    for m in sorted({r["m"] for r in results}):
        if m > 16 and any(r["m"] <= 16 for r in results) and m not in (64, 1024):
            continue
        log(f"M={m}")
        log("  " + "method".ljust(14) + "".join(f"{n}x{k}".rjust(19) for n, k in shapes))
        for meth in methods:
            cells = []
            for n, k in shapes:
                r = next((r for r in results if (r["n"], r["k"], r["m"], r["method"]) == (n, k, m, meth)), None)
                if r is None:
                    cells.append("-".rjust(19))
                else:
                    ratio = f" x{r['ratio_marlin-g128']:.2f}" if "ratio_marlin-g128" in r else ""
                    cells.append(f"{r['us']:.1f} [{r['pct_copy']:.0f}%]{ratio}".rjust(19))
            log("  " + meth.ljust(14) + "".join(cells))


def peers_summary(results, errors, meta):
    """The last table of a --peers run: every method's bytes per weight and its µs at each
    (M, shape); then what could not run, and why."""
    log("")
    log(f"# kbit and its peers ({meta['gpu']}, {meta['commit']}): B/w = bytes per weight incl. scales / "
        f"zeros / absmax; cells: µs (median, L2 flushed)")
    shapes = sorted({(r["n"], r["k"]) for r in results}, key=lambda s: s[0] * s[1])
    cols = [(m, n, k) for m in sorted({r["m"] for r in results}) for n, k in shapes]
    rows = []
    for meth in sorted({r["method"] for r in results}, key=_method_order):
        rs = {(r["m"], r["n"], r["k"]): r for r in results if r["method"] == meth}
        cells = {f"M={m} {n}x{k}": f"{rs[(m, n, k)]['us']:.1f}" for m, n, k in cols if (m, n, k) in rs}
        cells["B/w"] = f"{next(iter(rs.values())).get('bpw', 0):.3f}"
        rows.append((pe.label(meth, next(iter(rs.values()))), cells))
    log(pe.table(rows, ["B/w"] + [f"M={m} {n}x{k}" for m, n, k in cols]))
    seen = set()
    for e in errors:
        if (e["method"], e["error"]) not in seen:
            seen.add((e["method"], e["error"]))
            log(f"# not run: {e['method']}: {e['error']}")


def _method_order(name):
    """kbit first, then the baselines, then the peers; by name within each."""
    return (0 if name.startswith("kbit") else 2 if name.split("-")[0] in pe.FAMILIES else 1, name)


if __name__ == "__main__":
    main()
