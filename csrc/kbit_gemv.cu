// GEMV path dispatch: shape checks, the split-K choice, and the call into the per-bit-width
// instantiations (generated/gemv_k<B>.cu). See kbit_gemv.cuh for the kernel design.
#include <cuda_runtime.h>

#include "kbit_gemv.cuh"
#include "kbit_ops.h"

namespace kbit {
namespace gemv {

extern template cudaError_t launch_bits<2>(DType, const Params&, int, cudaStream_t);
extern template cudaError_t launch_bits<3>(DType, const Params&, int, cudaStream_t);
extern template cudaError_t launch_bits<4>(DType, const Params&, int, cudaStream_t);
extern template cudaError_t launch_bits<5>(DType, const Params&, int, cudaStream_t);

namespace {

// Split-K factor S (cluster size) from the shape alone. Measured on the H200
// (benchmarks/bench_gemm.py --sweep-splits): a CTA has a fixed cost of a few microseconds
// (pipeline fill, table, cluster reduction), so splits pay only to occupy SMs:
//   * two CTAs per SM (16 warps) when every warp still streams >= 8 units: 8192x28672 is
//     ~8-10% faster at S = 2 (256 CTAs) than at S = 1;
//   * else one CTA per SM: 4096x4096 is fastest at S = 2 (128 CTAs), slower at S = 3..8;
//   * S = 1 once NU alone covers that (57344x8192, 28672x4096).
// At M > 8 (two n8 tiles of x, ~230 registers) only one CTA fits an SM, so a second wave costs
// a whole CTA time: the largest S whose NU * S CTAs still fit one wave (in a CUDA graph of an
// 8B decode step at M = 16, 6144x4096: 13.8 us at S = 1 against 17.6 at S = 2; 4096x4096 and
// 4096x14336 best at S = 2; bench_decode.py --kbit-paths gemv:1,gemv:2,...).
int choose_splits(int m, int nu, int ku, int num_sms) {
  const int s_max = ku < kMaxSplits ? ku : kMaxSplits;
  if (m > 8) {
    int s = 1;
    while (s < s_max && (long long)nu * (s + 1) <= num_sms) ++s;
    return s;
  }
  const auto smallest = [&](long long ctas_wanted) {
    int s = 1;
    while (s < s_max && (long long)nu * s * 10 < 9 * ctas_wanted) ++s;
    return s;
  };
  const int s2 = smallest(2LL * num_sms);
  if (div_up(div_up(ku, s2), kWarps) >= 8) return s2;
  return smallest(num_sms);
}

bool device_has_clusters() {
  static int cached[64];  // per device: 0 unknown, 1 no, 2 yes
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  if (cached[dev] == 0) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cached[dev] = major >= 9 ? 2 : 1;
  }
  return cached[dev] == 2;
}

}  // namespace
}  // namespace gemv


size_t gemv_workspace_bytes(int, int, int, int, int) { return 0; }

cudaError_t launch_gemv(DType dtype, const void* x, const uint32_t* packed, const uint8_t* absmax,
                        const float* codebook, const void* bias, void* y, void* /*workspace*/, int m, int n, int k,
                        int bits, int num_sms, cudaStream_t stream, int splits) {
  if (m < 1 || m > kGemvMaxM || n < 1 || k < kBlock || k % kBlock != 0) return cudaErrorInvalidValue;
  if (dtype != DType::kHalf && dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  gemv::Params p;
  p.x = x; p.packed = packed; p.absmax = absmax; p.codebook = codebook; p.bias = bias; p.y = y;
  p.m = m; p.n = n; p.k = k;
  p.ku_count = k_units(k);
  p.pdl = use_pdl();
  const bool clusters = gemv::device_has_clusters();
  int s = splits > 0 ? splits : gemv::choose_splits(m, n_units(n), p.ku_count, num_sms > 0 ? num_sms : 1);
  if (s > gemv::kMaxSplits) s = gemv::kMaxSplits;
  if (s > p.ku_count) s = p.ku_count;
  if (!clusters) s = 1;
  p.chunk = div_up(p.ku_count, s);
  switch (bits) {
    case 2: return gemv::launch_bits<2>(dtype, p, s, stream);
    case 3: return gemv::launch_bits<3>(dtype, p, s, stream);
    case 4: return gemv::launch_bits<4>(dtype, p, s, stream);
    case 5: return gemv::launch_bits<5>(dtype, p, s, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kbit
