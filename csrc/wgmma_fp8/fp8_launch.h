// Host entry points of the FP8-activation kbit GEMM (wgmma_fp8/fp8_kernel.cuh), torch-free: the
// plan (dispatch/fp8_plan.h) on the current device, and launchers that launch the kernel a plan's
// key names (fp8_kernels.h, generated), deciding nothing.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/device.h"
#include "dispatch/fp8_plan.h"
#include "dispatch/overrides.h"

namespace kbit {
namespace fp8 {

// Whether this build and the current device run the FP8 GEMM (sm_90a code, compute capability
// 9.0) and the activation quantizer (e4m3 conversions: compute capability 8.9 or newer).
bool gemm_supported();
bool quantize_supported();

// The plan for y [m, n] of `dtype` (fp16 / bf16) on the current device's table, naming the kernel
// (plan.key); the overrides force the tile.
Fp8Plan plan_gemm(DType dtype, int m, int n, int bits, int num_sms, const Fp8Overrides& o);

// x [m, k] (fp16 / bf16, 16 B aligned, k % 32 == 0) -> xq [m, k] e4m3 in the GEMM's k order for
// `bits`, scale [m] fp32.
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
// Launches the kernel plan.key names (cudaErrorInvalidValue where the key does not match the
// operands or names no compiled kernel).
cudaError_t launch_gemm(const Fp8Plan& plan, const GemmArgs& a, cudaStream_t stream);

// The largest / smallest weight exponent r the kernel takes (the pair table stays finite in fp16).
int max_weight_exp();
int min_weight_exp();

}  // namespace fp8
}  // namespace kbit
