// Device helpers shared by the repack / quantize / dequantize / GEMV kernels (torch-free).
// Each PTX wrapper says why it exists instead of the plain C++ form.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/layout.cuh"

namespace kbit {

// E4M4 code -> float, exact and independent of fast-math: decode_e4m4 in core/layout.cuh
// divides by a power of two, which --use_fast_math may turn into an approximate reciprocal.
// Normal codes are assembled as IEEE bits (exponent e - 11 + 127, mantissa m << 19);
// subnormals are m * 2^-14, a multiplication by a power of two (exact, result normal).
__host__ __device__ __forceinline__ float decode_e4m4_exact(uint32_t code) {
  const uint32_t e = (code >> 4) & 0xF, m = code & 0xF;
#ifdef __CUDA_ARCH__
  return e ? __uint_as_float(((e + 116u) << 23) | (m << 19)) : float(m) * 0x1p-14f;
#else
  return decode_e4m4(uint8_t(code));
#endif
}

// Arguments of the kernels that stream the tiled layout along K per 64-column slab (GEMV and
// wgmma): y[m, n] = x[m, k] @ dequant(W)^T (+ bias), each CTA taking `chunk` K-units.
struct StreamParams {
  const void* x;             // [m, k] fp16 / bf16
  const uint32_t* packed;    // tiled layout
  const uint8_t* absmax;     // tiled layout
  const float* codebook;     // [2^bits] float32
  const void* bias;          // [n] or nullptr
  void* y;                   // [m, n]
  int m, n, k;
  int ku_count;              // k_units(k)
  int chunk;                 // K-units per split (the K range of one CTA)
  bool pdl;                  // launched with programmatic dependent launch (use_pdl())
  bool trigger;              // allow_dependents() once the main loop is done (pdl_trigger())
  // wgmma only: split-K over `groups` clusters reduced through a global workspace (wgmma/epilogue.cuh)
  int groups = 1;
  int* counters = nullptr;   // [tile][cluster rank] arrivals: zero before a launch and after it
  float4* partial = nullptr; // [tile][group][tile elements / 4] the clusters' sums
  bool y_tma = false;        // unsplit calls store y through shared memory and the y tensor map
};

template <typename T> struct Vec2;
template <> struct Vec2<__half> { using type = __half2; };
template <> struct Vec2<__nv_bfloat16> { using type = __nv_bfloat162; };

// Two codebook values as one 32-bit register of the MMA operand type (lo16 = a, hi16 = b).
template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }

// mma.sync m16n8k16 with fp32 accumulation, d = A B + c: A row-major (16 x 16), B "col-major"
// (16 x 8, i.e. n-major fragments), the fragment layouts of the PTX ISA. d may alias c.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                             const float (&c)[4]);
template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                                     const float (&c)[4]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                            uint32_t b1, const float (&c)[4]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
}

// Streaming 16-byte load of weight data that is read exactly once: non-coherent path and no
// L1 allocation, so the L1 keeps the activations that every warp re-reads.
__device__ __forceinline__ uint4 ld_stream_v4(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// One lane's share of a 64x64 unit of the tiled layout (core/layout.cuh): its 16 bytes of each
// bit-plane and the 16 absmax codes of its column group (the 4 lanes of a group read the same
// bytes: one broadcast), by streaming 16-byte loads. The GEMV and the dequantize kernel read
// units this way.
template <int BITS> struct LaneUnit {
  uint4 w[BITS];  // word w of plane b: component w of w[b]
  uint4 a;        // absmax codes [w][q]
  __device__ __forceinline__ void load(const uint32_t* packed, const uint8_t* absmax, long long unit, int lane) {
    const uint32_t* wp = packed + unit * unit_words(BITS) + lane * 4;
#pragma unroll
    for (int b = 0; b < BITS; ++b) w[b] = ld_stream_v4(wp + b * 128);
    a = ld_stream_v4(absmax + unit * kUnitAbsmaxBytes + (lane >> 2) * 16);
  }
};

// shfl.idx reads only bits [4:0] of the source-lane operand (PTX ISA, shfl.sync), so a
// shifted word whose low 5 bits hold an index can be passed without masking; __shfl_sync
// documents no such guarantee, hence the explicit instruction.
__device__ __forceinline__ uint32_t shfl_lut(uint32_t table, uint32_t lane_bits) {
  uint32_t r;
  asm("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=r"(r) : "r"(table), "r"(lane_bits));
  return r;
}

// 32-bit shared-window load. The pair-table lookups (core/decode.cuh) use it with an address
// computed as (lane's replica base) + (entry << kRowShift), one LEA, or with wide rows as one
// PRMT; given a plain C++ index the compiler rebuilds ((entry << 5) | lane) * 4 + base, which
// costs three integer ops instead of one.
// volatile: keeps it after the __syncthreads that publishes the table.
__device__ __forceinline__ uint32_t lds_u32(uint32_t addr) {
  uint32_t r;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(r) : "r"(addr));
  return r;
}

// cp.async.cg 16 B global -> shared, bypassing L1 (x tiles are re-read by other CTAs through
// L2, not by this one, except the GEMV's 4-warp CTAs, four per SM, which may share one: a .ca
// variant is untried; weights are read once). src-size 0
// zero-fills the 16 B: rows past M, k past K and columns past N become zeros without a read.
// The source pointer must still be a valid address; callers pass a tensor base when invalid.
__device__ __forceinline__ void cp_async16(uint32_t smem_addr, const void* gptr, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gptr),
               "r"(src_size));
}
// One commit group per pipeline stage; wait_group<N> leaves at most N stages in flight.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ldmatrix.x4: four 8x8 b16 matrices in one instruction; lanes 8j..8j+7 address the rows of
// matrix j, and lane l receives register j = row l/4, elements 2(l%4), 2(l%4)+1 of matrix j,
// which is the mma.sync fragment order (the mma kernel's A tiles, the GEMV's x^T B tiles).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// mbarrier (sm_80+): a shared-memory barrier object completing a phase when `count` arrivals
// (and, sm_90, the transaction bytes announced with expect_tx) have happened. Used where a
// stage is handed between producers and consumers without a CTA-wide __syncthreads.
__device__ __forceinline__ void mbar_init(uint32_t addr, uint32_t count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(addr), "r"(count));
}
// One arrival. It releases only this thread's own earlier accesses: where several threads
// read a stage, each arrives (racecheck reports a single lane arriving after __syncwarp).
__device__ __forceinline__ void mbar_arrive(uint32_t addr) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared.b64 st, [%0];\n}\n" ::"r"(addr) : "memory");
}
// Spins until the phase of parity `parity` has completed; on sm_90 try_wait lets the warp
// sleep inside the instruction for a while instead of re-issuing a poll every cycle.
__device__ __forceinline__ void mbar_wait(uint32_t addr, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred p;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(addr),
      "r"(parity)
      : "memory");
#else
  asm volatile(
      "{\n .reg .pred p;\n"
      "WAIT_%=:\n"
      " mbarrier.test_wait.parity.shared.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(addr),
      "r"(parity)
      : "memory");
#endif
}

// Host: how many clusters of `s` CTAs of `kernel` (`threads` threads and `smem` bytes of dynamic
// shared memory each) the device runs at once, in *n; false where it does not answer (the
// caller clears the sticky error). The GEMV and wgmma plans size their split-K clusters by it.
template <typename Kernel> bool max_active_clusters(Kernel kernel, int s, int threads, int smem, int* n) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(s, 1, 1);
  cfg.blockDim = dim3(threads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = s;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaOccupancyMaxActiveClusters(n, kernel, &cfg) == cudaSuccess;
}

// Programmatic dependent launch (sm_90; use_pdl in dispatch/launchers.h). The GEMM kernels are launched with
// cudaLaunchAttributeProgrammaticStreamSerialization, so their CTAs may be scheduled (shared
// memory and registers allocated, launch latency paid) while the previous kernel on the stream
// drains. This wait, the first thing those kernels do, blocks until that kernel has completed
// and its writes are visible: every input, the weights and codebook included, may have been
// written by it (a repack, a test's fill), so nothing is read before. Below sm_90, and for a
// launch without the attribute, it is a no-op.
__device__ __forceinline__ void wait_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The other half of PDL: lets the next kernel on the stream, if it was launched with the
// attribute, be scheduled before this grid ends (PTX: once every CTA has executed it or exited;
// the first thread of a CTA to execute it counts for the CTA). Its own wait still blocks until
// this grid has completed and its writes are visible, so this is only safe where the CTA reads
// no global input any more: after the main loop, every copy into shared memory consumed.
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Hides a value's provenance from the optimizer (see lds_u32).
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
  asm volatile("mov.b32 %0, %0;" : "+r"(v));
  return v;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  return __byte_perm(a, b, sel);
}

}  // namespace kbit
