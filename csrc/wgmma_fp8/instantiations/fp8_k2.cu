// The FP8-activation GEMM's kernels for K=2 (one file a bit width: parallel builds).
#include "wgmma_fp8/fp8_kernel.cuh"
#include "wgmma_fp8/fp8_launch.h"

#include <type_traits>

namespace kbit {
namespace fp8 {
namespace detail {

template <> cudaError_t launch_bits<2>(const GemmArgs& a, int tile_m, int tile_n, cudaStream_t stream) {
  Params p;
  p.x_scale = a.x_scale; p.packed = a.packed; p.absmax = a.absmax; p.codebook = a.codebook;
  p.bias = a.bias; p.y = a.y;
  p.m = a.m; p.n = a.n; p.k = a.k; p.ku_count = k_units(a.k); p.w_exp = a.w_exp;
  const auto go = [&](auto mt, auto cn) {
    constexpr int MT = decltype(mt)::value, CN = decltype(cn)::value;
    return a.dtype == OutType::kHalf ? launch_tile<2, MT, CN, __half>(p, a.xq, stream)
                                     : launch_tile<2, MT, CN, __nv_bfloat16>(p, a.xq, stream);
  };
  using I64 = std::integral_constant<int, 64>;
  using I128 = std::integral_constant<int, 128>;
  using I256 = std::integral_constant<int, 256>;
  if (tile_n == 256) return go(I128{}, I256{});
  if (tile_m == 64) return go(I64{}, I128{});
  if (tile_m == 256) return go(I256{}, I128{});
  return go(I128{}, I128{});
}

}  // namespace detail
}  // namespace fp8
}  // namespace kbit
