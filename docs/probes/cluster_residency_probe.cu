// Are `n` clusters of `s` CTAs (one CTA per SM: 384 threads, ~220 KB dynamic smem) co-resident,
// as cudaOccupancyMaxActiveClusters says? Each CTA records its SM, start and end (globaltimer)
// and spins ~30 us; a second wave shows as CTAs starting after the first ones ended.
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
__device__ unsigned long long gtime() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__global__ void __launch_bounds__(384, 1) spin(unsigned long long* rec, int ns) {
  extern __shared__ unsigned char sm[];
  unsigned long long t0 = gtime();
  sm[threadIdx.x] = 1;
  while (gtime() - t0 < (unsigned long long)ns) {}
  if (threadIdx.x == 0) {
    unsigned smid; asm volatile("mov.u32 %0, %smid;" : "=r"(smid));
    rec[3 * blockIdx.x] = smid; rec[3 * blockIdx.x + 1] = t0; rec[3 * blockIdx.x + 2] = gtime();
  }
}
int main() {
  int smem = 220 * 1024, sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaFuncSetAttribute(spin, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(spin, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  unsigned long long* rec; cudaMalloc(&rec, 3 * 8 * 1024);
  std::printf("SMs %d\n s  api_max  launched_ctas  waves(start>first_end)  span_us\n", sms);
  for (int s = 1; s <= 16; ++s) {
    cudaLaunchConfig_t cfg = {}; cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension; at[0].val.clusterDim.x = s; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(384); cfg.dynamicSmemBytes = smem; cfg.attrs = at; cfg.numAttrs = 1;
    int maxc = 0;
    cfg.gridDim = dim3(s);
    cudaError_t e = cudaOccupancyMaxActiveClusters(&maxc, (void*)spin, &cfg);
    if (e != cudaSuccess) { std::printf("%2d  occupancy error %s\n", s, cudaGetErrorString(e)); cudaGetLastError(); continue; }
    for (int extra = 0; extra <= 1; ++extra) {
      int n = maxc + extra;  // the API's count, then one cluster more (must make a second wave)
      cfg.gridDim = dim3(n * s);
      cudaMemset(rec, 0, 3 * 8 * 1024);
      e = cudaLaunchKernelEx(&cfg, spin, rec, 30000);
      cudaDeviceSynchronize();
      if (e != cudaSuccess) { std::printf("%2d launch error %s\n", s, cudaGetErrorString(e)); cudaGetLastError(); break; }
      std::vector<unsigned long long> h(3 * n * s);
      cudaMemcpy(h.data(), rec, 8 * h.size(), cudaMemcpyDeviceToHost);
      unsigned long long first_end = ~0ull, t_min = ~0ull, t_max = 0; int late = 0;
      for (int i = 0; i < n * s; ++i) { first_end = std::min(first_end, h[3 * i + 2]); t_min = std::min(t_min, h[3 * i + 1]); t_max = std::max(t_max, h[3 * i + 2]); }
      for (int i = 0; i < n * s; ++i) late += h[3 * i + 1] >= first_end;
      std::printf("%2d  %4d  %5d  late_ctas=%d  span=%.1f us\n", s, maxc, n * s, late, (t_max - t_min) / 1e3);
    }
  }
  return 0;
}
