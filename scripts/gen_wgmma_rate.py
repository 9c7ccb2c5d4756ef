"""Writes /tmp/wgmma_rate.cu: a microbenchmark of wgmma issue rate (no loads, no decode):
every CTA (one per SM) runs WG warpgroups, each looping over groups of 4 wgmma m64nNk16
(fp16, fp32 accumulate) into one accumulator set, commit, wait_group 1; A from registers (RS)
or shared memory (SS). Prints clocks per wgmma per SM against the 2048 MAC/clk/SM peak."""
import sys


def wg_asm(n, rs):
    nacc = n // 2
    outs = ", ".join(f"%{i}" for i in range(nacc))
    if rs:
        a = "{" + ", ".join(f"%{nacc + i}" for i in range(4)) + "}"
        b = f"%{nacc + 4}"
        ins = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db)'
        tail = ", 1, 1, 1, 0"
    else:
        a = f"%{nacc}"
        b = f"%{nacc + 1}"
        ins = '"l"(da), "l"(db)'
        tail = ", 1, 1, 1, 0, 0"
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(nacc))
    return (f'asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{outs}}}, {a}, {b}{tail};" '
            f': {cons} : {ins});')


src = r'''
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
__device__ __forceinline__ uint64_t desc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
// one wgmma m64nNk16, A from registers (RS = 1: a) or shared memory (RS = 0: da)
template <int N, int RS>
__device__ void mma(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t da, uint64_t db);
'''
for n in (128, 256):
    for rs in (1, 0):
        src += f'''
template <> __device__ __forceinline__ void mma<{n}, {rs}>(float (&d)[{n // 2}], const uint32_t (&a)[4], uint64_t da, uint64_t db) {{
  {wg_asm(n, rs)}
}}
'''
src += r'''
template <int N, int RS>
__global__ void __launch_bounds__(N == 256 ? 256 : 384, 1) rate(int iters, float* out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t base = (uint32_t(__cvta_generic_to_shared(smem)) + 1023u) & ~1023u;
  for (int i = threadIdx.x; i < 48 * 1024 / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(smem)[i] = 0x3c003c00u * (i & 1);
  __syncthreads();
  float d[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  uint32_t a[4] = {0x3c003c00u ^ threadIdx.x, 0x3c003c00u, 0x3c003c00u, threadIdx.x};
  const uint64_t da = desc(base), db = desc(base + 16384);
  for (int it = 0; it < iters; ++it) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int s = 0; s < 4; ++s) mma<N, RS>(d, a, da + 2 * s, db + 2 * s);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[i])::"memory");
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += d[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <int N, int RS> void run(int wgs, int sms, float* out) {
  const int iters = 2000;
  cudaFuncSetAttribute(rate<N, RS>, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024);
  rate<N, RS><<<sms, 128 * wgs, 100 * 1024>>>(10, out);
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  cudaEventRecord(a);
  rate<N, RS><<<sms, 128 * wgs, 100 * 1024>>>(iters, out);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, a, b);
  const double wgmmas_per_sm = double(iters) * 4 * wgs;
  const double macs = wgmmas_per_sm * 64.0 * N * 16 * sms;
  printf("N=%d %s WGs=%d: %.3f ms, %.1f TFLOPS, %.1f ns per wgmma per SM (%s)\n", N, RS ? "RS" : "SS", wgs, ms,
         2 * macs / (ms * 1e-3) / 1e12, ms * 1e6 / wgmmas_per_sm, cudaGetErrorString(cudaGetLastError()));
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out;
  cudaMalloc(&out, sms * 384 * sizeof(float));
  for (int wgs = 1; wgs <= 3; ++wgs) {
    run<128, 1>(wgs, sms, out);
    run<128, 0>(wgs, sms, out);
    if (wgs <= 2) { run<256, 1>(wgs, sms, out); run<256, 0>(wgs, sms, out); }
  }
  return 0;
}
'''
open(sys.argv[1] if len(sys.argv) > 1 else "/tmp/wgmma_rate.cu", "w").write(src)
