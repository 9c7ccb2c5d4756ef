// The FP8-activation GEMM's kernels for K=3 (one file a bit width: parallel builds).
#include "wgmma_fp8/fp8_kernel.cuh"
#include "wgmma_fp8/fp8_launch.h"

namespace kbit {
namespace fp8 {
namespace detail {

template <> cudaError_t launch_bits<3>(const GemmArgs& a, int tile_m, cudaStream_t stream) {
  Params p;
  p.x_scale = a.x_scale; p.packed = a.packed; p.absmax = a.absmax; p.codebook = a.codebook;
  p.bias = a.bias; p.y = a.y;
  p.m = a.m; p.n = a.n; p.k = a.k; p.ku_count = k_units(a.k); p.w_exp = a.w_exp;
  const bool half = a.dtype == OutType::kHalf;
  if (tile_m == 64) return half ? launch_tile<3, 64, __half>(p, a.xq, stream) : launch_tile<3, 64, __nv_bfloat16>(p, a.xq, stream);
  if (tile_m == 256) return half ? launch_tile<3, 256, __half>(p, a.xq, stream) : launch_tile<3, 256, __nv_bfloat16>(p, a.xq, stream);
  return half ? launch_tile<3, 128, __half>(p, a.xq, stream) : launch_tile<3, 128, __nv_bfloat16>(p, a.xq, stream);
}

}  // namespace detail
}  // namespace fp8
}  // namespace kbit
