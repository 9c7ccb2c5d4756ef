"""Where a vLLM generate's GPU time goes: one generate of bs prompts (128 tokens -> 256), the
engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that torch.profiler sees its kernels
(CUPTI traces the kernels inside CUDA graphs one by one), Llama-3-8B shape, dummy weights.

  python3 benchmarks/profile_step.py --config kbit4 --bs 1,16 --out DIR     # or --config bf16
Prints per batch size: wall time, kernel span, GPU busy (union of kernel intervals), kernel
time by class (us/step = / 256), the top kernels, and our launches by (kernel, grid) with their
mean time and overlap of the kernel before; writes DIR/profile_CONFIG.json (meta + runs).
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # e2e.py's model folder

import torch  # noqa: E402


def classify(name):
    n = name.lower()
    if "kbit" in n:
        return "kbit:" + ("gemv" if "gemv" in n else "wgmma" if "wgmma" in n else "dequant" if "dequant" in n else "other")
    for key, cls in (("flash", "attention"), ("attn", "attention"), ("paged", "attention"), ("reshape_and_cache", "kv-write"),
                     ("rms", "norm"), ("norm", "norm"), ("rotary", "rope"), ("rope", "rope"), ("silu", "act"),
                     ("act_and_mul", "act"), ("nvjet", "cublas"), ("gemm", "cublas"), ("sm90_xmma", "cublas"),
                     ("cutlass", "cublas"), ("sampl", "sampling"), ("topk", "sampling"), ("argmax", "sampling"),
                     ("softmax", "sampling"), ("triton", "triton"), ("elementwise", "elementwise"),
                     ("reduce", "reduce"), ("copy", "copy"), ("memset", "memset"), ("index", "index"), ("cat", "copy")):
        if key in n:
            return cls
    return "other"


def summarize(events, wall):
    evs = sorted(events, key=lambda e: (e["ts"], e["ts"] + e["dur"], e["name"]))
    busy, cur_s, cur_e = 0.0, None, None  # union of the kernels so far; [cur_s, cur_e]: its last piece
    total, by_cls, by_name, launches = 0, {}, {}, {}
    for ev in evs:
        s, e, n = ev["ts"], ev["ts"] + ev["dur"], ev["name"]
        if "kbit" in n:
            # our kernels per launch shape (name, grid), so each layer's mean time can be set beside
            # bench_decode.py --per-shape, and how much of it overlaps the kernels before (a PDL
            # launch that waits counts its wait as its own time)
            a = launches.setdefault(f"{n[:70]} grid={tuple(ev.get('args', {}).get('grid', ()))}", [0, 0.0, 0.0])
            a[0] += 1
            a[1] += ev["dur"]
            a[2] += max(0.0, min(cur_e, e) - s) if cur_e is not None else 0.0
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
        total += e - s
        c = classify(n)
        by_cls[c] = by_cls.get(c, 0.0) + (e - s)
        a = by_name.setdefault(n[:90], [0, 0.0])
        a[0] += 1
        a[1] += e - s
    if cur_e is not None:
        busy += cur_e - cur_s
    span = (evs[-1]["ts"] + evs[-1]["dur"] - evs[0]["ts"]) if evs else 0.0
    return {"wall_s": wall, "kernel_span_us": span, "gpu_busy_us": busy, "kernels": len(evs),
            "sum_kernel_us": total, "by_class_us": dict(sorted(by_cls.items(), key=lambda kv: -kv[1])),
            "top": sorted(([k, v[0], v[1]] for k, v in by_name.items()), key=lambda r: -r[2])[:30],
            "kbit_launches": sorted(([k, v[0], v[1] / v[0], v[2] / v[0]] for k, v in launches.items()),
                                    key=lambda r: -r[1] * r[2])[:12]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="kbit4")
    ap.add_argument("--bs", default="1,16")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/e2e"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from e2e import LLAMA3_8B, write_model_dir
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import numpy as np

    model = write_model_dir(args.workdir / "llama-8b", LLAMA3_8B)
    kw = dict(model=str(model), max_model_len=1024, gpu_memory_utilization=0.85, seed=0, enable_prefix_caching=False,
              load_format="dummy", max_num_seqs=256)
    if args.config.startswith("kbit"):
        kw["quantization"] = "kbit"
        kw["hf_overrides"] = {"quantization_config": {"quant_method": "kbit", "bits": int(args.config[4])}}
    llm = LLM(**kw)
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0.0)
    res = {}
    for bs in [int(b) for b in args.bs.split(",")]:
        batch = [TokensPrompt(prompt_token_ids=rng.integers(0, 10000, 128).tolist()) for _ in range(bs)]
        llm.generate(batch, sp, use_tqdm=False)
        t = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        plain = time.perf_counter() - t
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            llm.generate(batch, sp, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        trace = args.out / f"trace_{args.config}_bs{bs}.json"
        prof.export_chrome_trace(str(trace))
        ev = [e for e in json.load(open(trace))["traceEvents"] if e.get("cat") == "kernel" and "dur" in e]
        trace.unlink()
        s = summarize(ev, wall)
        s["wall_unprofiled_s"] = plain
        res[f"bs{bs}"] = s
        print(f"== {args.config} bs={bs}: wall {plain:.3f} s (profiled {wall:.3f}), kernel span {s['kernel_span_us']/1e3:.1f} ms, "
              f"GPU busy {s['gpu_busy_us']/1e3:.1f} ms, {s['kernels']} kernels", flush=True)
        for c, us in s["by_class_us"].items():
            print(f"   {c:16s} {us/1e3:8.1f} ms  {us/256:8.1f} us/step", flush=True)
        for n, cnt, us in s["top"][:14]:
            print(f"   {us/1e3:8.1f} ms {cnt:7d}x  {n}", flush=True)
        for n, cnt, us, ov in s["kbit_launches"]:
            print(f"   kbit launch {us:7.2f} us mean ({ov:5.2f} overlapping the kernel before) {cnt:7d}x  {n}", flush=True)
    from bench_gemm import git_commit
    meta = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()),
            "commit": git_commit(), "command": " ".join([sys.executable] + sys.argv), "torch": torch.__version__}
    (args.out / f"profile_{args.config}.json").write_text(json.dumps({"meta": meta, "runs": res}, indent=1))


if __name__ == "__main__":
    main()
