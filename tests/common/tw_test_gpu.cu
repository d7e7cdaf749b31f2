#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>

#include "tw_test.h"

static __device__ uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

static __global__ void fill_bf16_kernel(__nv_bfloat16 *dst, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint64_t r = mix64(seed * 0x9E3779B97F4A7C15ULL + i);
    float u = (float)(r >> 40) * (1.0f / 16777216.0f);
    dst[i] = __float2bfloat16(2.0f * u - 1.0f);
  }
}

static __global__ void fill_bytes_kernel(uint8_t *dst, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = (uint8_t)(mix64(seed * 0x9E3779B97F4A7C15ULL + i) >> 56);
}

extern "C" void tw_test_fill_bf16(void *dst, size_t n, uint64_t seed, tw_stream_t stream) {
  fill_bf16_kernel<<<1024, 256, 0, (cudaStream_t)stream>>>((__nv_bfloat16 *)dst, n, seed);
}

extern "C" void tw_test_fill_bytes(void *dst, size_t n, uint64_t seed, tw_stream_t stream) {
  fill_bytes_kernel<<<1024, 256, 0, (cudaStream_t)stream>>>((uint8_t *)dst, n, seed);
}

extern "C" void tw_test_poison(void *dst, size_t bytes, tw_stream_t stream) {
  cudaMemsetAsync(dst, 0xFF, bytes, (cudaStream_t)stream);
}

/* Elements of T that differ between a and b, added to *count. */
template <class T>
static __global__ void count_diff_kernel(const T *a, const T *b, size_t n,
                                         unsigned long long *count) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    local += a[i] != b[i];
  if (local)
    atomicAdd(count, local);
}

extern "C" void tw_test_count_diff_async(const void *a, const void *b, size_t bytes,
                                         unsigned long long *counter, tw_stream_t stream) {
  count_diff_kernel<<<64, 256, 0, (cudaStream_t)stream>>>((const uint32_t *)a, (const uint32_t *)b,
                                                          bytes / 4, counter);
}

extern "C" size_t tw_test_count_diff(const void *a, const void *b, size_t bytes) {
  unsigned long long *count, host = 0;
  cudaMalloc(&count, sizeof(*count));
  cudaMemset(count, 0, sizeof(*count));
  count_diff_kernel<<<1024, 256>>>((const uint8_t *)a, (const uint8_t *)b, bytes, count);
  cudaMemcpy(&host, count, sizeof(host), cudaMemcpyDeviceToHost);
  cudaFree(count);
  return (size_t)host;
}

static __device__ float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }
static __device__ float as_float(float x) { return x; }

template <typename T>
static __global__ void rel_err_kernel(const T *a, const void *ref, int ref_is_fp32,
                                      const float *scale, size_t n, float *max_diff, float *max_ref,
                                      unsigned long long *nans) {
  float md = 0.f, mr = 0.f;
  unsigned long long bad = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float x = as_float(a[i]);
    float r =
        ref_is_fp32 ? ((const float *)ref)[i] : __bfloat162float(((const __nv_bfloat16 *)ref)[i]);
    if (isnan(x) || isinf(x)) {
      bad++;
      continue;
    }
    md = fmaxf(md, fabsf(x - r));
    mr = fmaxf(mr, fabsf(scale ? scale[i] : r));
  }
  // non-negative floats order like their bit patterns
  atomicMax((int *)max_diff, __float_as_int(md));
  atomicMax((int *)max_ref, __float_as_int(mr));
  if (bad)
    atomicAdd(nans, bad);
}

template <typename T>
static double rel_err(const T *a, const void *ref, int ref_is_fp32, const float *scale, size_t n,
                      size_t *nan_count) {
  float *stats;
  unsigned long long *nans;
  float host[2] = {0, 0};
  unsigned long long host_nans = 0;
  cudaMalloc(&stats, 2 * sizeof(float));
  cudaMalloc(&nans, sizeof(*nans));
  cudaMemset(stats, 0, 2 * sizeof(float));
  cudaMemset(nans, 0, sizeof(*nans));
  rel_err_kernel<<<1024, 256>>>(a, ref, ref_is_fp32, scale, n, stats, stats + 1, nans);
  cudaMemcpy(host, stats, sizeof(host), cudaMemcpyDeviceToHost);
  cudaMemcpy(&host_nans, nans, sizeof(host_nans), cudaMemcpyDeviceToHost);
  cudaFree(stats);
  cudaFree(nans);
  if (nan_count)
    *nan_count = (size_t)host_nans;
  return host[1] > 0 ? (double)host[0] / (double)host[1] : (double)host[0];
}

extern "C" double tw_test_rel_err_bf16_scaled(const void *a, const void *ref, int ref_is_fp32,
                                              const float *scale, size_t n, size_t *nan_count) {
  return rel_err((const __nv_bfloat16 *)a, ref, ref_is_fp32, scale, n, nan_count);
}

extern "C" double tw_test_rel_err_bf16(const void *a, const void *ref, int ref_is_fp32, size_t n,
                                       size_t *nan_count) {
  return tw_test_rel_err_bf16_scaled(a, ref, ref_is_fp32, NULL, n, nan_count);
}

extern "C" double tw_test_rel_err_fp32(const float *a, const float *ref, size_t n,
                                       size_t *nan_count) {
  return rel_err(a, ref, 1, NULL, n, nan_count);
}

extern "C" struct CUgraphExec_st *tw_test_capture(struct CUstream_st **streams, int n,
                                                  void (*prologue)(void *ctx),
                                                  void (*fn)(void *ctx), void *ctx) {
  cudaEvent_t fork, join[TW_MAX_WORLD];
  cudaGraph_t graph;
  cudaGraphExec_t exec = NULL;
  cudaStream_t s0 = (cudaStream_t)streams[0];
  cudaError_t e = cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
  for (int r = 1; r < n && e == cudaSuccess; r++)
    e = cudaEventCreateWithFlags(&join[r], cudaEventDisableTiming);
  if (e == cudaSuccess)
    e = cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal);
  if (e == cudaSuccess && prologue)
    prologue(ctx);
  if (e == cudaSuccess)
    e = cudaEventRecord(fork, s0);
  for (int r = 1; r < n && e == cudaSuccess; r++)
    e = cudaStreamWaitEvent(streams[r], fork, 0);
  if (e == cudaSuccess)
    fn(ctx);
  for (int r = 1; r < n && e == cudaSuccess; r++) {
    e = cudaEventRecord(join[r], streams[r]);
    if (e == cudaSuccess)
      e = cudaStreamWaitEvent(s0, join[r], 0);
  }
  if (e == cudaSuccess)
    e = cudaStreamEndCapture(s0, &graph);
  if (e == cudaSuccess) {
    e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
  }
  if (e != cudaSuccess) {
    fprintf(stderr, "FATAL tw_test_capture: %s\n", cudaGetErrorString(e));
    exit(1);
  }
  cudaEventDestroy(fork);
  for (int r = 1; r < n; r++)
    cudaEventDestroy(join[r]);
  return (struct CUgraphExec_st *)exec;
}
