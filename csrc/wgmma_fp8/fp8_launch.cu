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

// 128 tokens x 256 columns (the wide CTA, one per SM) where those CTAs fill the SMs: the x
// tile serves twice the columns, and the shared-memory fills from L2 are what bound the 128 x 128
// tile at large M. Else 128 x 128 (two per SM) where those fill them, else 64 x 128.
Tile choose_tile(int m, int n, int num_sms) {
  const long long groups128 = div_up(n_units(n), 2), groups256 = div_up(n_units(n), 4);
  if ((long long)div_up(m, 128) * groups256 >= num_sms) return {128, 256};
  if ((long long)div_up(m, 128) * groups128 >= num_sms) return {128, 128};
  return {64, 128};
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

cudaError_t launch_gemm(const GemmArgs& a, int tile_m, int tile_n, int num_sms, cudaStream_t stream) {
  if (a.m < 1 || a.n < 1 || a.k < 32 || a.k % 32 != 0 || a.bits < 2 || a.bits > 5) return cudaErrorInvalidValue;
  if (a.w_exp > kMaxWeightExp || a.w_exp < kMinWeightExp) return cudaErrorInvalidValue;
  Tile tile = {tile_m, tile_n};
  if (tile_m == 0 && tile_n == 0) {
    tile = choose_tile(a.m, a.n, num_sms > 0 ? num_sms : 1);
  } else {
    if (tile.m == 0) tile.m = 128;
    if (tile.n == 0) tile.n = 128;
    const bool ok = (tile.n == 128 && (tile.m == 64 || tile.m == 128 || tile.m == 256)) || (tile.n == 256 && tile.m == 128);
    if (!ok) return cudaErrorInvalidValue;
  }
  const auto misaligned = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) != 0; };
  if (misaligned(a.xq) || misaligned(a.packed) || misaligned(a.absmax)) return cudaErrorInvalidValue;
  if (!gemm_supported()) return cudaErrorNotSupported;
  switch (a.bits) {
    case 2: return detail::launch_bits<2>(a, tile.m, tile.n, stream);
    case 3: return detail::launch_bits<3>(a, tile.m, tile.n, stream);
    case 4: return detail::launch_bits<4>(a, tile.m, tile.n, stream);
    default: return detail::launch_bits<5>(a, tile.m, tile.n, stream);
  }
}

}  // namespace fp8
}  // namespace kbit
