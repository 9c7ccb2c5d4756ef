"""One MoE layer's routed experts, as vLLM runs them inside its moe_forward op, replayed from a
CUDA graph: kbit K (through vllm_kbit.moe.experts_forward, the code KbitMoEMethod.apply runs;
each path forced: `gemm` = kbit::moe_gemm, `grouped` = kbit::moe_gemm_grouped (the grouped
wgmma kernel, Hopper; `grouped@B` at block_m B = 64, 128 or 256, `grouped+KEY=V,...` with plan
overrides, e.g. `grouped@64+moe.one_per_sm=1`),
`dense` = dequantize chunks + vLLM's Triton fused_experts) against vLLM's bf16 fused_experts and its int4 moe_wna16 path (group 128,
through fused_experts with int4_w4a16_moe_quant_config). Routing: fused_topk on random router
logits, made once outside the graph, the same for every method.

  python3 benchmarks/bench_moe.py [--shapes qwen3-30b-a3b,mixtral-8x7b]
      [--ms 1,4,16,64,256,1024,4096] [--bits 2,3,4,5] [--paths gemm,grouped,dense] [--no-baselines]
      [--out DIR]
  python3 benchmarks/bench_moe.py --check    # kbit against bf16 fused_experts of its
                                                   # dequantized experts; exits 1 on a mismatch
  --codebooks per-expert: each expert its own codebooks (w13's and w2's, [E, 2^K], as a
  convert --fit-codebook checkpoint serves) instead of one for the layer.

Times: median µs of --reps replays (CUDA events). Results:
benchmarks/results/bench_moe_<gpu>.json (+ .png), with the GPU, date, commit and command.
vllm_kbit.moe's switches from kbit::moe_gemm to the large-batch paths
(GROUPED_MIN_PAIRS_PER_EXPERT, DENSE_MIN_PAIRS_PER_EXPERT) and the grouped kernel's block_m
(GROUPED_MT128_MIN_PAIRS_PER_EXPERT, GROUPED_MT256_MIN_PAIRS_PER_EXPERT) are read off these
tables; `grouped` paths are skipped where ops.has_moe_grouped() is false.
(benchmarks/bench_moe.py times the kbit MoE ops alone.)
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

SHAPES = {  # experts, top-k, hidden, expert intermediate
    "qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, inter=768),
    "mixtral-8x7b": dict(experts=8, top_k=2, hidden=4096, inter=14336),
}
INT4_GROUP = 128
CHECK_TOL = 2e-2  # relative error of kbit against bf16 of the same (dequantized) weights


def kbit_experts(shape, bits, gen, per_expert_codebooks=False):
    """Random valid kbit experts (random codes, absmax in the dummy-load range) on the GPU;
    one codebook for the layer, or random ones per expert (w13's and w2's)."""
    from vllm_kbit import format as kf
    from vllm_kbit.linear import _DUMMY_CODE_HI, _DUMMY_CODE_LO
    from vllm_kbit.moe import KbitExperts, dense_chunk_size, dense_expert_maps, repack_experts

    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    tensors = []
    for n, k in ((2 * i, h), (h, i)):
        q = torch.randint(-2**31, 2**31, (e, n, k // 32 * bits), dtype=torch.int32, device="cuda", generator=gen)
        a = torch.randint(_DUMMY_CODE_LO, _DUMMY_CODE_HI + 1, (e, n, k // 32), dtype=torch.uint8, device="cuda",
                          generator=gen)
        tensors += list(repack_experts(q, a, bits))
        del q, a
    chunk = dense_chunk_size(h, 2 * i, i)
    codebook, w2_codebook = kf.default_codebook(bits, "cuda"), None
    if per_expert_codebooks:
        cbs = torch.rand(2, e, 1 << bits, device="cuda", generator=gen).sort(-1).values * 2 - 1
        codebook, w2_codebook = (cbs / cbs.abs().amax(-1, keepdim=True)).unbind(0)
    return KbitExperts(*tensors, codebook=codebook.contiguous(), bits=bits, hidden=h, inter=i,
                       gated=True, global_num_experts=e, dense_chunk=chunk,
                       dense_maps=dense_expert_maps(None, e, e, chunk, "cuda"),
                       w2_codebook=None if w2_codebook is None else w2_codebook.contiguous())


def dequantized(ex):
    deq = torch.ops.kbit.dequantize_experts
    return (deq(ex.w13, ex.w13_absmax, ex.codebook, ex.bits, ex.n13, ex.hidden, torch.bfloat16),
            deq(ex.w2, ex.w2_absmax, ex.w2_codebooks, ex.bits, ex.hidden, ex.inter, torch.bfloat16))


def int4_method(shape, gen):
    from vllm.model_executor.layers.fused_moe import fused_experts
    from vllm.model_executor.layers.fused_moe.config import int4_w4a16_moe_quant_config

    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    u8 = dict(dtype=torch.uint8, device="cuda", generator=gen)
    w13, w2 = torch.randint(0, 256, (e, 2 * i, h // 2), **u8), torch.randint(0, 256, (e, h, i // 2), **u8)
    s13 = torch.rand(e, 2 * i, h // INT4_GROUP, device="cuda", generator=gen).to(torch.bfloat16) * 1e-3
    s2 = torch.rand(e, h, i // INT4_GROUP, device="cuda", generator=gen).to(torch.bfloat16) * 1e-3
    qc = int4_w4a16_moe_quant_config(w1_scale=s13, w2_scale=s2, w1_zp=None, w2_zp=None, block_shape=[0, INT4_GROUP])
    return lambda x, tw, tid: fused_experts(x, w13, w2, tw, tid, quant_config=qc)


def routing(shape, m, gen):
    from vllm.model_executor.layers.fused_moe import fused_topk
    x = (torch.randn(m, shape["hidden"], device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    logits = torch.randn(m, shape["experts"], device="cuda", generator=gen)
    tw, tid, _ = fused_topk(x, logits, shape["top_k"], renormalize=True)
    return x, tw, tid


def graph_us(fn, reps):
    """Median µs of one replay of a CUDA graph of fn() (warmed up outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    del g
    return statistics.median(times)


def time_methods(shape_name, methods, inputs, reps, rows):
    for m, (x, tw, tid) in inputs.items():
        for name, fn in methods.items():
            us = graph_us(lambda: fn(x, tw, tid), reps)
            rows.append(dict(shape=shape_name, m=m, method=name, us=us))
            print(f"{shape_name} M={m} {name}: {us:.1f} us", flush=True)


def path_spec(spec):
    """`path[@block_m][+overrides]` -> (path, block_m or None, overrides)."""
    path, _, overrides = spec.partition("+")
    path, _, block_m = path.partition("@")
    return path, int(block_m) if block_m else None, overrides


def rel_err(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--paths", default="gemm,grouped,dense", help="kbit paths to time (gemm, grouped, dense)")
    ap.add_argument("--no-baselines", action="store_true", help="kbit only (no bf16 / int4)")
    ap.add_argument("--check", action="store_true", help="compare kbit with bf16 of its dequantized experts")
    ap.add_argument("--codebooks", choices=("shared", "per-expert"), default="shared",
                    help="one codebook for the layer, or one per expert (convert --fit-codebook)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--tag", help="stem of the result files (default bench_moe_<gpu>)")
    args = ap.parse_args()
    from bench_gemm import git_commit
    from vllm.model_executor.layers.fused_moe import fused_experts

    from vllm_kbit import ops
    from vllm_kbit.moe import experts_forward

    if not ops.HAS_CUDA_KERNELS:
        print("warning: vllm_kbit._C is not built: kbit runs the PyTorch reference", file=sys.stderr)
    gpu = torch.cuda.get_device_name(0)
    ms = [int(m) for m in args.ms.split(",")]
    paths = args.paths.split(",")
    if any(p.startswith("grouped") for p in paths) and not ops.has_moe_grouped():
        print("warning: no grouped MoE kernel on this build / GPU: the grouped path is skipped", file=sys.stderr)
        paths = [p for p in paths if not p.startswith("grouped")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, failures = [], []
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        inputs = {m: routing(shape, m, gen) for m in ms}  # the same tokens and routing for every method
        if not args.no_baselines and not args.check:
            e, h, i = shape["experts"], shape["hidden"], shape["inter"]
            w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
            w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
            baselines = {"bf16": lambda x, tw, tid: fused_experts(x, w13, w2, tw, tid),
                         "int4_moe_wna16_g128": int4_method(shape, gen)}
            time_methods(shape_name, baselines, inputs, args.reps, rows)
            del w13, w2, baselines
            torch.cuda.empty_cache()
        for bits in [int(b) for b in args.bits.split(",")]:
            ex = kbit_experts(shape, bits, gen, per_expert_codebooks=args.codebooks == "per-expert")
            cb_tag = "_cb_per_expert" if args.codebooks == "per-expert" else ""
            methods = {f"kbit{bits}_{p}{cb_tag}":
                       (lambda p, bm, o: lambda x, tw, tid: experts_forward(ex, x, tw, tid, path=p, overrides=o,
                                                                           block_m=bm))(*path_spec(p))
                       for p in paths}
            if args.check:
                w13, w2 = dequantized(ex)
                for m, (x, tw, tid) in inputs.items():
                    ref = fused_experts(x, w13, w2, tw, tid)
                    for name, fn in methods.items():
                        err = rel_err(fn(x, tw, tid), ref)
                        ok = err < CHECK_TOL
                        print(f"{shape_name} M={m} {name}: rel err {err:.2e} {'ok' if ok else 'MISMATCH'}", flush=True)
                        rows.append(dict(shape=shape_name, m=m, method=name, rel_err=err))
                        if not ok:
                            failures.append(f"{shape_name} M={m} {name}")
                del w13, w2
            else:
                time_methods(shape_name, methods, inputs, args.reps, rows)
            del ex, methods
            torch.cuda.empty_cache()
    stamp = {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": git_commit(),
             "command": " ".join(sys.argv), "shapes": {s: SHAPES[s] for s in args.shapes.split(",")},
             "codebooks": args.codebooks,
             "units": "us per call of the layer's routed experts (CUDA graph replay, median)"
             if not args.check else "relative error against bf16 fused_experts of the dequantized experts"}
    args.out.mkdir(parents=True, exist_ok=True)
    # one file per GPU; a run of some shapes or the check gets its own
    parts = [re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")]
    parts += [] if args.shapes == ",".join(SHAPES) else [re.sub(r"[^a-z0-9]+", "_", args.shapes)]
    parts += ["check"] if args.check else []
    tag = args.tag or "_".join(["bench_moe", *parts])
    (args.out / f"{tag}.json").write_text(json.dumps({**stamp, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out / (tag + '.json')}")
    if not args.check:
        plot(rows, stamp, args.out / f"{tag}.png")
    if failures:
        print(f"MISMATCH in {len(failures)} case(s): {', '.join(failures)}")
        return 1
    return 0


def plot(rows, stamp, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for method in dict.fromkeys(r["method"] for r in rows if r["shape"] == shape):
            pts = [(r["m"], r["us"]) for r in rows if r["shape"] == shape and r["method"] == method]
            ax.plot(*zip(*pts), marker="o", label=method, linestyle="--" if not method.startswith("kbit") else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens M")
        ax.set_ylabel("µs")
        ax.set_title(shape)
        ax.legend(fontsize=7)
    fig.suptitle(f"MoE layer (routed experts), {stamp['gpu']}, {stamp['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
