"""Does prefetching the next linear layer's kbit weights into L2, while vLLM's non-GEMM kernels
run, pay? A CUDA graph of 32 Llama-3-8B layers: qkv, gap_attn, o, gap, gate_up, gap, down, gap,
where the gaps are spin kernels (no DRAM traffic) of vLLM's measured bs=16 lengths, optionally
with a DRAM read standing for attention's KV traffic. Variants launch a prefetch kernel after a
GEMM for (part of) the next GEMM's weights.
Probe, not landed (twenty-fourth session, H200, tree 4eb4c51). Run from the repo root with the
extension built:  python3 docs/probes/l2_prefetch_gaps_4eb4c51.py
(docs/probes/l2_hot_cold_4eb4c51.py imports its extension and timer.)"""
import os, sys, statistics, torch
sys.path.insert(0, "benchmarks")
import bench_gemm as bg
from torch.utils.cpp_extension import load_inline
src = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
__global__ void pf_bulk_k(const char* p, long long bytes, int chunk) {
  long long n = (bytes + chunk - 1) / chunk;
  for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < n; c += (long long)gridDim.x * blockDim.x) {
    long long off = c * chunk; unsigned sz = (unsigned)min((long long)chunk, bytes - off) & ~15u;
    if (sz) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + off), "r"(sz) : "memory");
  }
}
__global__ void pf_line_k(const char* p, long long bytes, int evl) {
  for (long long off = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * 128; off < bytes; off += (long long)gridDim.x * blockDim.x * 128) {
    if (evl) asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(p + off));
    else asm volatile("prefetch.global.L2 [%0];" :: "l"(p + off));
  }
}
__global__ void spin_k(long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)ns);
}
__global__ void read_k(const int4* p, long long n, int* sink) {
  int acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    int4 v = __ldcs(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  if (acc == 0x12345678) sink[0] = acc;
}
void pf(torch::Tensor t, long long bytes, long long mode) {
  auto s = at::cuda::getCurrentCUDAStream();
  bytes = std::min<long long>(bytes, t.numel() * t.element_size());
  if (mode == 0) pf_bulk_k<<<132, 128, 0, s>>>((const char*)t.data_ptr(), bytes, 16384);
  else pf_line_k<<<132, 256, 0, s>>>((const char*)t.data_ptr(), bytes, mode == 2);
}
void spin(long long ns) { spin_k<<<132, 32, 0, at::cuda::getCurrentCUDAStream()>>>(ns); }
void readk(torch::Tensor t, torch::Tensor sink) {
  read_k<<<528, 256, 0, at::cuda::getCurrentCUDAStream()>>>((const int4*)t.data_ptr(), t.numel() * t.element_size() / 16, (int*)sink.data_ptr()); }
"""
ext = load_inline("l2pf", cpp_sources="void pf(torch::Tensor t, long long bytes, long long mode); void spin(long long ns); void readk(torch::Tensor t, torch::Tensor sink);",
                  cuda_sources=src, functions=["pf", "spin", "readk"], extra_cuda_cflags=["-arch=sm_90a", "-O3"], verbose=False)
def gtime(fn, reps=30):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


if __name__ == "__main__":
    import vllm_kbit.ops  # noqa
    SH = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    L = 32
    layers = []
    for _ in range(L):
        layers.append({k: bg.kbit_method(n, kk, 4, 0) for k, (n, kk) in SH.items()})
    kv = [torch.empty(17 << 20, dtype=torch.uint8, device="cuda") for _ in range(L)]
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    MB = 1 << 20

    def packed(run):
        return run[0].tensors[0]

    def step(m, gemm=True, pfs=None, mode=0, kvread=False, gaps=(15000, 2000, 1600, 2000)):
        x4, x14 = (torch.randn(m, 4096, dtype=torch.bfloat16, device="cuda"), torch.randn(m, 14336, dtype=torch.bfloat16, device="cuda"))
        pfs = pfs or {}
        def fn():
            for i, l in enumerate(layers):
                nxt = layers[(i + 1) % L]
                if gemm: l["qkv"][0](x4)
                if "o" in pfs: ext.pf(packed(l["o"]), pfs["o"], mode)
                if kvread: ext.readk(kv[i], sink)
                ext.spin(gaps[0] - (4000 if kvread else 0))
                if gemm: l["o"][0](x4)
                if "gate_up" in pfs: ext.pf(packed(l["gate_up"]), pfs["gate_up"], mode)
                ext.spin(gaps[1])
                if gemm: l["gate_up"][0](x4)
                if "down" in pfs: ext.pf(packed(l["down"]), pfs["down"], mode)
                ext.spin(gaps[2])
                if gemm: l["down"][0](x14)
                if "qkv" in pfs: ext.pf(packed(nxt["qkv"]), pfs["qkv"], mode)
                ext.spin(gaps[3])
        return gtime(fn)

    for m in (1, 16):
        for kvread in (False, True):
            base_gaps = step(m, gemm=False, kvread=kvread)
            rows = [("no prefetch", {}, 0)]
            rows += [("o all, bulk", {"o": 64 * MB}, 0), ("o all, line", {"o": 64 * MB}, 1), ("o all, line evict_last", {"o": 64 * MB}, 2)]
            rows += [("o all + gate_up 8MB + down 6MB + qkv 8MB, bulk", {"o": 64 * MB, "gate_up": 8 * MB, "down": 6 * MB, "qkv": 8 * MB}, 0)]
            rows += [("o all + gate_up 16MB, bulk", {"o": 64 * MB, "gate_up": 16 * MB}, 0)]
            rows += [("o all + gate_up 24MB + down 12MB + qkv all, bulk", {"o": 64 * MB, "gate_up": 24 * MB, "down": 12 * MB, "qkv": 64 * MB}, 0)]
            rows += [("pf kernels, 0 bytes", {"o": 0, "gate_up": 0, "down": 0, "qkv": 0}, 0)]
            for name, pfs, mode in rows:
                t = step(m, pfs=pfs, mode=mode, kvread=kvread)
                print(f"L2PF M={m:2d} kv={int(kvread)} {name:<50s} step {t:8.1f} us  gemm-in-context {t - base_gaps:7.1f} us  (gaps alone {base_gaps:.1f})", flush=True)
