// Host entry points of the FP8-activation kbit GEMM (wgmma_fp8/fp8_kernel.cuh), torch-free.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kbit {
namespace fp8 {

enum class OutType { kHalf, kBFloat16 };

// Whether this build and the current device run the FP8 GEMM (sm_90a code, compute capability
// 9.0) and the activation quantizer (e4m3 conversions: compute capability 8.9 or newer).
bool gemm_supported();
bool quantize_supported();

// The CTA tile (tokens, columns) the GEMM takes for this shape (fp8_launch.cu): 128 x 256,
// 128 x 128 or 64 x 128; 256 x 128 is forced only.
struct Tile { int m, n; };
Tile choose_tile(int m, int n, int num_sms);

// x [m, k] (fp16 / bf16, 16 B aligned, k % 32 == 0) -> xq [m, k] e4m3 in the GEMM's k order for
// `bits`, scale [m] fp32.
cudaError_t launch_quantize_act(OutType dtype, const void* x, uint8_t* xq, float* scale, int m, int k, int bits,
                                cudaStream_t stream);

struct GemmArgs {
  const uint8_t* xq;        // [m, k] from launch_quantize_act with the same bits
  const float* x_scale;     // [m]
  const uint32_t* packed;   // tiled layout
  const uint8_t* absmax;    // tiled layout
  const float* codebook;    // [2^bits] float32
  const void* bias;         // [n] of dtype or nullptr
  void* y;                  // [m, n] of dtype
  int m, n, k, bits, w_exp;
  OutType dtype;
};
// tile_m = tile_n = 0 picks with choose_tile; else (64, 128), (128, 128), (256, 128) or (128, 256),
// a 0 standing for 128.
cudaError_t launch_gemm(const GemmArgs& a, int tile_m, int tile_n, int num_sms, cudaStream_t stream);

// The largest / smallest weight exponent r the kernel takes (the pair table stays finite in fp16).
int max_weight_exp();
int min_weight_exp();

namespace detail {
template <int BITS> cudaError_t launch_bits(const GemmArgs& a, int tile_m, int tile_n, cudaStream_t stream);
}

}  // namespace fp8
}  // namespace kbit
