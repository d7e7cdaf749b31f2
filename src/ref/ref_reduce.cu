#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ref/ref_collectives.h"
#include "ref/ref_reduce.h"

namespace {

constexpr int kMaxWorld = 64;
constexpr int kThreads = 512;

struct Sources {
  const void *p[kMaxWorld];
};
struct Dests {
  __nv_bfloat16 *p[kMaxWorld];
};

__device__ __forceinline__ float4 load4(const float *p) {
  return __ldcg(reinterpret_cast<const float4 *>(p));
}
__device__ __forceinline__ float4 load4(const __nv_bfloat16 *p) {
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(p));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(p + 2));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

/* Rows [row0, row0 + rows) of the rank-ordered sum of P partials, written to ndst outputs at
 * out_row0. */
template <class P>
__global__ void __launch_bounds__(kThreads)
    reduce_rows_kernel(Sources src, int world, Dests dst, int ndst, int64_t row0, int64_t rows,
                       int64_t out_row0, int64_t n, int64_t ldo) {
  const int64_t quads = n / 4, items = rows * quads;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < items;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / quads, c = 4 * (i % quads);
    const size_t off = (size_t)(row0 + r) * n + c;
    float4 acc = load4(static_cast<const P *>(src.p[0]) + off);
    for (int s = 1; s < world; s++) {
      const float4 v = load4(static_cast<const P *>(src.p[s]) + off);
      acc.x = __fadd_rn(acc.x, v.x);
      acc.y = __fadd_rn(acc.y, v.y);
      acc.z = __fadd_rn(acc.z, v.z);
      acc.w = __fadd_rn(acc.w, v.w);
    }
    __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x, acc.y);
    __nv_bfloat162 hi = __floats2bfloat162_rn(acc.z, acc.w);
    uint2 packed;
    packed.x = *reinterpret_cast<uint32_t *>(&lo);
    packed.y = *reinterpret_cast<uint32_t *>(&hi);
    for (int d = 0; d < ndst; d++)
      *reinterpret_cast<uint2 *>(dst.p[d] + (out_row0 + r) * ldo + c) = packed;
  }
}

cudaError_t reduce_rank(int world, int r, const void *const *src_peers, int partial_bytes,
                        void *const *outs, int all_reduce, int64_t m, int64_t n, int64_t ldo,
                        int max_ctas, cudaStream_t stream) {
  if (world < 1 || world > kMaxWorld || r < 0 || r >= world || m % world || n % 4 ||
      (partial_bytes != 2 && partial_bytes != 4))
    return cudaErrorInvalidValue;
  const int64_t m_local = m / world;
  const int64_t items = m_local * (n / 4);
  int64_t grid = (items + kThreads - 1) / kThreads;
  const int cap = max_ctas > 0 ? max_ctas : 132;
  if (grid > cap)
    grid = cap;
  if (grid < 1)
    grid = 1;
  Sources src;
  Dests dst;
  for (int s = 0; s < world; s++)
    src.p[s] = src_peers[s];
  const int ndst = all_reduce ? world : 1;
  for (int p = 0; p < ndst; p++)
    dst.p[p] = (__nv_bfloat16 *)outs[p];
  auto kernel = partial_bytes == 2 ? reduce_rows_kernel<__nv_bfloat16> : reduce_rows_kernel<float>;
  kernel<<<(unsigned)grid, kThreads, 0, stream>>>(src, world, dst, ndst, r * m_local, m_local,
                                                  all_reduce ? r * m_local : 0, n, ldo);
  return cudaGetLastError();
}

cudaError_t reduce(int world, const void *const *partial_peers, int partial_bytes,
                   void *const *outs, int all_reduce, int64_t m, int64_t n, int64_t ldo,
                   int max_ctas, cudaStream_t *streams, cudaEvent_t *events) {
  if (world < 1 || world > kMaxWorld || m % world || n % 4)
    return cudaErrorInvalidValue;
  cudaError_t err = tw_ref_cross_wait(world, streams, events);
  for (int r = 0; r < world && err == cudaSuccess; r++)
    err = reduce_rank(world, r, partial_peers + r * world, partial_bytes,
                      all_reduce ? outs + r * world : outs + r, all_reduce, m, n, ldo, max_ctas,
                      streams[r]);
  if (err == cudaSuccess)
    err = tw_ref_cross_wait(world, streams, events);
  return err;
}

} // namespace

extern "C" cudaError_t tw_ref_reduce_scatter(int world, const void *const *partial_peers,
                                             int partial_bytes, void *const *out, int64_t m,
                                             int64_t n, int64_t ldo, int max_ctas,
                                             cudaStream_t *streams, cudaEvent_t *events) {
  return reduce(world, partial_peers, partial_bytes, out, 0, m, n, ldo, max_ctas, streams, events);
}

extern "C" cudaError_t tw_ref_reduce_rank(int world, int rank, const void *const *partial_peers,
                                          int partial_bytes, void *const *outs, int all_reduce,
                                          int64_t m, int64_t n, int64_t ldo, int max_ctas,
                                          cudaStream_t stream) {
  return reduce_rank(world, rank, partial_peers, partial_bytes, outs, all_reduce, m, n, ldo,
                     max_ctas, stream);
}

extern "C" cudaError_t tw_ref_all_reduce(int world, const void *const *partial_peers,
                                         int partial_bytes, void *const *out_peers, int64_t m,
                                         int64_t n, int64_t ldo, int max_ctas,
                                         cudaStream_t *streams, cudaEvent_t *events) {
  return reduce(world, partial_peers, partial_bytes, out_peers, 1, m, n, ldo, max_ctas, streams,
                events);
}

namespace {
__global__ void to_bf16_kernel(const float *src, __nv_bfloat16 *dst, int64_t rows, int64_t n,
                               int64_t ldo) {
  const int64_t items = rows * n;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < items;
       i += (int64_t)gridDim.x * blockDim.x)
    dst[(i / n) * ldo + i % n] = __float2bfloat16_rn(src[i]);
}
} // namespace

extern "C" cudaError_t tw_ref_nccl_reduce_fp32(tw_ref_nccl_t *nccl, int world, const int *devices,
                                               const float *const *partial, float *const *scratch,
                                               void *const *out, int all_reduce, int64_t m,
                                               int64_t n, int64_t ldo, cudaStream_t *streams) {
  const int64_t rows = all_reduce ? m : m / world;
  const size_t count = (size_t)(m * n);
  const void *const *send = (const void *const *)partial;
  void *const *recv = (void *const *)scratch;
  int rc = all_reduce ? tw_ref_nccl_all_reduce(nccl, send, recv, count, 0, streams)
                      : tw_ref_nccl_reduce_scatter(nccl, send, recv, count, 0, streams);
  if (rc != 0)
    return cudaErrorUnknown;
  cudaError_t err = cudaSuccess;
  for (int r = 0; r < world && err == cudaSuccess; r++) {
    err = cudaSetDevice(devices[r]);
    if (err == cudaSuccess) {
      to_bf16_kernel<<<264, 512, 0, streams[r]>>>(scratch[r], (__nv_bfloat16 *)out[r], rows, n,
                                                  ldo);
      err = cudaGetLastError();
    }
  }
  return err;
}
