"""256-token wgmma tiles forced with each split s along K (plan override wgmma.tile_m=256, splits forced)
beside the plan's own pick, K=4 fp16, L2 flushed (bench_gemm.Timer), rounds alternated. The sweep
the tall-split cost in csrc/dispatch/wgmma_plan.h (choose_tall) was fitted to; tests/test_wgmma_plan.py
replays the plan on its output. Tuning only: prints one line per case and writes a JSON.

  python3 benchmarks/tall_split_sweep.py OUT.json   # env SHAPES, MS, SPLITS, ROUNDS override
"""
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import Timer, git_commit, kbit_method  # noqa: E402
from vllm_kbit import ops  # noqa: E402  (loads the kernels)

SHAPES = "4096x4096,6144x4096,4096x14336,8192x8192,10240x8192,8192x28672,28672x4096,57344x8192"
WGMMA, BITS = ops.Path.WGMMA, 4


def main(out):
    shapes = [tuple(map(int, s.split("x"))) for s in os.environ.get("SHAPES", SHAPES).split(",")]
    ms = [int(v) for v in os.environ.get("MS", "192,256,320,384,512,768,1000").split(",")]
    splits = [int(v) for v in os.environ.get("SPLITS", "1,2,3,4,6,8").split(",")]
    rounds = int(os.environ.get("ROUNDS", "2"))
    timer, res = Timer(), {}
    for n, k in shapes:
        run, _ = kbit_method(n, k, BITS, WGMMA, 0)
        for m in ms:
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            plan = ops.wgmma_plan(m, n, k, BITS, torch.float16)
            res[(n, k, m, "planinfo")] = [plan.tile_m, plan.splits, plan.groups]  # (tests/test_wgmma_plan.py reads 0, 1)
            for _ in range(rounds):
                res.setdefault((n, k, m, "plan"), []).append(timer(lambda: run(x, WGMMA, 0)))
                for s in splits:
                    res.setdefault((n, k, m, f"t{s}"), []).append(timer(lambda: run(x, WGMMA, s, "wgmma.tile_m=256")))
            row = {c: statistics.mean(res[(n, k, m, c)]) for c in ["plan"] + [f"t{s}" for s in splits]}
            pl = res[(n, k, m, "planinfo")]
            print(f"{n}x{k} M={m} plan(tile {pl[0]} s{pl[1]} g{pl[2]})={row['plan']:.1f} "
                  + " ".join(f"{c}={v:.1f}" for c, v in row.items() if c != "plan"), flush=True)
        del run
        torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(0), "commit": git_commit(), "bits": BITS, "dtype": "fp16",
            "rounds": rounds, "command": " ".join(["python3"] + sys.argv)}
    with open(out, "w") as f:
        json.dump({"meta": meta, "results": [{"n": n, "k": k, "m": m, "config": c, "us": v}
                                              for (n, k, m, c), v in res.items()]}, f, indent=0)


if __name__ == "__main__":
    main(sys.argv[1])
