// Host entry points of the FP8-activation kbit GEMM (declared in wgmma_fp8/fp8_launch.h): what
// this build and device support, the activation quantizer's launch, and the launch of the kernel
// a key names (fp8_kernels.h, generated: the instantiations are
// wgmma_fp8/instantiations/fp8_k<BITS>.cu).
#include <cuda_runtime.h>

#include "wgmma_fp8/fp8_kernel.cuh"
#include "wgmma_fp8/fp8_kernels.h"
#include "wgmma_fp8/fp8_launch.h"

namespace kbit {
namespace fp8 {

namespace {
int device_cc() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return 10 * major + minor;
}
}  // namespace

bool gemm_supported() {
#ifdef KBIT_HAS_SM90A
  return device_cc() == 90;
#else
  return false;
#endif
}

// The quantizer's sm_89+ code is in the build where the GEMM's is (this build's 9.0a target);
// every other device runs the reference.
bool quantize_supported() { return gemm_supported(); }

template <typename T>
cudaError_t launch_quantizer(int order, const T* x, uint8_t* xq, float* scale, int m, int k, cudaStream_t stream) {
  if (order == 0) quantize_act_kernel<T, 0><<<m, 256, 0, stream>>>(x, xq, scale, k);
  else if (order == 2) quantize_act_kernel<T, 2><<<m, 256, 0, stream>>>(x, xq, scale, k);
  else quantize_act_kernel<T, 4><<<m, 256, 0, stream>>>(x, xq, scale, k);
  return cudaGetLastError();
}

int max_weight_exp() { return kMaxWeightExp; }
int min_weight_exp() { return kMinWeightExp; }

cudaError_t launch_quantize_act(DType dtype, const void* x, uint8_t* xq, float* scale, int m, int k, int bits,
                                cudaStream_t stream) {
  if (m < 1 || k < 32 || k % 32 != 0 || (bits != 0 && (bits < 2 || bits > 5))) return cudaErrorInvalidValue;
  if (dtype != DType::kHalf && dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(x) & 15) || (reinterpret_cast<uintptr_t>(xq) & 15)) return cudaErrorInvalidValue;
  if (!quantize_supported()) return cudaErrorNotSupported;
  // the k order depends only on K=2's crumb pairs vs the nibble pairs (0: natural order)
  const int order = bits == 0 ? 0 : bits == 2 ? 2 : 4;
  if (dtype == DType::kHalf) return launch_quantizer<__half>(order, static_cast<const __half*>(x), xq, scale, m, k, stream);
  return launch_quantizer<__nv_bfloat16>(order, static_cast<const __nv_bfloat16*>(x), xq, scale, m, k, stream);
}

cudaError_t launch_gemm(const Fp8Key& key, const GemmArgs& a, cudaStream_t stream) {
  if (a.m < 1 || a.n < 1 || a.k < 32 || a.k % 32 != 0 || a.bits < 2 || a.bits > 5) return cudaErrorInvalidValue;
  if (a.w_exp > kMaxWeightExp || a.w_exp < kMinWeightExp) return cudaErrorInvalidValue;
  if (key.bits != a.bits || key.dtype != a.dtype) return cudaErrorInvalidValue;
  const auto misaligned = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) != 0; };
  if (misaligned(a.xq) || misaligned(a.packed) || misaligned(a.absmax)) return cudaErrorInvalidValue;
  if (!gemm_supported()) return cudaErrorNotSupported;
  const Fp8Kernel* kernel = select_kernel(key);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  Params p;
  p.x_scale = a.x_scale; p.packed = a.packed; p.absmax = a.absmax; p.codebook = a.codebook;
  p.bias = a.bias; p.y = a.y;
  p.m = a.m; p.n = a.n; p.k = a.k; p.ku_count = k_units(a.k); p.w_exp = a.w_exp;
  return kernel->launch(p, a.xq, stream);
}

}  // namespace fp8
}  // namespace kbit
