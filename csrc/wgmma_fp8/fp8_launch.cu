// Host entry points of the FP8-activation kbit GEMM (declared in wgmma_fp8/fp8_launch.h): what
// this build and device support, the tile choice, the activation quantizer's launch, and the
// dispatch on bits to the per-bit-width instantiations (wgmma_fp8/instantiations/fp8_k<BITS>.cu).
#include <cuda_runtime.h>

#include "wgmma_fp8/fp8_kernel.cuh"
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

int max_weight_exp() { return kMaxWeightExp; }
int min_weight_exp() { return kMinWeightExp; }

// 256 tokens (the tall CTA, one per SM) where its CTAs fill the SMs; else 128 (two per SM)
// where those fill them; else 64.
int choose_tile_m(int m, int n, int num_sms) {
  const long long groups = div_up(n_units(n), 2);
  if ((long long)div_up(m, 256) * groups >= num_sms) return 256;
  return (long long)div_up(m, 128) * groups < num_sms ? 64 : 128;
}

cudaError_t launch_quantize_act(OutType dtype, const void* x, uint8_t* xq, float* scale, int m, int k, int bits,
                                cudaStream_t stream) {
  if (m < 1 || k < 32 || k % 32 != 0 || bits < 2 || bits > 5) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(x) & 15) || (reinterpret_cast<uintptr_t>(xq) & 15)) return cudaErrorInvalidValue;
  if (!quantize_supported()) return cudaErrorNotSupported;
  const bool crumb = bits == 2;  // the k order depends only on K=2's crumb pairs vs the nibble pairs
  if (dtype == OutType::kHalf) {
    if (crumb) quantize_act_kernel<__half, 2><<<m, 256, 0, stream>>>(static_cast<const __half*>(x), xq, scale, k);
    else quantize_act_kernel<__half, 4><<<m, 256, 0, stream>>>(static_cast<const __half*>(x), xq, scale, k);
  } else {
    if (crumb) quantize_act_kernel<__nv_bfloat16, 2><<<m, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), xq, scale, k);
    else quantize_act_kernel<__nv_bfloat16, 4><<<m, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), xq, scale, k);
  }
  return cudaGetLastError();
}

cudaError_t launch_gemm(const GemmArgs& a, int tile_m, int num_sms, cudaStream_t stream) {
  if (a.m < 1 || a.n < 1 || a.k < 32 || a.k % 32 != 0 || a.bits < 2 || a.bits > 5) return cudaErrorInvalidValue;
  if (a.w_exp > kMaxWeightExp || a.w_exp < kMinWeightExp) return cudaErrorInvalidValue;
  if (tile_m != 0 && tile_m != 64 && tile_m != 128 && tile_m != 256) return cudaErrorInvalidValue;
  const auto misaligned = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) != 0; };
  if (misaligned(a.xq) || misaligned(a.packed) || misaligned(a.absmax)) return cudaErrorInvalidValue;
  if (!gemm_supported()) return cudaErrorNotSupported;
  const int mt = tile_m != 0 ? tile_m : choose_tile_m(a.m, a.n, num_sms > 0 ? num_sms : 1);
  switch (a.bits) {
    case 2: return detail::launch_bits<2>(a, mt, stream);
    case 3: return detail::launch_bits<3>(a, mt, stream);
    case 4: return detail::launch_bits<4>(a, mt, stream);
    default: return detail::launch_bits<5>(a, mt, stream);
  }
}

}  // namespace fp8
}  // namespace kbit
