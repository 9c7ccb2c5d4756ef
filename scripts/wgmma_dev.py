"""Probe variants of the wgmma kernel (csrc/kbit_wgmma.cuh) without the torch extension: each
variant is a -D flag set (KBIT_WG_DEV_*: NODECODE, NOREGROUP, NOMMA, NOX, XHALF, NOSYNC, STAGES=n, LUTREP=n, WATCHDOG;
NOPRODUCER, NOWIDELUT: the kernel before the producer warpgroup and the wide table at MT = 128),
built with nvcc into its own shared library (in parallel) and timed through ctypes in fp16 at
K = WGDEV_BITS (default 4), L2 flushed, median. Answers "where does the time go" in one device call. Every variant
sees the same seeded inputs, and its outputs are compared with the first variant's (the
"maxdiff" column: max |y - y_first| / max |y_first|; probes that skip work differ by design).
usage: python3 scripts/wgmma_dev.py VARIANT [VARIANT ...]   (VARIANT: comma list of flags, "base" = none)
env: WGDEV_SHAPES="57344x8192,4096x14336", WGDEV_MS="64,128", WGDEV_SPLITS="0,4,8" (forced split
factors beside the plan's own, 0; columns VARIANT@sN), WGDEV_ONLY="57344x8192:64" (one case, for ncu),
WGDEV_ROUNDS=2 (every variant's process run twice, alternated: values "round 1 / round 2", and the
ratio of each variant's mean to the first's), WGDEV_STEADY=1 (back to back for 1.5 s, no flush, as
a GPU at its power cap runs them: benchmarks/bench_power.py's sampling, "us@MHz"; shapes should
exceed the 50 MB L2), WGDEV_BITS=5 (the bit width built and timed; one per call), WGDEV_JSON=PATH (the table and the
command, GPU, date and commit as JSON: a results file)
"""
import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(57344, 8192), (8192, 28672), (4096, 4096)]
MS = [16, 64, 128]
if os.environ.get("WGDEV_SHAPES"):  # e.g. "57344x8192,4096x14336"
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["WGDEV_SHAPES"].split(",")]
if os.environ.get("WGDEV_MS"):  # e.g. "64,128,256"
    MS = [int(v) for v in os.environ["WGDEV_MS"].split(",")]
# forced split factors timed beside the plan's own (0), e.g. "0,4,8": columns VARIANT@sN
SPLITS = [int(v) for v in os.environ.get("WGDEV_SPLITS", "0").split(",")]
STEADY = os.environ.get("WGDEV_STEADY", "0") == "1"
BITS = int(os.environ.get("WGDEV_BITS", "4"))
ROUNDS = int(os.environ.get("WGDEV_ROUNDS", "1"))
UNITS = "us@MHz per call, back to back for 1.5 s, no flush" if STEADY else "us per call, L2 flushed, median of 30"
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # bench_power (WGDEV_STEADY), bench_gemm (WGDEV_JSON)
if STEADY:
    import bench_power  # noqa: E402
if os.environ.get("WGDEV_ONLY"):  # e.g. "57344x8192:64" (one case, for ncu)
    _s, _m = os.environ["WGDEV_ONLY"].split(":")
    SHAPES, MS = [tuple(int(v) for v in _s.split("x"))], [int(_m)]


def build(variant):
    # "OLD" / "OLD,FLAG..": the tree in $WGDEV_OLD_TREE (a copy of an earlier csrc/ and scripts/wgmma_capi.cu)
    root = ROOT
    if variant.split(",")[0] == "OLD":
        root = os.environ.get("WGDEV_OLD_TREE", os.path.join(ROOT, "scripts/old_tree"))
    fl = [f for f in variant.split(",") if f not in ("base", "OLD")]
    flags = [f"-DKBIT_WG_DEV_{f}" for f in fl]
    out = f"/tmp/wgdev/k{BITS}_{variant.replace(',', '_').replace('=', '')}"
    os.makedirs(out, exist_ok=True)
    common = ["nvcc", "-gencode", "arch=compute_90a,code=sm_90a", "-DKBIT_HAS_SM90A", "-O3", "-std=c++17",
              "--use_fast_math", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", "-Icsrc", *flags]
    objs = []
    for src in ("csrc/kbit_wgmma.cu", f"csrc/generated/wgmma_k{BITS}.cu", "scripts/wgmma_capi.cu"):
        o = os.path.join(out, os.path.basename(src) + ".o")
        r = subprocess.run([*common, "-c", src, "-o", o], cwd=root, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{variant}: {src}: {r.stderr[-2000:]}")
        objs.append(o)
    lib = os.path.join(out, "lib.so")
    subprocess.run(["nvcc", "-shared", "-gencode", "arch=compute_90a,code=sm_90a", *objs, "-o", lib], check=True)
    return variant, lib


def timer(fn, reps=30):
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in evs:
        flush.zero_()
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in evs)


def measure(variant, lib):
    """Times one variant (its own process: one static CUDA runtime per library)."""
    sys.path.insert(0, ROOT)
    from vllm_kbit import format as kf
    f = ctypes.CDLL(lib, mode=os.RTLD_LAZY).kbit_wgmma_c  # only K = BITS is linked
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cb = kf.normal_float_codebook(BITS, "cuda")
    out_dir = os.path.dirname(lib)
    for n, k in SHAPES:
        torch.manual_seed(n * 7 + k)
        packed = torch.randint(-2**31, 2**31 - 1, ((n + 63) // 64 * (k // 64) * BITS * 128,), device="cuda", dtype=torch.int32)
        ap = torch.randint(0x30, 0x90, ((n + 63) // 64 * (k // 64) * 128,), device="cuda", dtype=torch.int32).to(torch.uint8)
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            y = torch.empty(m, n, device="cuda", dtype=torch.float16)
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            for sp in SPLITS:
                call = lambda: f(0, ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(packed.data_ptr()),  # noqa: E731
                                 ctypes.c_void_p(ap.data_ptr()), ctypes.c_void_p(cb.data_ptr()),
                                 ctypes.c_void_p(y.data_ptr()), m, n, k, BITS, sms, stream, sp)
                y.fill_(float("nan"))
                rc = call()
                torch.cuda.synchronize()
                tag = "" if sp == 0 else f"@s{sp}"
                torch.save(y.float().cpu(), os.path.join(out_dir, f"y_{n}x{k}_{m}{tag}.pt"))
                if rc:
                    t = f"rc={rc}"
                elif STEADY:
                    r = bench_power.run_sampled(call, 1.5)
                    t = f"{r['us']:.1f}@{r['sm_mhz']:.0f}"
                    time.sleep(0.5)  # the clock recovers between cases
                else:
                    t = f"{timer(call):.1f}"
                print(f"RESULT {n}x{k} M={m} {variant}{tag} {t}", flush=True)


def main():
    if sys.argv[1] == "--one":
        measure(sys.argv[2], sys.argv[3])
        return
    if sys.argv[1] == "--build":  # build only, print the library paths
        for v in sys.argv[2:]:
            print(build(v)[1])
        return
    variants = sys.argv[1:] or ["base"]
    with ThreadPoolExecutor(len(variants)) as ex:
        libs = dict(ex.map(build, variants))
    table, columns = {}, {}
    first = None
    for v, lib in [item for _ in range(ROUNDS) for item in libs.items()]:
        try:  # a variant that hangs (a broken hand-off) must not take the whole call with it
            r = subprocess.run([sys.executable, __file__, "--one", v, lib], capture_output=True, text=True,
                               timeout=float(os.environ.get("WGDEV_TIMEOUT", "90")))
        except subprocess.TimeoutExpired as e:
            print(f"{v}: timed out\n{str(e.stdout)[-600:]}", flush=True)
            continue
        if r.returncode:
            print(f"{v}: failed\n{r.stderr[-1500:]}", flush=True)
        for line in r.stdout.splitlines():
            if line.startswith("RESULT "):
                _, shape, m, var, t = line.split()
                table.setdefault(f"{shape} {m}", {}).setdefault(var, []).append(t)
                columns.setdefault(var, None)
        first = first or lib
        diffs = []
        for f in sorted(os.listdir(os.path.dirname(lib))):
            if f.startswith("y_"):
                a = torch.load(os.path.join(os.path.dirname(first), f))
                b = torch.load(os.path.join(os.path.dirname(lib), f))
                diffs.append(((a - b).abs().max() / a.abs().max()).item())
        worst = float("nan") if not diffs or any(d != d for d in diffs) else max(diffs)  # NaN: unwritten output
        print(f"{v}: maxdiff {worst:.2e}", flush=True)
    print(f"{UNITS} (K={BITS} fp16)")
    cols = list(columns)
    print(f"{'shape M':<20}" + "".join(f"{v:>{12 * ROUNDS + 10}}" for v in cols)
          + ("   mean / first's" if ROUNDS > 1 and len(cols) > 1 else ""))

    def mean_us(vals):
        us = [float(t.split("@")[0]) for t in vals if not t.startswith("rc=")]
        return sum(us) / len(us) if us else float("nan")
    for key, row in table.items():
        ratios = ""
        if ROUNDS > 1 and len(cols) > 1:
            ratios = "   " + " ".join(f"{v}:{mean_us(row.get(v, [])) / mean_us(row.get(cols[0], [])):.3f}" for v in cols[1:])
        print(f"{key:<20}" + "".join(f"{' / '.join(row.get(v, ['-'])):>{12 * ROUNDS + 10}}" for v in cols) + ratios)
    if os.environ.get("WGDEV_JSON"):
        from bench_gemm import git_commit  # noqa: E402
        knobs = {k: v for k, v in os.environ.items() if k.startswith(("WGDEV_", "KBIT_")) and k != "WGDEV_JSON"}
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit(),
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ"),
                "command": " ".join(f"{k}={v}" for k, v in sorted(knobs.items())) + " python3 scripts/wgmma_dev.py "
                + " ".join(sys.argv[1:]),
                "units": UNITS,
                "bits": BITS, "dtype": "fp16", "variants": cols}
        with open(os.environ["WGDEV_JSON"], "w") as f:
            json.dump({"meta": meta, "results": table}, f, indent=1)


if __name__ == "__main__":
    main()
