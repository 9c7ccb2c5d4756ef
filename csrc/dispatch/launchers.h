// Torch-free host launchers of the kbit kernels. The torch binding (binding.cpp) is the only
// caller: it checks and allocates, plans once, then launches on the current stream. Every
// launcher is CUDA-graph safe: no allocation, no host sync, a grid that depends on the plan
// (shapes and device) only, and workspaces (when any) zeroed on the stream or kept zero.
//
// Conventions shared by all launchers:
//   * W[N, K] is the weight (N out, K in features), K % 32 == 0, N >= 1.
//   * `packed` / `absmax` (no suffix) are the tiled layout of core/layout.cuh;
//     `qweight` / absmax of the checkpoint layout are named so (see vllm_kbit/format.py).
//   * x[M, K], y[M, N] row-major, contiguous, dtype per DType; codebook float32[2^bits] on
//     the device; bias (nullable) [N] of the activation dtype.
//   * A launcher returns the first CUDA error it saw (cudaSuccess otherwise) and never
//     throws; cudaErrorInvalidValue for arguments it does not support.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "core/device.h"
#include "core/kernel_keys.h"
#include "core/layout.cuh"
#include "dispatch/gemv_plan.h"
#include "dispatch/heuristics.h"
#include "dispatch/mma_plan.h"
#include "dispatch/overrides.h"
#include "dispatch/path_rule.h"
#include "dispatch/wgmma_plan.h"

namespace kbit {

// The operands of one GEMM: y = x @ dequant(W)^T (+ bias).
struct GemmOperands {
  DType dtype;             // of x, y and bias: kHalf or kBFloat16
  const void* x;
  const uint32_t* packed;
  const uint8_t* absmax;
  const float* codebook;
  const void* bias;        // nullable
  void* y;
  int m, n, k, bits;
};

// ---- load time: checkpoint <-> tiled layout

// checkpoint (qweight int32 [N, K/32*bits], absmax uint8 [N, K/32]) -> tiled layout.
// packed: n_units(N) * k_units(K) * bits * 128 words; absmax_packed: n_units * k_units * 128 B.
// Padding is written (zeros), so the outputs need no memset.
cudaError_t launch_repack(const uint32_t* qweight, const uint8_t* absmax, uint32_t* packed,
                          uint8_t* absmax_packed, int n, int k, int bits, cudaStream_t stream);

// W[N, K] (fp16, bf16 or fp32) -> checkpoint layout, bit-exact with format.quantize
// (range checks are the caller's: format.check_quantizable).
cudaError_t launch_quantize(DType dtype, const void* w, const float* codebook, uint32_t* qweight,
                            uint8_t* absmax, int n, int k, int bits, cudaStream_t stream);

// Tiled layout -> row-major W rows [n_begin, n_end) into w[(n_end - n_begin), K] (fp16/bf16/fp32),
// each value float(codebook[idx]) * decode_e4m4(absmax) rounded once to the output dtype
// (bit-exact with format.dequantize(..., dtype)).
cudaError_t launch_dequantize(DType dtype, const uint32_t* packed, const uint8_t* absmax,
                              const float* codebook, void* w, int n_begin, int n_end, int k,
                              int bits, cudaStream_t stream);

// Tiled layout -> w[n, k] e4m3: the weight the FP8-activation GEMM decodes in registers for
// weight exponent w_exp (vllm_kbit/fp8.py step 3, fp8.decode_weight), for the large-M FP8 path
// (decode once, then an FP8 GEMM).
cudaError_t launch_decode_fp8(const uint32_t* packed, const uint8_t* absmax, const float* codebook, int w_exp,
                              uint8_t* w, int n, int k, int bits, cudaStream_t stream);

// ---- programmatic dependent launch (core/common.cuh, wait_prior_grids)

// Whether the GEMV and wgmma kernels are launched with PDL: on compute capability >= 9.0.
inline bool use_pdl(const PlanOverrides& o) { return o.pdl && device_is_sm90_or_newer(); }
// Whether the GEMV kernels at M <= 8 let the next kernel launch once their main loop is done
// (allow_dependents): only a kernel launched with PDL reacts (ours, and Inductor's Triton kernels
// with TORCHINDUCTOR_ENABLE_PDL=1).
inline bool use_pdl_trigger(const PlanOverrides& o) { return o.pdl_trigger && use_pdl(o); }

// ---- GEMV (1 <= M <= kGemvMaxM; gemv/)

// The plan on the current device, naming the kernel (plan.key); `splits` > 0 forces the split-K
// factor (1..8; more than 1 needs sm_90 clusters and is clamped to 1 below sm_90). The GEMV
// needs no workspace.
GemvPlan plan_gemv(DType dtype, int m, int n, int k, int bits, int num_sms, int splits, const PlanOverrides& o);
// The device's cluster capacity the plan counted (gemv::Clusters; zeros without clusters).
gemv::Clusters gemv_device_clusters();
// Launches the kernel plan.key names (cudaErrorInvalidValue where it is not built).
cudaError_t launch_gemv(const GemvPlan& plan, const GemmOperands& a, cudaStream_t stream);

// ---- mma.sync tensor-core kernel (mma/; GPUs without the wgmma kernel, M < dequant_min_m)

bool has_mma();
MmaPlan plan_mma(DType dtype, int m, int n, int k, int bits, int num_sms, const MmaOverrides& o);
// `workspace`: mma_workspace_bytes(plan) bytes, 16 B aligned (nullable when 0).
cudaError_t launch_mma(const MmaPlan& plan, const GemmOperands& a, void* workspace, cudaStream_t stream);

// ---- wgmma kernel (Hopper, sm_90a; wgmma/)

// This build has sm_90a code and the current device is compute capability 9.0.
bool wgmma_supported();
// The plan on the current device, naming the kernel (plan.key); `splits` > 0 forces the split
// along K (1..16; 9..16 are non-portable cluster sizes).
WgmmaPlan plan_wgmma(DType dtype, int m, int n, int k, int bits, int num_sms, int splits, const PlanOverrides& o);
// Counters the caller keeps zero (launches leave them zero): kWgmmaZeroedCounters ints.
constexpr int kWgmmaZeroedCounters = 1 << 16;
// `workspace`: wg::workspace_bytes(plan) bytes (nullable when 0); `zeroed_counters` (nullable):
// without it a plan with cluster groups zeroes its counters in the workspace on the stream first.
// Returns cudaErrorNotSupported where wgmma_supported() is false.
cudaError_t launch_wgmma(const WgmmaPlan& plan, const GemmOperands& a, void* workspace, int* zeroed_counters,
                         cudaStream_t stream);

}  // namespace kbit
