/*
 * CTA-wide bulk copy for communication roles: 16-byte vectors, 4 loads
 * in flight per thread before the first store. bytes and both pointers are
 * multiples of 16. Peer pointers (NVLink or, for virtual ranks, the same HBM)
 * are written with plain stores; publish them with a CTA barrier then
 * tw_signal_set (signal.cuh).
 * A copy CTA's rate is bounded by its bytes in flight over the loads' latency
 * (Little's law): 384 threads x 4 x 16 B = 24 KiB in flight. More loads in flight per
 * thread do not speed up tw_ag_gemm's copy CTAs.
 */
#ifndef TW_DEVICE_COPY_CUH
#define TW_DEVICE_COPY_CUH

#include <stdint.h>

static __device__ __forceinline__ void tw_cta_copy(void *dst, const void *src, size_t bytes) {
  constexpr int kUnroll = 4;
  const int4 *s = (const int4 *)src;
  int4 *d = (int4 *)dst;
  const size_t n = bytes / 16;
  const size_t step = (size_t)blockDim.x;
  size_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * step < n; i += kUnroll * step) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; u++)
      v[u] = __ldcs(s + i + u * step); /* streamed: read once */
#pragma unroll
    for (int u = 0; u < kUnroll; u++)
      d[i + u * step] = v[u];
  }
  for (; i < n; i += step)
    d[i] = __ldcs(s + i);
}

#endif
