// Torch-free host launchers of the kbit kernels. The torch binding (binding.cpp) is the only
// caller: it checks and allocates, then calls these on the current stream. Every launcher
// is CUDA-graph safe: no allocation, no host sync, a grid that depends on shapes only, and
// workspaces (when any) zeroed on the stream or in the kernel.
//
// Conventions shared by all launchers:
//   * W[N, K] is the weight (N out, K in features), K % 32 == 0, N >= 1.
//   * `packed` / `absmax` (no suffix) are the tiled layout of kbit_layout.cuh;
//     `qweight` / absmax of the checkpoint layout are named so (see vllm_kbit/format.py).
//   * x[M, K], y[M, N] row-major, contiguous, dtype per DType; codebook float32[2^bits] on
//     the device; bias (nullable) [N] of the activation dtype.
//   * A launcher returns the first CUDA error it saw (cudaSuccess otherwise) and never
//     throws; cudaErrorInvalidValue for arguments it does not support.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include <cuda_runtime.h>

#include "core/layout.cuh"

namespace kbit {

enum class DType { kHalf, kBFloat16, kFloat32 };

// Largest M the GEMV path serves (its MMA-fed kernel handles up to two n8 tiles of x rows).
constexpr int kGemvMaxM = 16;

// `gemm`'s own choice when the caller does not force a path (H200 measurements by
// benchmarks/bench_gemm.py, 2026-11-21, results in benchmarks/results/):
//   M <= gemv_max_m(bits)                    GEMV (faster than the mma and wgmma kernels at
//                                            every M <= 16);
//     Every layer, wide ones included: since its 8 < M <= 16 kernel stages x in shared memory
//     (7818647) and runs 28672x4096 in four 4-warp CTAs per SM (8afb6eb), the 8B decode step with
//     every layer on it took 0.92-1.00x the time of 28672x4096 on the wgmma kernel at every K =
//     2..5 and M = 9, 12..16 (bench_decode.py --ms 9,12,13,14,15,16 --bits 2,3,4,5 --kbit-paths
//     gemv:0, H200, 27fe379; e.g. M = 16: K=2 2062 vs 2118, K=3 2351 vs 2513, K=4 2403 vs 2429, K=5
//     3237 vs 3347 us). Before, wide layers (a slab per SM) went to wgmma at 8 < M <= 16.
//   gemv_max_m < M <= wgmma_max_m(bits)      on Hopper builds with sm_90a: the wgmma kernel,
//                                            then dequantize + cuBLAS (below);
//   else M < dequant_min_m(bits)             the mma.sync tensor-core kernel (other GPUs);
//   M >= dequant_min_m(bits)                 dequantize row chunks to scratch + cuBLAS. At K=4,
//     M = 256 the mma kernel wins on all six benchmark shapes (by 1.05-1.9x), at M = 512 each
//     wins on three (mma by up to 1.16x, dequantize + cuBLAS by up to 1.46x), from M = 1024
//     dequantize + cuBLAS wins everywhere (the mma kernel takes 2.2-2.8x the time of the faster
//     of cuBLAS / Machete there; one dequantize pass is 0.53 B read + 2 B written a weight).
constexpr int kDequantMinM = 512;
inline int gemv_max_m(int /*bits*/) { return kGemvMaxM; }
inline int dequant_min_m(int /*bits*/) { return kDequantMinM; }

// checkpoint (qweight int32 [N, K/32*bits], absmax uint8 [N, K/32]) -> tiled layout.
// packed: n_units(N) * k_units(K) * bits * 128 words; absmax_packed: n_units * k_units * 128 B.
// Padding is written (zeros), so the outputs need no memset.
cudaError_t launch_repack(const uint32_t* qweight, const uint8_t* absmax, uint32_t* packed,
                          uint8_t* absmax_packed, int n, int k, int bits, cudaStream_t stream);

// W[N, K] (fp16, bf16 or fp32) -> checkpoint layout, bit-exact with format.quantize
// (range checks are the caller's: format.check_quantizable).
cudaError_t launch_quantize(DType dtype, const void* w, const float* codebook, uint32_t* qweight,
                            uint8_t* absmax, int n, int k, int bits, cudaStream_t stream);

// y = x @ dequant(W)^T (+ bias) for 1 <= M <= kGemvMaxM; x/y fp16 or bf16.
// `splits` = 0 picks the split-K factor from the shape; 1..8 forces it (benchmarks, tests;
// more than 1 needs sm_90 clusters and is clamped to 1 below sm_90).
cudaError_t launch_gemv(DType dtype, const void* x, const uint32_t* packed, const uint8_t* absmax,
                        const float* codebook, const void* bias, void* y, void* workspace, int m,
                        int n, int k, int bits, int num_sms, cudaStream_t stream, int splits = 0);
// Bytes of `workspace` launch_gemv needs (0: its split-K reduces through cluster shared memory).
size_t gemv_workspace_bytes(int m, int n, int k, int bits, int num_sms);
// The GEMV's launch plan for tests and benchmarks, as launch_gemv resolves it (environment
// overrides included): out = [splits, warps per CTA, slabs per CTA (0: x not resident), then
// the clusters of 1..8 one-per-SM CTAs the device runs at once (gemv::Clusters; 0 without clusters)].
constexpr int kGemvPlanInts = 11;
void gemv_plan_info(int m, int n, int k, int bits, int num_sms, int splits, int* out);

// Attribute A of the current device, queried once per device (the launch paths ask on every
// call); -1 where there is no current device.
template <cudaDeviceAttr A> inline int device_attribute() {
  static int cached[64];  // per device: value + 1, 0 = not asked yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return -1;
  if (cached[dev] == 0) {
    int v = 0;
    cudaDeviceGetAttribute(&v, A, dev);
    cached[dev] = v + 1;
  }
  return cached[dev] - 1;
}

// Compute capability >= 9.0 on the current device (thread-block clusters, programmatic
// dependent launch).
inline bool device_is_sm90_or_newer() { return device_attribute<cudaDevAttrComputeCapabilityMajor>() >= 9; }

// Tuning overrides from the environment: an integer (`fallback` when unset or empty), and a
// switch that "0..." turns off.
inline int env_int(const char* name, int fallback) {
  const char* f = std::getenv(name);
  return f != nullptr && *f != '\0' ? std::atoi(f) : fallback;
}
inline bool env_off(const char* name) {
  const char* f = std::getenv(name);
  return f != nullptr && f[0] == '0';
}

// Whether the GEMV and wgmma kernels are launched with programmatic dependent launch
// (kbit_common.cuh, wait_prior_grids): on compute capability >= 9.0 unless KBIT_PDL=0.
// PDL pays in a chain of our own GEMMs (bench_decode.py, 8B step at M = 1 / 16 / 64: 1608 /
// 2334 / 3614 us with it, 1664 / 2391 / 3635 without) and costs a little behind a kernel that
// knows nothing of PDL (--between, an elementwise kernel writing x before each GEMM: 1828 /
// 2563 / 3925 with, 1802 / 2536 / 3859 without; H200, d9beda9, one call). vLLM puts such
// kernels before every linear layer, yet end to end (e2e.py, 8B, same call) the two are even:
// bs=1 0.685 s with against 0.677 without, bs=16 0.936 against 0.951, 35.5 against 35.4 req/s.
inline bool use_pdl() {
  static const bool disabled = env_off("KBIT_PDL");
  return !disabled && device_is_sm90_or_newer();
}

// Whether the GEMV kernels at M <= 8 let the next kernel launch once their main loop is done
// (allow_dependents, kbit_common.cuh), while they reduce and write. Only a kernel launched with
// PDL reacts: ours, and Inductor's Triton kernels (vLLM's norms, activation, rotary) when
// TORCHINDUCTOR_ENABLE_PDL=1. Measured (H200, fae51cc + this, one call, alternated twice,
// e2e_8b_pdl_trigger_m8.json): vLLM 8B K=4 with Inductor's PDL, bs=1 0.636 / 0.632 s against 0.647
// / 0.644 without the trigger; bs=16 (M = 16, no trigger) 0.829 / 0.828 against 0.831 / 0.833; the
// decode chain (bench_decode.py, our GEMMs back to back) M = 1 / 8 1526 / 1754 against 1560 / 1767
// us. At M = 16 and in the wgmma kernel it is not used: triggered there too, bs=16 took 0.850 s
// against 0.827 (e2e_8b_pdl_trigger_all_probe.md); without Inductor's PDL both were even (0.665 /
// 0.848 against 0.664 / 0.852 s). KBIT_PDL_TRIGGER=0 turns it off.
inline bool pdl_trigger() {
  static const bool disabled = env_off("KBIT_PDL_TRIGGER");
  return !disabled && use_pdl();
}

// Tensor-core kernel for large M (implemented by kbit_mma.cuh + generated/mma_k*.cu).
cudaError_t launch_mma(DType dtype, const void* x, const uint32_t* packed, const uint8_t* absmax,
                       const float* codebook, const void* bias, void* y, void* workspace, int m,
                       int n, int k, int bits, int num_sms, cudaStream_t stream);
size_t mma_workspace_bytes(int m, int n, int k, int bits, int num_sms);

// wgmma kernel (Hopper, sm_90a; kbit_wgmma.cuh) for gemv_max_m < M <= wgmma_max_m(bits): in a CUDA
// graph of all the linear layers of a Llama-3-8B step (bench_decode.py --kbit-paths
// wgmma:0,mma:0,dequant:0, H200, K=4, 2026-11-21) it took 3313 / 4451 / 6619 / 12097 us at
// M = 32 / 64 / 128 / 256 against the mma.sync kernel's 4242 / 6002 / 8368 / 13986 and
// dequantize + cuBLAS's 13270 / 13265 / 13987 / 15324 (K = 2 and 5 likewise at M = 32..256);
// after x went straight to shared memory (9cb0021) 17505 us at M = 512 against dequantize +
// cuBLAS's 20373, and 32233 against 30827 at M = 1024. So wgmma up to 1023 rows. With the
// faster dequantize kernel (27fe379), same calls (bench_decode_large_m_paths_27fe379.json,
// wgmma_rowsplit_r2_ab_afbc923.json): K=4 M = 512 16408 vs 18536, M = 768 26383 vs 24563,
// M = 1024 (dequantize is the auto path there) 29449 vs 30354 wgmma vs dequantize; at M = 1024
// K=2 27907 vs 28923, K=3 30366 vs 30148, K=5 34454 vs 30691. The crossover moves with K and is
// not monotone in M (wave counts of the 128-token tile). Per K, one call (bench_decode.py --ms
// 256,512,640,768,896,1000 --bits 2,3,4,5 --kbit-paths wgmma:0,dequant:0 --no-baselines, H200,
// 8e153d2 + this threshold; bench_decode_wgmma_vs_dequant_k2_5_k5thr.json), step us, wgmma /
// dequantize + cuBLAS:
//         M = 512          640            768            896            1000
//   K=2   15348 / 18647  20333 / 21400  25467 / 24914  25043 / 28584  27671 / 29617
//   K=3   16797 / 19432  22268 / 22020  27769 / 25256  27871 / 29002  30698 / 30493
//   K=4   16299 / 19841  21729 / 22419  27331 / 25416  27015 / 29649  29501 / 30964
//   K=5   19052 / 20097  25008 / 23011  31391 / 26259  31597 / 30203  34677 / 31342
// (wgmma wins everywhere at M = 256; two earlier calls agree within 5%.) K=5 (five planes, the
// costliest decode) loses by 4-16% at every M from 640, so it leaves wgmma above 512 rows.
// Elsewhere the dequantize path wins at 768 (6 token tiles: 5.1 waves of 28672x4096's 672 CTAs,
// 1.1 of qkv's 144 on 132 SMs, an 8B-shape artifact) and by <= 1.1% at K=3 M = 640 / 1000, so
// K=2..4 kept wgmma up to 1023 rows.
// With 256-token tiles (kbit_wgmma.cuh, choose_tall: half the decode per MMA) the wgmma kernel
// wins further up (bench_decode.py --kbit-paths wgmma:0,dequant:0 --no-baselines, H200, 0dd8999 +
// the tall tiles, two calls; step us, wgmma / dequantize + cuBLAS, cuBLAS fp16 in the same call):
//         M = 1024        2048           3072           4096           8192
//   K=2   22788 / 28443  44494 / 50496  67322 / 71896  91449 / 93233  195389 / 180943
//   K=3   23627 / 29151  45834 / 51096  69968 / 72766  94327 / 94830  196104 / 182881
//   K=4   24016 / 29249  46720 / 51400  71151 / 72794  95902 / 95135  198028 / 183309
//   cuBLAS 22372         44694                         88805          176184
// (at 8192 x no longer fits the L2 beside the tiles). K=5: M = 640 21039 / 20771, 768 23167 /
// 23452, 896 26301 / 28089, 1024 27297 / 29722, 1536 43479 / 40311, 2048 53807 / 51726. So
// wgmma up to 4096 rows at K = 2, 3, 3072 at K=4 (the last measured wins), 1024 at K=5 (1.3%
// slower than dequantize + cuBLAS at 640, 1-8% faster at 768..1024).
// wgmma_supported(): this build has sm_90a code and the current device is compute 9.0.
// `splits` = 0 picks the split-K factor (a thread-block cluster along K, no workspace);
// 1..16 forces it (9..16: non-portable cluster sizes). Returns cudaErrorNotSupported where
// wgmma_supported() is false.
inline int wgmma_max_m(int bits) { return bits == 5 ? 1024 : bits == 4 ? 3072 : 4096; }
// Up to here wgmma serves every layer (128-token tiles alone in the first table above). Above
// it, up to wgmma_max_m, kbit::gemm takes wgmma only for the layers whose plan takes 256-token
// tiles (auto_path; unsplit there: choose_tall splits tall tiles along K only up to this limit,
// so the rule keeps the plan it was measured with), the others dequantize + cuBLAS as before
// those tiles: where choose_tall declines (a last token tile of <= 64 rows, or by cost) 128-token
// tiles lose to it. The 8B step, per layer this way against wgmma on every layer (bench_decode.py --ms 1040,1088,1500,2080
// --bits 2,3,4 and --ms 520,560,800,1000 --bits 5, --kbit-paths wgmma:0,dequant:0
// --no-baselines, two rounds, H200, 0d636b8 + this rule; bench_decode_tall_gaps_0d636b8.json), us:
//         M = 1040        1088           1500           2080
//   K=2   28225 / 29587  30418 / 29976  36465 / 36231  52960 / 56135
//   K=3   28643 / 31490  31202 / 32106  37683 / 37838  53445 / 59811
//   K=4   29149 / 30847  31511 / 31339  38216 / 38080  53749 / 58340
//   K=5   M = 520 18846 / 20388, 560 21853 / 20748, 800 24721 / 26977, 1000 26877 / 27077
// (geometric mean 0.965; K=5 at 560 is the one loss over 1.5%: its 128-token tiles beat dequantize
// + cuBLAS there, 20748 / 21754, and lose at 520, 20388 / 18861).
inline int wgmma_short_max_m(int bits) { return bits == 5 ? 512 : 1023; }
// The GEMV's one-n8-tile limit: above it x takes two n8 tiles (kbit_gemv.cuh).
constexpr int kGemvOneTileM = 8;
bool wgmma_supported();
cudaError_t launch_wgmma(DType dtype, const void* x, const uint32_t* packed, const uint8_t* absmax,
                         const float* codebook, const void* bias, void* y, int m, int n, int k, int bits,
                         int num_sms, cudaStream_t stream, int splits = 0, void* workspace = nullptr,
                         int* zeroed_counters = nullptr);
// `zeroed_counters` (optional): kWgmmaZeroedCounters ints, all zero, which every launch leaves zero;
// without it a launch that splits K over cluster groups zeroes counters in `workspace` first.
constexpr int kWgmmaZeroedCounters = 1 << 16;
// Bytes of `workspace` launch_wgmma needs (0 unless the plan splits K over cluster groups).
size_t wgmma_workspace_bytes(DType dtype, int m, int n, int k, int bits, int num_sms, int splits);
// The launch plan for tests and benchmarks: out = [tile_m, splits (CTAs per cluster along K),
// grid x (splits x cluster groups), grid y
// (token tiles), grid z (column groups), columns per CTA, CTAs per SM the launch allows (1:
// launched with the shared memory of half an SM so the cluster scheduler cannot pack two CTAs
// on one SM, or a kernel built for one per SM), row split (warpgroups sharing the CTA's slabs),
// CTAs per SM the kernel is built for (2, or 1: the producer warpgroup and the wide table),
// cluster groups (split-K over that many clusters of `splits` CTAs, reduced through the workspace)].
constexpr int kWgmmaPlanInts = 10;
void wgmma_plan_info(DType dtype, int m, int n, int k, int bits, int num_sms, int splits, int* out);

// Tiled layout -> row-major W rows [n_begin, n_end) into w[(n_end - n_begin), K] (fp16/bf16/fp32),
// each value float(codebook[idx]) * decode_e4m4(absmax) rounded once to the output dtype
// (bit-exact with format.dequantize(..., dtype)).
cudaError_t launch_dequantize(DType dtype, const uint32_t* packed, const uint8_t* absmax,
                              const float* codebook, void* w, int n_begin, int n_end, int k,
                              int bits, cudaStream_t stream);

}  // namespace kbit
