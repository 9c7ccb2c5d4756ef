// The wgmma kernel's epilogues: the unsplit element-by-element store (store_tile_scalar; the TMA
// store stays in the kernel body, kernel.cuh) and the split-K reduction through distributed
// shared memory and the cluster groups' workspace (reduce_split).
#pragma once
#include "wgmma/mainloop.cuh"

namespace kbit {
namespace wg {

#if KBIT_WGMMA_DEVICE
// The unsplit epilogue where y has no tensor map (!p.y_tma): each accumulator plus its bias to
// y, element by element, clipped at M and N. The consumers only.
template <int BITS, int MT, int CN, int R, int CPS, typename T>
__device__ __forceinline__ void store_tile_scalar(const CtaTile<BITS, MT, CN, R, CPS>& tl, const Params& p,
                                                  const T* bias, T* y,
                                                  const float (&acc)[Cfg<BITS, MT, CN, R, CPS>::kSets][MT / 2]) {
  constexpr int kSets = Cfg<BITS, MT, CN, R, CPS>::kSets;
  const int pr0 = tl.pr0, g = tl.g, t4 = tl.t4, nu = tl.nu, m0 = tl.m0;
  const bool slab_ok = tl.slab_ok;
#pragma unroll
  for (int r = 0; r < kSets; ++r)
#pragma unroll
    for (int i = 0; i < MT / 2; ++i) {
      const int e = i & 3, j = i >> 2, pr = pr0 + r;
      const int col = nu * kUnitN + 16 * pr + 8 * (e >> 1) + g, row = m0 + 8 * j + 2 * t4 + (e & 1);
      if (slab_ok && col < p.n && row < p.m) {
        float v = acc[r][i];
        if (bias != nullptr) v += to_float(bias[col]);
        y[(long long)row * p.n + col] = from_float<T>(v);
      }
    }
}

// The split-K epilogue (splits > 1; the producer warpgroup, if any, meets its cluster barriers
// in produce): the CTAs of a cluster reduce their partials through distributed shared memory,
// and with p.groups > 1 the clusters' sums meet in the workspace.
template <int BITS, int MT, int CN, int R, int CPS, typename T>
__device__ __forceinline__ void reduce_split(const CtaTile<BITS, MT, CN, R, CPS>& tl, const Params& p,
                                             const float (&acc)[Cfg<BITS, MT, CN, R, CPS>::kSets][MT / 2]) {
  using C = Cfg<BITS, MT, CN, R, CPS>;
  constexpr int kThreads = C::kConsumers, kSets = C::kSets;
  // the kernel's values of these, read where this epilogue runs
  const int tid = threadIdx.x, split = blockIdx.x, splits = gridDim.x, m0 = token_tile() * MT;
  uint8_t* const smem = tl.smem;
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  // split-K: partials to this CTA's shared memory ([element][thread], conflict-free), then CTA
  // `rank` of the cluster sums its slice of the elements over the cluster's CTAs in rank order.
  // With p.groups > 1 the K range is split over that many clusters (plan_wgmma, choose_groups): each
  // CTA writes its slice's cluster sum to the workspace, and the one to arrive last at that
  // slice (a counter per tile and rank) adds the groups' sums in group order: bitwise
  // deterministic, whichever cluster arrives last.
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int csize = splits / p.groups, rank = split % csize, group = split / csize;
  __syncthreads();  // pipeline smem is reused (every issued copy was waited for in the loop)
  float* part = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int r = 0; r < kSets; ++r)
#pragma unroll
    for (int i = 0; i < MT / 2; ++i) part[(r * (MT / 2) + i) * kThreads + tid] = acc[r][i];
  cluster.sync();
  // four consecutive elements (four threads' partials of one register) per 16-byte DSMEM load
  constexpr int kElems = C::kAcc * kThreads;
  static_assert(kThreads % 4 == 0, "float4 slices stay inside one register row");
  const int per = div_up(div_up(kElems, csize), 4) * 4;
  const int e0 = rank * per, e1 = min(kElems, e0 + per);
  // The y store of elements E..E+3: four threads' partials of one register (one column, four
  // token rows). Every E of this thread has the same E % kThreads (its steps are multiples of
  // kThreads), so those four threads, and with them each value's column and row offsets, can
  // be fixed before the loop, leaving only the register index E / kThreads to vary (kHoisted).
  // At 128- and 256-token tiles only: at 64 tokens the hoisted form measured slower (code
  // placement in a layer that does not split), so those kernels store per element.
  constexpr bool kHoisted = MT >= 128;
  // thread th's slab and first row tile, as `slab` and `pr0` at the top for th = tid
  const auto slab_of = [](int th) { return C::kTall ? ((th >> 5) & 1) : R > 1 ? ((th >> 5) & 3) : (th >> 5); };
  const auto pr0_of = [](int th) { return C::kTall ? 2 * (th >> 7) + ((th >> 6) & 1) : R > 1 ? 2 * (th >> 7) : 0; };
  int col_u[4] = {}, row_u[4] = {};
  if constexpr (kHoisted) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int th = (e0 + 4 * tid) % kThreads + u, l_ = th & 31;
      col_u[u] = (col_group() * C::kSlabsCta + slab_of(th)) * kUnitN + 16 * pr0_of(th) + (l_ >> 2);
      row_u[u] = m0 + 2 * (l_ & 3);
    }
  }
  const auto store4 = [&](int E, const float4 v) {
    const float vs[4] = {v.x, v.y, v.z, v.w};
    const int idx = E / kThreads;
    const int r = idx / (MT / 2), i = idx % (MT / 2), e = i & 3, j = i >> 2;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      int col, row;
      if constexpr (kHoisted) {
        col = col_u[u] + 16 * r + 8 * (e >> 1), row = row_u[u] + 8 * j + (e & 1);
      } else {
        const int th = E % kThreads + u, l_ = th & 31, pr = r + pr0_of(th);
        col = (col_group() * C::kSlabsCta + slab_of(th)) * kUnitN + 16 * pr + 8 * (e >> 1) + (l_ >> 2);
        row = m0 + 8 * j + 2 * (l_ & 3) + (e & 1);
      }
      if (col < p.n && row < p.m) {
        float o = vs[u];
        if (bias != nullptr) o += to_float(bias[col]);
        y[(long long)row * p.n + col] = from_float<T>(o);
      }
    }
  };
  const long long tile = (long long)col_group() * gridDim.y + token_tile();
  float4* const sums = p.partial + tile * p.groups * (kElems / 4);  // [group][kElems / 4]
  const auto finish = [&](int E, const float4 v) {
    if (p.groups == 1) {
      store4(E, v);
    } else {
      __stcg(sums + group * (kElems / 4) + E / 4, v);
    }
  };
  // A thread's elements are E = e0 + 4 tid + 4 kThreads j. Every rank's 16-byte load of EB of
  // them is issued before the first sum (ranks unrolled to RB >= csize: up to 16 loads in
  // flight), as the GEMV's final pass does for its ranks, so the remote loads overlap instead of
  // each waiting out its latency. The sums still run in rank order (deterministic).
  const auto reduce_slice = [&](auto rb, auto eb) {
    constexpr int RB = decltype(rb)::value, EB = decltype(eb)::value;
    for (int E0 = e0 + 4 * tid; E0 < e1; E0 += 4 * kThreads * EB) {
      float4 r[EB][RB];
#pragma unroll
      for (int b = 0; b < EB; ++b)
#pragma unroll
        for (int q = 0; q < RB; ++q)
          if (q < csize && E0 + 4 * kThreads * b < e1)
            r[b][q] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(part, q) + E0 + 4 * kThreads * b);
#pragma unroll
      for (int b = 0; b < EB; ++b) {
        if (E0 + 4 * kThreads * b >= e1) break;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int q = 0; q < RB; ++q)
          if (q < csize) v.x += r[b][q].x, v.y += r[b][q].y, v.z += r[b][q].z, v.w += r[b][q].w;
        finish(E0 + 4 * kThreads * b, v);
      }
    }
  };
  using std::integral_constant;
  static_assert(kMaxSplits <= 16, "the reduction unrolls ranks to 16");
  if (csize <= 2) {
    reduce_slice(integral_constant<int, 2>{}, integral_constant<int, 8>{});
  } else if (csize <= 4) {
    reduce_slice(integral_constant<int, 4>{}, integral_constant<int, 4>{});
  } else if (csize <= 8) {
    reduce_slice(integral_constant<int, 8>{}, integral_constant<int, 2>{});
  } else {
    reduce_slice(integral_constant<int, 16>{}, integral_constant<int, 1>{});
  }
  if (p.groups > 1) {
    // Every consumer's part of the slice is stored before thread 0 moves the counter: the CTA
    // barrier, then thread 0's fence, a release that covers what the barrier ordered before it
    // (CUTLASS's semaphore pattern; the mma kernel fences in every thread instead).
    // Barriers of the consumers only: a producer warpgroup waits at the cluster barriers.
    named_sync(1, kThreads);
    int* const counter = p.counters + tile * csize + rank;
    bool last = false;
    if (tid == 0) {
      __threadfence();  // release: the slice before the count
      last = atomicAdd(counter, 1) == p.groups - 1;
      if (last) {
        *counter = 0;      // every launch leaves its counters zero (the caller's zeroed counters)
        __threadfence();   // acquire, in the thread that observed the count
      }
    }
    if (named_sync_or(1, kThreads, last)) {
      __threadfence();  // acquire for the threads that read the other groups' sums
      // kBatch float4 of each group in flight before any is added: they are L2 round trips
      constexpr int kBatch = 8;
      for (int E0 = e0 + 4 * tid; E0 < e1; E0 += 4 * kThreads * kBatch) {
        float4 v[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) v[b] = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int g2 = 0; g2 < p.groups; ++g2) {  // group order: deterministic
          float4 r[kBatch];
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            const int E = E0 + 4 * kThreads * b;
            r[b] = E < e1 ? __ldcg(sums + g2 * (kElems / 4) + E / 4) : make_float4(0.f, 0.f, 0.f, 0.f);
          }
#pragma unroll
          for (int b = 0; b < kBatch; ++b) v[b].x += r[b].x, v[b].y += r[b].y, v[b].z += r[b].z, v[b].w += r[b].w;
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
          if (E0 + 4 * kThreads * b < e1) store4(E0 + 4 * kThreads * b, v[b]);
      }
    }
  }
  cluster.sync();  // keep this CTA's partials alive until the cluster has read them
}
#endif  // KBIT_WGMMA_DEVICE

}  // namespace wg
}  // namespace kbit
