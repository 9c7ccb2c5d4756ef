"""The linear layers of one decode step, as vLLM runs them: every linear layer of a
Llama-3-8B-shaped model (32 x qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336;
--model picks another of MODELS), each with its own weights, replayed from one CUDA graph.
This is the time the GEMMs add to a decode step at batch M (launch gaps, kernel ramp-up and
tail included, no L2 flush needed: the weights are 1.9-4.4 GB at 4 bits, far beyond the 50 MB L2).
Methods: kbit K (the op's own path choice), cuBLAS fp16, and Marlin / Machete W4 g128 when
vLLM is importable.

  python3 benchmarks/bench_decode.py [--ms 1,16] [--bits 2,4] [--per-shape] [--out DIR]
  python3 benchmarks/bench_decode.py --kbit-paths gemv:1,gemv:2,wgmma:0 --no-baselines   # forced path:splits
  python3 benchmarks/bench_decode.py --between   # an elementwise kernel writes x before each GEMM
  python3 benchmarks/bench_decode.py --overrides pdl=0   # plan overrides on every kbit call (A/B)
  python3 benchmarks/bench_decode.py --model qwen2.5-7b   # another model's layer shapes
  python3 benchmarks/bench_decode.py --model llama3-70b --layers 16 --no-baselines   # fewer layers: 70B's fit one GPU
  python3 benchmarks/bench_decode.py --peers all --bits 2,3,4 --ms 1,16,64,256   # + GemLite, tinygemm, vLLM
      # GPTQ / ExLlama (benchmarks/peers.py); writes bench_decode_peers_<model>_<gpu>.json / .png

Reports µs per step, GB/s of the weights read (and % of the copy bandwidth measured in the same
run), bytes per weight of each format, and the K=2 / K=4 step-time ratio where both ran;
--per-shape also replays the model's layers of one shape at a time (µs per kernel).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gemm as bg  # noqa: E402  (methods, timer, commit stamp)
import peers as pe  # noqa: E402  (the other low-bit kernels)

# model -> (layers, {layer: (N, K)}), the merged q/k/v and gate/up as vLLM runs them
MODELS = {
    "llama3-8b": (32, {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}),
    "qwen2.5-7b": (28, {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}),
    "gemma2-9b": (42, {"qkv": (8192, 3584), "o": (3584, 4096), "gate_up": (28672, 3584), "down": (3584, 14336)}),
    "phi3-mini": (32, {"qkv": (9216, 3072), "o": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192)}),
    # one GPU's worth only with --layers (80 layers of fp16 baselines are 137 GB)
    "llama3-70b": (80, {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}),
}


def capture(calls, xs):
    """A CUDA graph that makes `calls` in order (warmed up outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn, x in calls[:8]:  # warm-up (autotuning, lazy init) outside the capture
            fn(xs[x])
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn, x in calls:
            fn(xs[x])
    return g


def graph_time(calls, xs, reps=30):
    """Median µs of one replay of a CUDA graph that makes `calls` in order."""
    g = capture(calls, xs)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    del g
    return statistics.median(times)


def between(calls):
    """`calls` with an in-place elementwise kernel writing each GEMM's input first (--between)."""
    return [(lambda t, fn=fn: fn(t.mul_(1.0)), k) for fn, k in calls]


def make(method, n, k, bits, peers=None, overrides=""):
    if peers and method in peers:
        return pe.make(peers[method], n, k)
    if method.startswith("kbit"):  # kbitB or kbitB-PATH:SPLITS (a forced path, tuning)
        path, splits = (method.split("-", 1)[1].split(":") + ["0"])[:2] if "-" in method else ("auto", "0")
        return bg.kbit_method(n, k, bits, bg.PATHS[path], int(splits), overrides)
    return {"cublas-fp16": lambda: pe.cublas_method(n, k), "marlin-g128": lambda: pe.marlin_method(n, k, 128),
            "machete-g128": lambda: pe.machete_method(n, k, 128)}[method]()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--per-shape", action="store_true")
    ap.add_argument("--kbit-paths", default="", help="also forced kbit paths, PATH:SPLITS, e.g. gemv:2,wgmma:0")
    ap.add_argument("--between", action="store_true",
                    help="before each GEMM an in-place elementwise kernel rewrites its input, as vLLM's norms and "
                         "activation do (a predecessor that writes x and knows nothing of PDL); the time of those "
                         "kernels alone is reported as method 'between'")
    ap.add_argument("--overrides", default="",
                    help="plan overrides for every kbit call, e.g. pdl=0 (csrc/dispatch/overrides.h)")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=0, help="layers in the graph (default: the model's)")
    pe.add_arguments(ap)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    peers = {p.name: p for p in pe.from_args(args)}
    n_layers, shapes = MODELS[args.model]
    n_layers = args.layers or n_layers
    ks = sorted({k for _, k in shapes.values()})
    from vllm_kbit import ops
    assert ops.HAS_CUDA_KERNELS, "vllm_kbit._C is not built"
    ms = [int(m) for m in args.ms.split(",")]
    methods = [f"kbit{b}" for b in args.bits.split(",")]
    methods += [f"kbit{b}-{p}" for b in args.bits.split(",") for p in args.kbit_paths.split(",") if p]
    if not args.no_baselines:
        methods.append("cublas-fp16")
        try:
            import vllm._custom_ops  # noqa: F401
            methods += ["marlin-g128", "machete-g128"]
        except Exception as e:  # noqa: BLE001
            bg.log(f"# vLLM not importable ({type(e).__name__}); Marlin / Machete skipped")
    methods += list(peers)
    pe.GEMLITE.ms = tuple(ms)
    copy_bw = bg.copy_bandwidth(bg.Timer())
    gpu = torch.cuda.get_device_name()
    bg.log(f"# {gpu}; device-to-device copy {copy_bw:.0f} GB/s")
    results = []
    errors = []  # peers that could not be built or run: {"method", "m", "error"}
    if args.between:
        for m in ms:
            xs = {k: torch.randn(m, k, dtype=bg.DT, device="cuda") for k in ks}
            us = graph_time(between([(lambda t: t, shapes[name][1]) for _ in range(n_layers) for name in shapes]), xs)
            results.append({"method": "between", "m": m, "what": "step", "us": us})
            bg.log(f"{'between':<13} M={m:<3} step {us:8.1f} us  (the elementwise kernels alone)")
    for method in methods:
        bits = int(method[4:].split("-")[0]) if method.startswith("kbit") else 4
        layers, wbytes = [], {}
        t0 = time.perf_counter()
        try:
            for _ in range(n_layers):
                layer = {}
                for name, (n, k) in shapes.items():
                    layer[name], wbytes[name] = make(method, n, k, bits, peers, args.overrides)
                layers.append(layer)
        except Exception as e:  # noqa: BLE001
            bg.log(f"# {method} unavailable: {type(e).__name__}: {e}")
            if method in peers:
                errors.append({"method": method, "m": None, "error": pe.describe_error(e)})
            del layers
            torch.cuda.empty_cache()
            continue
        dt = peers[method].dtype if method in peers else bg.DT
        if method in peers:  # where a run's minutes go (GemLite compiles its kernels at the first call of each M)
            bg.log(f"# {method}: weights built in {time.perf_counter() - t0:.1f} s")
        for m in ms:
            if "-gemv" in method and m > 16:
                continue
            xs = {k: torch.randn(m, k, dtype=dt, device="cuda") for k in ks}
            calls = [(layer[name], shapes[name][1]) for layer in layers for name in shapes]
            if args.between:
                calls = between(calls)
            t1 = time.perf_counter()
            try:
                us = graph_time(calls, xs)
                if method in peers:
                    bg.log(f"# {method} M={m}: warm-up, capture and replays took {time.perf_counter() - t1:.1f} s")
            except Exception as e:  # noqa: BLE001
                if method not in peers:
                    raise
                bg.log(f"# {method} failed at M={m}: {pe.describe_error(e)}")
                errors.append({"method": method, "m": m, "error": pe.describe_error(e)})
                continue
            wb = n_layers * sum(wbytes.values())
            r = {"method": method, "m": m, "what": "step", "us": us, "weight_bytes": wb,
                 "gbs": wb / (us * 1e-6) / 1e9, "pct_copy": 100 * wb / (us * 1e-6) / 1e9 / copy_bw,
                 "bpw": wb / (n_layers * sum(n * k for n, k in shapes.values()))}
            if method in peers:
                r.update(bits=peers[method].bits, group=peers[method].group, bpw_format=peers[method].bpw,
                         act="bf16" if dt == torch.bfloat16 else "fp16")
                kern = getattr(layers[0][next(iter(shapes))], "kernel", None)
                if kern:
                    r["kernel"] = kern
            elif hasattr(layers[0][next(iter(shapes))], "kernel_at"):  # kbit: each layer shape's kernel (key)
                r["kernels"] = {name: layers[0][name].kernel_at(m) for name in shapes}
            results.append(r)
            bg.log(f"{method:<13} M={m:<3} step {us:8.1f} us  {r['gbs']:6.0f} GB/s  {r['pct_copy']:5.1f}% of copy")
            for name, kernel in r.get("kernels", {}).items():
                bg.log(f"{'':<13} M={m:<3} {name:<8} {kernel}")
            if args.per_shape:
                for name, (n, k) in shapes.items():
                    one = [(layer[name], k) for layer in layers]
                    us = graph_time(between(one) if args.between else one, xs) / n_layers
                    r = {"method": method, "m": m, "what": name, "us": us, "weight_bytes": wbytes[name],
                         "gbs": wbytes[name] / (us * 1e-6) / 1e9}
                    results.append(r)
                    bg.log(f"{method:<13} M={m:<3} {name:<8} {us:8.2f} us/kernel  {r['gbs']:6.0f} GB/s")
        del layers
        torch.cuda.empty_cache()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    meta = {"gpu": gpu, "date": stamp, "commit": bg.git_commit(), "command": " ".join([sys.executable] + sys.argv),
            "overrides": args.overrides,
            "copy_bw_gbs": copy_bw, "torch": torch.__version__, "model": args.model, "layers": n_layers,
            "shapes": shapes}
    ratios = k2_vs_k4(results, ms)
    if ratios:
        meta["k2_vs_k4"] = ratios
    os.makedirs(args.out, exist_ok=True)
    fname, payload = f"bench_decode_{stamp}.json", {"meta": meta, "results": results}
    if peers:  # one file per model and GPU, the latest run's (its meta has the date, commit and command)
        fname = f"bench_decode_peers_{args.model}_{pe.gpu_tag(gpu)}.json"
        meta.update(peers=list(peers), **(pe.gemlite_record() if any(
            p.family == "gemlite" for p in peers.values()) else {}))
        payload["errors"] = errors
        if pe.GEMLITE.mode == "fast" and pe.GEMLITE.loaded:
            bg.log(f"# gemlite's tuned configs: {pe.gemlite_save(args.out)}")
        try:
            plot_peers(results, meta, os.path.join(args.out, fname[:-5] + ".png"))
        except Exception as e:  # noqa: BLE001
            bg.log(f"# plot skipped: {type(e).__name__}: {e}")
    with open(os.path.join(args.out, fname), "w") as f:
        json.dump(payload, f, indent=1)
    if peers:  # the same table with bytes per weight, and what did not run
        peers_summary(results, errors, ms, meta)
    else:
        bg.log(f"\n# decode-step linear layers, {args.model} shapes, {gpu} ({meta['commit']}): µs per step")
        bg.log("method".ljust(14) + "".join(f"M={m}".rjust(12) for m in ms))
        for method in (["between"] if args.between else []) + methods:
            cells = [next((f"{r['us']:.0f}" for r in results if r["method"] == method and r["m"] == m and
                           r["what"] == "step"), "-") for m in ms]
            bg.log(method.ljust(14) + "".join(c.rjust(12) for c in cells))
    if ratios:
        bg.log("K=2 / K=4 step-time ratio (K=4 µs / K=2 µs; the aim at M = 1 is >= 1.8x): "
               + ", ".join(f"M={m} {v:.2f}x" for m, v in ratios.items()))


def k2_vs_k4(results, ms):
    """{M: kbit4 step µs / kbit2 step µs} where both ran (how much faster the 2-bit step is)."""
    step = {(r["method"], r["m"]): r["us"] for r in results if r["what"] == "step"}
    return {m: step[("kbit4", m)] / step[("kbit2", m)] for m in ms if ("kbit4", m) in step and ("kbit2", m) in step}


def peers_summary(results, errors, ms, meta):
    """The --peers table: bytes per weight and µs per decode step of every method, then the
    peers that did not run and why."""
    steps = [r for r in results if r["what"] == "step" and "bpw" in r]
    order = sorted({r["method"] for r in steps}, key=bg._method_order)
    rows = []
    for meth in order:
        rs = {r["m"]: r for r in steps if r["method"] == meth}
        cells = {f"M={m}": f"{rs[m]['us']:.0f}" for m in ms if m in rs}
        cells["B/w"] = f"{next(iter(rs.values()))['bpw']:.3f}"
        rows.append((pe.label(meth, next(iter(rs.values()))), cells))
    bg.log(f"\n# kbit and its peers, {meta['model']} x {meta['layers']} layers, {meta['gpu']} ({meta['commit']}): "
           f"B/w = bytes per weight incl. scales / zeros / absmax; µs per step")
    bg.log(pe.table(rows, ["B/w"] + [f"M={m}" for m in ms]))
    seen = set()
    for e in errors:
        if (e["method"], e["error"]) not in seen:
            seen.add((e["method"], e["error"]))
            bg.log(f"# not run: {e['method']}: {e['error']}")


def plot_peers(results, meta, path):
    """µs per decode step of every method at each M (bars), bytes per weight in the labels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r for r in results if r["what"] == "step" and "bpw" in r]
    methods = sorted({r["method"] for r in steps}, key=bg._method_order)
    ms = sorted({r["m"] for r in steps})
    fig, axes = plt.subplots(1, len(ms), figsize=(4.2 * len(ms), 0.32 * len(methods) + 1.8), squeeze=False)
    for ax, m in zip(axes.flat, ms):
        rs = {r["method"]: r for r in steps if r["m"] == m}
        names = [meth for meth in methods if meth in rs]
        ax.barh(range(len(names)), [rs[meth]["us"] for meth in names],
                color=["C0" if meth.startswith("kbit") else "C7" if meth in bg_baselines() else "C1" for meth in names])
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels([f"{meth} ({rs[meth]['bpw']:.3f} B/w)" for meth in names], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"M={m}", fontsize=9)
        ax.set_xlabel("µs per step")
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"decode-step linear layers, {meta['model']} x {meta['layers']} — {meta['gpu']} — {meta['date']} — "
                 f"{meta['commit']}\n{meta['command']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def bg_baselines():
    return ("cublas-fp16", "marlin-g128", "marlin-g32", "machete-g128")


if __name__ == "__main__":
    main()
