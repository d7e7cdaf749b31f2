/* The GEMM engine's split-K sums (contract in gemm_sm90.cuh): the slices' accumulators over a
 * cluster's distributed shared memory (a binary tree) or through a
 * global workspace (the same tree). */
#pragma once

#include "gemm/gemm_params.cuh"

namespace tw {
namespace gemm {

namespace detail {

// Split-K, one consumer warpgroup (all 128 threads) after a tile's mainloop: the slices'
// accumulators summed as a binary tree over distributed shared memory, log2(kSplit) rounds. In
// round r (half = kSplit >> (r + 1)) slice s in [half, 2 half) waits until its previous tile's
// buffer was read, writes its accumulators into its epilogue buffer (thread-major in 16-byte
// chunks: conflict-free), arrives on slice s - half's bar[r] (release, cluster scope) and is done
// (returns false); slice s < half waits on its bar[r] (acquire, cluster scope), adds slice s +
// half's accumulators to its own and tells that slice its buffer is free (its bar[kRounds]).
// Slice 0 ends with the sum ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)) for 8 slices, the same
// order on every run; returns true. Each barrier completes once per tile (one sender per round,
// one reader per buffer), so `it` (the warpgroup's tiles so far) gives every phase. Against one
// reader of every slice in turn: log2(kSplit) buffers on the longest path, not kSplit - 1.
template <int kSplit> constexpr int split_rounds() {
  return kSplit >= 8 ? 3 : (kSplit >= 4 ? 2 : 1);
}
template <int kSplit, int BN, class Params>
__device__ __forceinline__ bool split_combine(const Params &p, float (&acc)[BN / 2], uint8_t *cbuf,
                                              uint64_t *bar, uint32_t slice, uint32_t it,
                                              int wg_thread, uint64_t timeout_ns) {
  constexpr int kChunks = BN / 8; // 16-byte chunks of accumulators per thread
  constexpr int kRounds = split_rounds<kSplit>();
  uint64_t *free_bar = &bar[kRounds];
  using WaitT = typename Params::WaitType;
  const uint32_t base = ptx::smem_u32(cbuf) + 16u * (uint32_t)wg_thread;
#pragma unroll
  for (int r = 0; r < kRounds; r++) {
    const uint32_t half = (uint32_t)kSplit >> (r + 1);
    if (slice >= half) { // this round's sender (slices >= 2 half sent in an earlier round)
      if (!ptx::mbar_wait_for<true>(free_bar, (it & 1) ^ 1, timeout_ns))
        WaitT::mbar_stuck(p.wait, kStuckSplitFree * 16 + r);
      float4 *mine = reinterpret_cast<float4 *>(cbuf);
#pragma unroll
      for (int j = 0; j < kChunks; j++)
        mine[j * 128 + wg_thread] =
            make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
      ptx::mbar_arrive_release_cluster(ptx::mapa_shared(ptx::smem_u32(&bar[r]), slice - half));
      return false;
    }
    if (!ptx::mbar_wait_for<true>(&bar[r], it & 1, timeout_ns))
      WaitT::mbar_stuck(p.wait, kStuckSplitFull * 16 + r);
    const uint32_t remote = ptx::mapa_shared(base, slice + half);
#pragma unroll
    for (int j = 0; j < kChunks; j++) {
      const float4 v = ptx::ld_shared_cluster_f4(remote + 16u * 128u * (uint32_t)j);
      acc[4 * j] = __fadd_rn(acc[4 * j], v.x);
      acc[4 * j + 1] = __fadd_rn(acc[4 * j + 1], v.y);
      acc[4 * j + 2] = __fadd_rn(acc[4 * j + 2], v.z);
      acc[4 * j + 3] = __fadd_rn(acc[4 * j + 3], v.w);
    }
    // Every thread of the warpgroup has read the sender's buffer: it may be written again.
    ptx::named_bar_sync(kBarConsumerWg0 + (int)(threadIdx.x / 128) - 1, 128);
    if (wg_thread == 0)
      ptx::mbar_arrive_release_cluster(ptx::mapa_shared(ptx::smem_u32(free_bar), slice + half));
  }
  return true;
}

// The value slice s holds after R rounds of split_combine's tree, from the slices' partials at
// part + slice * stride: V(R, s) = V(R - 1, s) + V(R - 1, s + kSplit >> R) (the receiver's
// first), V(0, s) = partial s. Depth first, so about R values are live, not kSplit.
template <int kSplit, int R> struct WsTree {
  __device__ static __forceinline__ float4 at(const float4 *part, size_t stride, int s) {
    const float4 a = WsTree<kSplit, R - 1>::at(part, stride, s);
    const float4 b = WsTree<kSplit, R - 1>::at(part, stride, s + (kSplit >> R));
    return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z),
                       __fadd_rn(a.w, b.w));
  }
};
template <int kSplit> struct WsTree<kSplit, 0> {
  __device__ static __forceinline__ float4 at(const float4 *part, size_t stride, int s) {
    return __ldcg(part + (size_t)s * stride);
  }
};

// Split-K through global memory (GemmParams::split_ws): this slice's accumulators go to the
// workspace; the warpgroup's count for the tile says whether it came last, and the last sums
// all kSplit slices' partials in split_combine's tree order (round r: slice s < kSplit >> (r + 1)
// takes s + (kSplit >> (r + 1))), so its bits are the cluster tree's. Returns true where this
// warpgroup stores the tile. No wait: nobody waits for anybody.
template <int kSplit, int BN, class Params>
__device__ __forceinline__ bool split_ws_combine(const Params &p, float (&acc)[BN / 2],
                                                 int32_t tile, uint32_t slice, int cwg,
                                                 int wg_thread, volatile int32_t *last) {
  constexpr int kChunks = BN / 8; // 16-byte chunks of accumulators per thread
  constexpr size_t kRegion = (size_t)kChunks * 128;
  float4 *ws = reinterpret_cast<float4 *>(p.split_ws);
  float4 *mine = ws + ((size_t)tile * kSplit * 2 + (size_t)slice * 2 + (size_t)cwg) * kRegion;
#pragma unroll
  for (int j = 0; j < kChunks; j++)
    __stcg(&mine[j * 128 + wg_thread],
           make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]));
  __threadfence(); // this thread's partial before the count that publishes it
  ptx::named_bar_sync(kBarConsumerWg0 + cwg, 128);
  if (wg_thread == 0) {
    uint32_t *count = &p.split_cnt[tile * 2 + cwg];
    const bool is_last = atomicAdd(count, 1u) == (uint32_t)(kSplit - 1);
    if (is_last) {
      atomicExch(count, 0u); // for the next call (stream-ordered after this kernel)
      __threadfence();       // every slice's partial before this warpgroup's reads
    }
    *last = is_last;
  }
  ptx::named_bar_sync(kBarConsumerWg0 + cwg, 128);
  if (!*last)
    return false;
  const float4 *base = ws + ((size_t)tile * kSplit * 2 + (size_t)cwg) * kRegion;
#pragma unroll
  for (int j = 0; j < kChunks; j++) { // unrolled: acc stays in registers
    const float4 v =
        WsTree<kSplit, split_rounds<kSplit>()>::at(base + j * 128 + wg_thread, 2 * kRegion, 0);
    acc[4 * j] = v.x, acc[4 * j + 1] = v.y, acc[4 * j + 2] = v.z, acc[4 * j + 3] = v.w;
  }
  return true;
}

} // namespace detail

} // namespace gemm
} // namespace tw
