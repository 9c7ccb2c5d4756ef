"""Is a GEMV faster when its weights are already in L2? 32 x [spin G us, GEMV] with 32 distinct
weight sets (cold) against one set (hot), and the line-prefetch kernel's own cost.
Probe, not landed (twenty-fourth session, H200, tree 4eb4c51): python3 docs/probes/l2_hot_cold_4eb4c51.py"""
import sys, statistics, torch
import importlib.util
spec = importlib.util.spec_from_file_location("l2pf", "docs/probes/l2_prefetch_gaps_4eb4c51.py")
m_ = importlib.util.module_from_spec(spec); spec.loader.exec_module(m_)
ext, gtime = m_.ext, m_.gtime
sys.path.insert(0, "benchmarks"); import bench_gemm as bg
import vllm_kbit.ops  # noqa
SH = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
for name, (n, k) in SH.items():
    ls = [bg.kbit_method(n, k, 4, 0)[0] for _ in range(32)]
    for m in (1, 16):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        G = 15000
        base = gtime(lambda: [ext.spin(G) for i in range(32)])
        cold = gtime(lambda: [(ext.spin(G), ls[i](x)) for i in range(32)])
        hot = gtime(lambda: [(ext.spin(G), ls[0](x)) for i in range(32)])
        pf = gtime(lambda: [(ext.pf(ls[i].tensors[0], 1 << 30, 1), ext.spin(G)) for i in range(32)])
        pfg = gtime(lambda: [(ext.pf(ls[i].tensors[0], 1 << 30, 1), ext.spin(G), ls[i](x)) for i in range(32)])
        pf0 = gtime(lambda: [(ext.pf(ls[i].tensors[0], 0, 1), ext.spin(G), ls[i](x)) for i in range(32)])
        print(f"HOTCOLD {name:8s} M={m:2d} cold {(cold-base)/32:6.2f} hot {(hot-base)/32:6.2f} us/kernel | "
              f"pf kernel alone {(pf-base)/32:5.2f} | pf+gemv {(pfg-base)/32:6.2f} vs empty-pf+gemv {(pf0-base)/32:6.2f}", flush=True)
    del ls; torch.cuda.empty_cache()
