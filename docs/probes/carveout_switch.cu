// Does a kernel with a large dynamic shared memory pay an SM reconfiguration after a kernel
// that uses none (the L1 / shared carveout switch)? CUDA graph of 128 pairs, median of 20.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

__global__ void elem(__half* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = __hmul(x[i], __float2half(1.0f));
}
__global__ void elem_b(__half* x, int n) {  // same, its own function for per-function attributes
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = __hmul(x[i], __float2half(1.0f));
}
__global__ void big(float* out, int iters) {
  extern __shared__ float sm[];
  sm[threadIdx.x] = threadIdx.x;
  __syncthreads();
  float a = sm[(threadIdx.x + 1) % blockDim.x];
  for (int i = 0; i < iters; ++i) a = a * 0.999f + 1.0f;
  if (a == -1.f) out[blockIdx.x] = a;
}

struct Case { const char* name; int smem; int elems; int bigs; bool elem_b; };

int main() {
  int n = 16 * 4096;
  __half* x; float* out;
  CK(cudaMalloc(&x, n * 2)); CK(cudaMalloc(&out, 1024 * 4)); CK(cudaMemset(x, 0, n * 2));
  CK(cudaFuncSetAttribute(big, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  CK(cudaFuncSetAttribute(elem_b, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int iters = 2000;  // ~2-3 us of work per CTA
  std::vector<Case> cases = {
    {"elem only", 0, 1, 0, false},
    {"big(2K) only", 2048, 0, 1, false},
    {"big(200K) only", 200 * 1024, 0, 1, false},
    {"elem + big(2K)", 2048, 1, 1, false},
    {"elem + big(16K)", 16 * 1024, 1, 1, false},
    {"elem + big(64K)", 64 * 1024, 1, 1, false},
    {"elem + big(128K)", 128 * 1024, 1, 1, false},
    {"elem + big(200K)", 200 * 1024, 1, 1, false},
    {"elem + big(227K)", 227 * 1024, 1, 1, false},
    {"elemB(carve100) + big(2K)", 2048, 1, 1, true},
    {"elemB(carve100) + big(200K)", 200 * 1024, 1, 1, true},
    {"elemB(carve100) + big(227K)", 227 * 1024, 1, 1, true},
  };
  for (int pass = 0; pass < 2; ++pass) {
    printf("== pass %d%s\n", pass, pass ? " (cudaDeviceSetCacheConfig PreferShared)" : "");
    if (pass == 1) CK(cudaDeviceSetCacheConfig(cudaFuncCachePreferShared));
    for (auto& c : cases) {
      cudaGraph_t g; cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      for (int r = 0; r < 128; ++r) {
        for (int e = 0; e < c.elems; ++e) {
          if (c.elem_b) elem_b<<<(n + 255) / 256, 256, 0, s>>>(x, n);
          else elem<<<(n + 255) / 256, 256, 0, s>>>(x, n);
        }
        for (int b = 0; b < c.bigs; ++b) big<<<132, 512, c.smem, s>>>(out, iters);
      }
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      CK(cudaGraphLaunch(ge, s)); CK(cudaStreamSynchronize(s));
      std::vector<float> ts;
      cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
      for (int rep = 0; rep < 21; ++rep) {
        CK(cudaEventRecord(a, s)); CK(cudaGraphLaunch(ge, s)); CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float ms; CK(cudaEventElapsedTime(&ms, a, b)); ts.push_back(ms * 1000.f / 128.f);
      }
      std::sort(ts.begin(), ts.end());
      printf("%-32s %8.3f us per iteration\n", c.name, ts[ts.size() / 2]);
      CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
    }
  }
  return 0;
}
