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

Reports µs per step, GB/s of the weights read (and % of the copy bandwidth measured in the same
run); --per-shape also replays the model's layers of one shape at a time (µs per kernel).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gemm as bg  # noqa: E402  (methods, timer, commit stamp)

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


def make(method, n, k, bits, overrides=""):
    if method.startswith("kbit"):  # kbitB or kbitB-PATH:SPLITS (a forced path, tuning)
        path, splits = (method.split("-", 1)[1].split(":") + ["0"])[:2] if "-" in method else ("auto", "0")
        return bg.kbit_method(n, k, bits, bg.PATHS[path], int(splits), overrides)
    return {"cublas-fp16": lambda: bg.cublas_method(n, k), "marlin-g128": lambda: bg.marlin_method(n, k, 128),
            "machete-g128": lambda: bg.machete_method(n, k, 128)}[method]()


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
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
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
    copy_bw = bg.copy_bandwidth(bg.Timer())
    gpu = torch.cuda.get_device_name()
    bg.log(f"# {gpu}; device-to-device copy {copy_bw:.0f} GB/s")
    results = []
    if args.between:
        for m in ms:
            xs = {k: torch.randn(m, k, dtype=bg.DT, device="cuda") for k in ks}
            us = graph_time(between([(lambda t: t, shapes[name][1]) for _ in range(n_layers) for name in shapes]), xs)
            results.append({"method": "between", "m": m, "what": "step", "us": us})
            bg.log(f"{'between':<13} M={m:<3} step {us:8.1f} us  (the elementwise kernels alone)")
    for method in methods:
        bits = int(method[4:].split("-")[0]) if method.startswith("kbit") else 4
        layers, wbytes = [], {}
        try:
            for _ in range(n_layers):
                layer = {}
                for name, (n, k) in shapes.items():
                    layer[name], wbytes[name] = make(method, n, k, bits, args.overrides)
                layers.append(layer)
        except Exception as e:  # noqa: BLE001
            bg.log(f"# {method} unavailable: {type(e).__name__}: {e}")
            continue
        for m in ms:
            if "-gemv" in method and m > 16:
                continue
            xs = {k: torch.randn(m, k, dtype=bg.DT, device="cuda") for k in ks}
            calls = [(layer[name], shapes[name][1]) for layer in layers for name in shapes]
            if args.between:
                calls = between(calls)
            us = graph_time(calls, xs)
            wb = n_layers * sum(wbytes.values())
            r = {"method": method, "m": m, "what": "step", "us": us, "weight_bytes": wb,
                 "gbs": wb / (us * 1e-6) / 1e9, "pct_copy": 100 * wb / (us * 1e-6) / 1e9 / copy_bw}
            results.append(r)
            bg.log(f"{method:<13} M={m:<3} step {us:8.1f} us  {r['gbs']:6.0f} GB/s  {r['pct_copy']:5.1f}% of copy")
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
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"bench_decode_{stamp}.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    bg.log(f"\n# decode-step linear layers, {args.model} shapes, {gpu} ({meta['commit']}): µs per step")
    bg.log("method".ljust(14) + "".join(f"M={m}".rjust(12) for m in ms))
    for method in (["between"] if args.between else []) + methods:
        cells = [next((f"{r['us']:.0f}" for r in results if r["method"] == method and r["m"] == m and
                       r["what"] == "step"), "-") for m in ms]
        bg.log(method.ljust(14) + "".join(c.rjust(12) for c in cells))


if __name__ == "__main__":
    main()
