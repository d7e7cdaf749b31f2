/* The GEMM engine's split-K sums (contract in gemm_sm90.cuh): the slices' accumulators over a
 * cluster's distributed shared memory (a binary tree, or split_scatter's bands) or through a
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
// Split-K with GemmParams::split_scatter, one consumer warpgroup (all 128 threads): every slice
// writes its accumulators into its epilogue buffer (thread-major 16-byte chunks) and arrives on
// every other slice's bar[0] (release, cluster scope); then, once every other slice arrived on
// its own bar[0] (acquire), it sums its band of kChunks / kSplit chunks (8 of the tile's
// columns each) over slices 0, 1, ... in that order (the first version's order, the same bits
// on every run) and stores them to p.split_c with plain stores (rows past p.rows and columns
// past p.split_n left out); it then tells every other slice that it has read their buffers (their
// bar[1], which completes after kSplit - 1 arrivals), and waits for its own bar[1] before it
// writes its buffer again (the next tile). One round on every slice's path, no epilogue.
template <int kSplit, int BN, class Out, class Params>
__device__ __forceinline__ void
split_scatter(const Params &p, float (&acc)[BN / 2], uint8_t *cbuf, uint64_t *bar, uint32_t slice,
              uint32_t it, int wg_thread, int wg, int32_t mb, int32_t nb, uint64_t timeout_ns) {
  constexpr int kChunks = BN / 8;
  constexpr int kBand = kChunks / kSplit;
  static_assert(kBand >= 1 && kChunks % kSplit == 0, "every slice a whole band of chunks");
  using WaitT = typename Params::WaitType;
  if (!ptx::mbar_wait_for<true>(&bar[1], (it & 1) ^ 1, timeout_ns))
    WaitT::mbar_stuck(p.wait, kStuckSplitFree * 16 + 8);
  float4 *mine = reinterpret_cast<float4 *>(cbuf);
#pragma unroll
  for (int j = 0; j < kChunks; j++)
    mine[j * 128 + wg_thread] =
        make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
  const uint32_t full = ptx::smem_u32(&bar[0]);
#pragma unroll 1
  for (uint32_t q = 0; q < (uint32_t)kSplit; q++)
    if (q != slice)
      ptx::mbar_arrive_release_cluster(ptx::mapa_shared(full, q));
  if (!ptx::mbar_wait_for<true>(&bar[0], it & 1, timeout_ns))
    WaitT::mbar_stuck(p.wait, kStuckSplitFull * 16 + 8);
  const uint32_t base = ptx::smem_u32(cbuf) + 16u * (uint32_t)wg_thread;
  const int j0 = (int)slice * kBand;
  float4 sum[kBand];
#pragma unroll
  for (int b = 0; b < kBand; b++)
    sum[b] = ptx::ld_shared_cluster_f4(ptx::mapa_shared(base, 0) + 16u * 128u * (uint32_t)(j0 + b));
#pragma unroll 1
  for (uint32_t q = 1; q < (uint32_t)kSplit; q++) {
    const uint32_t remote = ptx::mapa_shared(base, q);
#pragma unroll
    for (int b = 0; b < kBand; b++) {
      const float4 v = ptx::ld_shared_cluster_f4(remote + 16u * 128u * (uint32_t)(j0 + b));
      sum[b].x = __fadd_rn(sum[b].x, v.x);
      sum[b].y = __fadd_rn(sum[b].y, v.y);
      sum[b].z = __fadd_rn(sum[b].z, v.z);
      sum[b].w = __fadd_rn(sum[b].w, v.w);
    }
  }
  // Every thread of the warpgroup has read the other slices' buffers: they may be written again.
  ptx::named_bar_sync(kBarConsumerWg0 + wg, 128);
  if (wg_thread == 0) {
    const uint32_t freed = ptx::smem_u32(&bar[1]);
    for (uint32_t q = 0; q < (uint32_t)kSplit; q++)
      if (q != slice)
        ptx::mbar_arrive_release_cluster(ptx::mapa_shared(freed, q));
  }
  // Chunk j of thread t: rows r and r + 8 of the warpgroup's 64, columns 8 j + 2 (t % 4) + {0, 1}
  // (the wgmma accumulator layout, as in the epilogue).
  const int warp = wg_thread >> 5, lane = wg_thread & 31;
  const int64_t row0 = (int64_t)mb * kBlockM + wg * (kBlockM / 2) + warp * 16 + (lane >> 2);
  Out *c = static_cast<Out *>(p.split_c);
#pragma unroll
  for (int b = 0; b < kBand; b++) {
    const int64_t col = (int64_t)nb * BN + 8 * (j0 + b) + 2 * (lane & 3);
    if (col >= p.split_n)
      continue;
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int64_t row = row0 + 8 * h;
      if (row >= p.rows)
        continue;
      const float lo = h ? sum[b].z : sum[b].x, hi = h ? sum[b].w : sum[b].y;
      Out *dst = c + row * p.split_ldc + col;
      if constexpr (sizeof(Out) == 2)
        *reinterpret_cast<__nv_bfloat162 *>(dst) = __floats2bfloat162_rn(lo, hi);
      else
        *reinterpret_cast<float2 *>(dst) = make_float2(lo, hi);
    }
  }
}

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
