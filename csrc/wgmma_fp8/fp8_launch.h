// Host entry points of the FP8-activation kbit GEMM (wgmma_fp8/fp8_kernel.cuh), torch-free:
// launchers that launch the kernel a key names (fp8_kernels.h, generated), deciding nothing. The
// key comes from the plan (dispatch/fp8_plan.h), which the binding makes.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/device.h"
#include "core/kernel_keys.h"

namespace kbit {
namespace fp8 {

// Whether this build and the current device run the FP8 GEMM (sm_90a code, compute capability
// 9.0) and the activation quantizer (e4m3 conversions: compute capability 8.9 or newer).
bool gemm_supported();
bool quantize_supported();

// x [m, k] (fp16 / bf16, 16 B aligned, k % 32 == 0) -> xq [m, k] e4m3 in the GEMM's k order for
// `bits` (0: natural order, for the dequantize + scaled_mm path), scale [m] fp32.
cudaError_t launch_quantize_act(DType dtype, const void* x, uint8_t* xq, float* scale, int m, int k, int bits,
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
  DType dtype;              // of y and bias: kHalf or kBFloat16
};
// Launches the kernel `key` names on its grid (cudaErrorInvalidValue where the key does not
// match the operands or names no compiled kernel).
cudaError_t launch_gemm(const Fp8Key& key, const GemmArgs& a, cudaStream_t stream);

// The largest / smallest weight exponent r the kernel takes (the pair table stays finite in fp16).
int max_weight_exp();
int min_weight_exp();

}  // namespace fp8
}  // namespace kbit
