"""Power, SM clock and energy while the GPU runs one workload back to back: the linear layers of
a decode step replayed from a CUDA graph (bench_decode.py's graph, Llama-3-8B shapes by default),
or one GEMM (--shapes). Answers "is this bound by the board's power limit?": the H200 is capped
at 700 W, and where a workload reaches the cap the driver lowers the SM clock (clock-event
reason 0x4, SW power cap), so time then follows energy per call rather than cycles per call.

  python3 benchmarks/bench_power.py [--ms 1,16,64,256] [--methods kbit4,cublas-fp16,machete-g128]
  python3 benchmarks/bench_power.py --shapes 57344x8192,8192x28672 --ms 64,1024

Each case runs ~2.5 s while nvidia-smi samples every 50 ms (the first 0.2 s dropped); reports µs
per call, the median SM clock and board power, mJ per call (power x time) and the clock-event
reasons seen. No L2 flush: the decode step's weights (GBs) and the --shapes given should exceed
the 50 MB L2, or the GEMM runs from L2.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402
import bench_gemm as bg  # noqa: E402

SMI = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active",
       "--format=csv,noheader,nounits", "-lms", "50"]


def run_sampled(fn, seconds=2.5):
    """µs per fn() and the nvidia-smi samples taken while fn runs back to back."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(SMI, stdout=subprocess.PIPE, text=True)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, calls = time.time(), 0
    a.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            fn()
        calls += 20
        torch.cuda.synchronize()
    b.record()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [r.split(", ") for r in smi.communicate()[0].strip().splitlines()[4:]]
    us = a.elapsed_time(b) * 1e3 / calls
    mhz = statistics.median(float(r[0]) for r in rows)
    watts = statistics.median(float(r[1]) for r in rows)
    return {"us": us, "sm_mhz": mhz, "watts": watts, "mj": watts * us * 1e-3,
            "temp_c": max(float(r[2]) for r in rows), "reasons": sorted({r[3] for r in rows})}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,16,64,256")
    ap.add_argument("--methods", default="kbit4,cublas-fp16,machete-g128")
    ap.add_argument("--model", default="llama3-8b", choices=list(bd.MODELS))
    ap.add_argument("--shapes", default=None, help="single GEMMs N x K instead of the decode step")
    ap.add_argument("--seconds", type=float, default=2.5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    from vllm_kbit import ops  # noqa: F401
    assert ops.HAS_CUDA_KERNELS, "vllm_kbit._C is not built"
    ms = [int(v) for v in args.ms.split(",")]
    limit = subprocess.run(["nvidia-smi", "--query-gpu=power.limit,clocks.max.sm", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True).stdout.strip()
    bg.log(f"# {torch.cuda.get_device_name()}, power limit / max SM clock: {limit}")
    results = []
    for method in args.methods.split(","):
        bits = int(method[4:].split("-")[0]) if method.startswith("kbit") else 4
        try:
            if args.shapes:
                work = [((n, k), [bd.make(method, n, k, bits)[0]]) for n, k in
                        (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))]
            else:
                n_layers, shapes = bd.MODELS[args.model]
                layers = [{name: bd.make(method, n, k, bits)[0] for name, (n, k) in shapes.items()}
                          for _ in range(n_layers)]
                work = [("step", [(layer[name], shapes[name][1]) for layer in layers for name in shapes])]
        except Exception as e:  # noqa: BLE001  (Machete without vLLM, ...)
            bg.log(f"# {method} unavailable: {type(e).__name__}: {e}")
            continue
        for what, calls in work:
            for m in ms:
                if what == "step":
                    xs = {k: torch.randn(m, k, dtype=bg.DT, device="cuda") for _, k in calls}
                    keep = bd.capture(calls, xs)
                    fn = keep.replay
                    label = f"{args.model} step"
                else:
                    x = torch.randn(m, what[1], dtype=bg.DT, device="cuda")
                    fn, keep, label = (lambda f=calls[0], x=x: f(x)), None, f"{what[0]}x{what[1]}"
                r = {"method": method, "what": label, "m": m, **run_sampled(fn, args.seconds)}
                del keep
                results.append(r)
                bg.log(f"{method:<14} {label:<16} M={m:<5} {r['us']:9.1f} us  {r['sm_mhz']:5.0f} MHz  "
                       f"{r['watts']:4.0f} W  {r['mj']:7.2f} mJ  {r['temp_c']:3.0f} C  {','.join(r['reasons'])}")
                time.sleep(1.0)  # let the clock recover between cases
    meta = {"gpu": torch.cuda.get_device_name(), "power_limit_w_max_mhz": limit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ"),
            "commit": os.environ.get("KBIT_GIT_COMMIT") or bg.git_commit(), "command": " ".join([sys.executable] + sys.argv),
            "torch": torch.__version__}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_power_{meta['date']}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    bg.log(f"# wrote {path}")


if __name__ == "__main__":
    main()
