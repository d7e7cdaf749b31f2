/*
 * Internal: one 16-byte group of GEMM+RS / GEMM+AR partials as floats and their bf16 sums (the
 * fused kernel's reductions, gemm_rs_fused.cuh, the unfused pipeline's, gemm_rs_unfused.cu, and
 * the swap-AB GEMM's low-latency epilogue, gemm_ll.cuh, that reduces its own rows itself): every
 * path that sums partials sums them here, in rank order, so they all give the same bits.
 */
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "device/signal.cuh"

namespace tw {

__device__ __forceinline__ uint32_t pack_bf16x2(float x, float y) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t *>(&h);
}

/* One 16-byte load of partials as kE floats (bf16 partials widen exactly), and kE bf16 sums
 * packed for one store: fp32 partials come 4 at a time (8-byte stores), bf16 ones 8 at a time
 * (16-byte stores). Aligned: n and ldo are multiples of 8, staging and out 16-byte aligned.
 * Each type keeps one 16-byte load per item: 16-byte stores for fp32 partials too (items of 8)
 * would take two 16-byte loads per thread and item, which leave each load instruction half its
 * sectors.
 * Cache hints: the partials are read once (ld.global.cs, evict-first) and the sums go to out as
 * streaming stores (st.global.cs, as the gather's copies do), so tw_gemm_ar's reduced rows,
 * read by every rank's gather, stay in L2 (figures: docs/PERF.md). */
template <class P> struct RsVec;
template <> struct RsVec<float> {
  static constexpr int kE = 4;
  using Packed = uint2;
  /* 16 bytes of partials (as loaded, or as carried by low-latency words) as floats */
  static __device__ __forceinline__ void unpack(const uint4 &u, float (&f)[kE]) {
    f[0] = __uint_as_float(u.x), f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z), f[3] = __uint_as_float(u.w);
  }
  static __device__ __forceinline__ void load(const float *src, float (&f)[kE]) {
    unpack(__ldcs(reinterpret_cast<const uint4 *>(src)), f);
  }
  static __device__ __forceinline__ Packed pack(const float (&f)[kE]) {
    return make_uint2(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]));
  }
};
template <> struct RsVec<__nv_bfloat16> {
  static constexpr int kE = 8;
  using Packed = int4;
  static __device__ __forceinline__ void unpack(const uint4 &u, float (&f)[kE]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int h = 0; h < 4; h++) {
      const float2 t = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&w[h]));
      f[2 * h] = t.x, f[2 * h + 1] = t.y;
    }
  }
  static __device__ __forceinline__ void load(const __nv_bfloat16 *src, float (&f)[kE]) {
    unpack(__ldcs(reinterpret_cast<const uint4 *>(src)), f);
  }
  static __device__ __forceinline__ Packed pack(const float (&f)[kE]) {
    return make_int4((int)pack_bf16x2(f[0], f[1]), (int)pack_bf16x2(f[2], f[3]),
                     (int)pack_bf16x2(f[4], f[5]), (int)pack_bf16x2(f[6], f[7]));
  }
};

/* One step of the rank-order chain: acc += y (acc holds partials 0..s-1 summed, y partial s). */
template <int V> __device__ __forceinline__ void chain_add(float (&acc)[V], const float (&y)[V]) {
#pragma unroll
  for (int j = 0; j < V; j++)
    acc[j] = __fadd_rn(acc[j], y[j]);
}

/* v[0] += v[1] + ... + v[world - 1], in rank order from partial 0 (the reference's chain) */
template <int W, int V>
__device__ __forceinline__ void sum_rank_order(float (&v)[W][V], int world) {
#pragma unroll
  for (int s = 1; s < W; s++)
    if (s < world)
      chain_add(v[0], v[s]);
}

/* One 16-byte group of this rank's rows through the low-latency area (signal.cuh), summed in
 * rank order from partial 0: rank s's partial from its words in slot s of this rank's area
 * (`mine`, the call's half), this rank's own from `own` where given (its workspace, or the
 * epilogue's registers), else from its words too. Both users sum here: the swap-AB epilogue that
 * reduces its own rows (gemm_ll.cuh) and ll_reduce_kernel (gemm_rs_unfused.cu). false: a wait
 * failed (recorded in the comm under channel ch); sum is then incomplete. */
template <class P>
__device__ __forceinline__ bool ll_sum_item(const tw_dev_comm_t &dc, int ch, const uint8_t *mine,
                                            uint64_t slot_bytes, uint64_t item, uint64_t items,
                                            uint2 flag, const uint4 *own,
                                            float (&sum)[RsVec<P>::kE]) {
  float x[RsVec<P>::kE];
#pragma unroll 1
  for (int s = 0; s < dc.world; s++) {
    uint4 w;
    if (s == dc.rank && own)
      w = *own;
    else if (!tw_ll_wait_item(dc, ch, mine + (uint64_t)s * slot_bytes, item, items, flag, s, &w))
      return false;
    RsVec<P>::unpack(w, x);
    if (s == 0) {
#pragma unroll
      for (int j = 0; j < RsVec<P>::kE; j++)
        sum[j] = x[j];
    } else {
      chain_add(sum, x); /* sum_rank_order's chain, one partial at a time */
    }
  }
  return true;
}

} // namespace tw
