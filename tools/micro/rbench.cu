/* tw-rbench: how fast one CTA of the fused ops' reduction can go, alone and beside a GEMM.
 *
 * C CTAs (4 or 8) each reduce 24 units of two fp32 slabs into bf16 (the work unit of tw_gemm_rs's
 * reduce CTAs: 128 rows x 256 columns, row stride n = 12288 floats; 320 KiB moved a unit), first
 * alone, then on a second stream beside three tw_gemm calls of flux-tp8's GEMM (M=4096 N=12288
 * K=6144, fp32 out) on the other 132 - C SMs. Variants: 16-byte register loads, 8 items in flight
 * a thread, no division an item (16 spilled, and measured 90 / 76 GB/s); the same with
 * tw_gemm_rs's claim of each unit (queue atomic, count acquire and reset, two CTA barriers); 2-D
 * TMA boxes of 16 or 8 rows; the register loop with the per-item division and 64-bit remainder
 * tw_gemm_rs had before ItemWalk; the register loop in a CTA holding 200 KiB of shared memory,
 * as the fused kernel's CTAs do (the L1 left beside it), with ld.global.cs, .cg and
 * L1::no_allocate loads and with 4 items in flight; and .cg / L1::no_allocate without shared
 * memory. Prints GB/s a CTA. RB_RANDOM=1: random operands (else zeros). Twenty-fifth session,
 * H200, random operands, 4 CTAs (docs/PERF.md): alone 94 / 69 / 84 / 58 GB/s (registers,
 * claimed, TMA 16 rows, divisions), beside the GEMM 74 / 54 / 72 / 38; a 1-D bulk copy a 1 KiB
 * row, since dropped from here, 31 / 28. Twenty-sixth session: with 200 KiB of shared memory the
 * register loop 71-75 alone and 41-43 beside the GEMM, .cg 85 / 46, L1::no_allocate 102 / 46; the
 * division row (one loop with a switch since the review mend) no longer reproduces 58 / 38 (90-98
 * / 61-66). Not a test: run it by hand. */
#include "device/ptx_sm90.cuh"
#include "micro.h"
#include "tilewire.h"
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda.h>
#include <cuda_bf16.h>

constexpr int kRows = 128, kCols = 256;

__device__ __forceinline__ uint32_t pack(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t *>(&h);
}

// The 16-byte load of the register path: 0 ld.global.cs (what tw_gemm_rs's reduction uses), 1
// ld.global.cg (L2 only), 2 ld.global.L1::no_allocate with an L2 evict-first policy (not .nc: the
// fused kernel's partials are written while it runs).
template <int kLoad> __device__ __forceinline__ float4 ld16(const float *p) {
  if constexpr (kLoad == 1)
    return __ldcg(reinterpret_cast<const float4 *>(p));
  if constexpr (kLoad == 2) {
    float4 v;
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p), "l"(policy));
    return v;
  }
  return __ldcs(reinterpret_cast<const float4 *>(p));
}

// Register path: one unit, kIn items in flight per thread per slab. kDivide: the items' vectors
// a runtime count (a 32-bit division and remainder an item) and the store's row and column from
// the 64-bit offset (a 64-bit one), as tw_gemm_rs's reduce_unit did before ItemWalk; else no
// division an item (the count a power of two known at compile time).
template <int kIn, bool kDivide, int kLoad = 0>
__device__ __forceinline__ void reg_unit(const float *s0, const float *s1, __nv_bfloat16 *out,
                                         int n, int u, int col_units, int cols) {
  const int r0 = (u / col_units) * kRows, c0 = (u % col_units) * kCols;
  const int vecs = (kDivide ? cols : kCols) / 4, items = kRows * vecs;
  for (int base = threadIdx.x; base < items; base += kIn * blockDim.x) {
    float4 a[kIn], b[kIn];
    size_t off[kIn];
#pragma unroll
    for (int j = 0; j < kIn; j++) {
      int i = min(base + j * (int)blockDim.x, items - 1);
      off[j] = (size_t)(r0 + i / vecs) * n + c0 + 4 * (i % vecs);
      a[j] = ld16<kLoad>(s0 + off[j]);
    }
#pragma unroll
    for (int j = 0; j < kIn; j++)
      b[j] = ld16<kLoad>(s1 + off[j]);
#pragma unroll
    for (int j = 0; j < kIn; j++) {
      if (base + j * (int)blockDim.x >= items)
        break;
      const size_t at = kDivide ? (size_t)(off[j] / (size_t)n) * n + off[j] % (size_t)n : off[j];
      uint2 p = make_uint2(pack(a[j].x + b[j].x, a[j].y + b[j].y),
                           pack(a[j].z + b[j].z, a[j].w + b[j].w));
      __stcs(reinterpret_cast<uint2 *>(out + at), p);
    }
  }
}

template <bool kDivide, int kLoad = 0, int kIn = 8>
__global__ void __launch_bounds__(384)
    reg_kernel(const float *s0, const float *s1, __nv_bfloat16 *out, int n, int units_per_cta,
               int col_units, int cols) {
  for (int k = 0; k < units_per_cta; k++)
    reg_unit<kIn, kDivide, kLoad>(s0, s1, out, n, blockIdx.x * units_per_cta + k, col_units, cols);
}

// The register path with tw_gemm_rs's claim of each unit: thread 0 takes the next unit from a
// queue (atomicAdd), reads its count with ld.acquire.sys (already complete), resets it, and
// the CTA meets at a barrier before and after.
__global__ void __launch_bounds__(384)
    claim_kernel(const float *s0, const float *s1, __nv_bfloat16 *out, int n, int units,
                 int col_units, unsigned *queue, unsigned long long *counts) {
  __shared__ int s_u;
  for (;;) {
    __syncthreads();
    if (threadIdx.x == 0) {
      int u = (int)atomicAdd(queue, 1u);
      if (u < units) {
        unsigned long long v;
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(counts + u) : "memory");
        if (v < 2)
          u = units;
        *(volatile unsigned long long *)(counts + u) = 2; /* the reset's store (kept complete) */
      }
      s_u = u;
    }
    __syncthreads();
    if (s_u >= units)
      break;
    reg_unit<8, false>(s0, s1, out, n, s_u, col_units, kCols);
  }
}

using namespace tw::ptx;

__device__ __forceinline__ void bar_wait(uint64_t *bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// Warps 1..11 of the shared-memory paths: sum each chunk of both slabs and store it.
template <int NB>
__device__ __forceinline__ void sum_chunks(const uint8_t *smem, uint64_t *full, uint64_t *empty,
                                           __nv_bfloat16 *out, int n, int units_per_cta,
                                           int col_units, int rows) {
  const int chunk_bytes = 2 * rows * kCols * 4, chunks = units_per_cta * (kRows / rows);
  const int t = threadIdx.x - 32, lane = threadIdx.x % 32;
  for (int q = 0; q < chunks; q++) {
    const int b = q % NB;
    bar_wait(&full[b], (q / NB) & 1);
    const int u = blockIdx.x * units_per_cta + q / (kRows / rows);
    const int r0 = (u / col_units) * kRows + (q % (kRows / rows)) * rows,
              c0 = (u % col_units) * kCols;
    const float4 *buf = reinterpret_cast<const float4 *>(smem + (size_t)b * chunk_bytes);
    const int items = rows * (kCols / 4);
    for (int i = t; i < items; i += 352) {
      float4 a = buf[i], c = buf[items + i];
      const int row = i / (kCols / 4), col = 4 * (i % (kCols / 4));
      uint2 p = make_uint2(pack(a.x + c.x, a.y + c.y), pack(a.z + c.z, a.w + c.w));
      __stcs(reinterpret_cast<uint2 *>(out + (size_t)(r0 + row) * n + c0 + col), p);
    }
    __syncwarp();
    if (lane == 0)
      mbar_arrive(&empty[b]);
  }
}

// 2-D TMA path: warp 0's lane 0 loads one box a slab a chunk (256 columns x rows rows) into
// NB buffers; warps 1..11 sum and store.
template <int NB>
__global__ void __launch_bounds__(384)
    tma_kernel(const __grid_constant__ CUtensorMap m0, const __grid_constant__ CUtensorMap m1,
               __nv_bfloat16 *out, int n, int units_per_cta, int col_units, int rows) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t full[NB], empty[NB];
  const int chunk_bytes = 2 * rows * kCols * 4;
  if (threadIdx.x == 0) {
    for (int b = 0; b < NB; b++)
      mbar_init(&full[b], 1), mbar_init(&empty[b], 11);
    mbar_init_fence();
  }
  __syncthreads();
  const int chunks = units_per_cta * (kRows / rows);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 0) {
    if (lane == 0)
      for (int q = 0; q < chunks; q++) {
        const int b = q % NB;
        if (q >= NB)
          bar_wait(&empty[b], (q / NB - 1) & 1);
        const int u = blockIdx.x * units_per_cta + q / (kRows / rows);
        const int r0 = (u / col_units) * kRows + (q % (kRows / rows)) * rows,
                  c0 = (u % col_units) * kCols;
        mbar_arrive_expect_tx(&full[b], chunk_bytes);
        uint8_t *buf = smem + (size_t)b * chunk_bytes;
        tma_load_2d(buf, &m0, &full[b], c0, r0);
        tma_load_2d(buf + chunk_bytes / 2, &m1, &full[b], c0, r0);
      }
  } else {
    sum_chunks<NB>(smem, full, empty, out, n, units_per_cta, col_units, rows);
  }
}

__global__ void fill_kernel(__nv_bfloat16 *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t x = (uint32_t)i * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = __float2bfloat16(((int)(x & 0xffff) - 32768) * (1.0f / 32768));
  }
}
static CUtensorMap make_map(const float *base, int m, int n, int rows) {
  CUtensorMap map;
  cuuint64_t dims[2] = {(cuuint64_t)n, (cuuint64_t)m};
  cuuint64_t strides[1] = {(cuuint64_t)n * 4};
  cuuint32_t box[2] = {256, (cuuint32_t)rows};
  cuuint32_t es[2] = {1, 1};
  CUresult r =
      cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, (void *)base, dims, strides,
                             box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    printf("cuTensorMapEncodeTiled: %d\n", (int)r);
    exit(1);
  }
  return map;
}

int main() {
  const int m = 4096, n = 12288, k = 6144;
  const int col_units = n / kCols;
  float *s0, *s1, *c;
  __nv_bfloat16 *out, *a, *b;
  CK(cudaMalloc(&s0, (size_t)m * n * 4));
  CK(cudaMalloc(&s1, (size_t)m * n * 4));
  CK(cudaMalloc(&out, (size_t)m * n * 2));
  CK(cudaMalloc(&c, (size_t)m * n * 4));
  CK(cudaMalloc(&a, (size_t)m * k * 2));
  CK(cudaMalloc(&b, (size_t)n * k * 2));
  CK(cudaMemset(s0, 0, (size_t)m * n * 4));
  CK(cudaMemset(s1, 0, (size_t)m * n * 4));
  const int rnd = getenv("RB_RANDOM") != NULL;
  CK(cudaMemset(a, 0, (size_t)m * k * 2));
  CK(cudaMemset(b, 0, (size_t)n * k * 2));
  if (rnd) {
    fill_kernel<<<1024, 256>>>(a, (size_t)m * k, 1);
    fill_kernel<<<1024, 256>>>(b, (size_t)n * k, 2);
    fill_kernel<<<1024, 256>>>((__nv_bfloat16 *)s0, (size_t)m * n * 2, 3);
    fill_kernel<<<1024, 256>>>((__nv_bfloat16 *)s1, (size_t)m * n * 2, 4);
    CK(cudaDeviceSynchronize());
  }
  printf("GEMM operands %s\n", rnd ? "random" : "zero");
  cudaStream_t sg, sr;
  CK(cudaStreamCreateWithFlags(&sg, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&sr, cudaStreamNonBlocking));
  cudaEvent_t e0, e1, g0, g1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventCreate(&g0));
  CK(cudaEventCreate(&g1));
  const double unit_bytes = kRows * kCols * (4.0 * 2 + 2);
  CK(cudaFuncSetAttribute(reg_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          200 * 1024));
  CK(cudaFuncSetAttribute(reg_kernel<false, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          200 * 1024));
  CK(cudaFuncSetAttribute(reg_kernel<false, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          200 * 1024));
  CK(cudaFuncSetAttribute(reg_kernel<false, 0, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          200 * 1024));
  CK(cudaFuncSetAttribute(tma_kernel<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  CK(cudaFuncSetAttribute(tma_kernel<12>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  const CUtensorMap m0 = make_map(s0, m, n, 16), m1 = make_map(s1, m, n, 16);
  const CUtensorMap q0 = make_map(s0, m, n, 8), q1 = make_map(s1, m, n, 8);
  tw_gemm_args_t g = TW_GEMM_ARGS_INIT;
  g.c_dtype = TW_FP32;
  g.a = a;
  g.b = b;
  g.c = c;
  g.m = m;
  g.n = n;
  g.k = k;
  unsigned *queue;
  unsigned long long *counts;
  CK(cudaMalloc(&queue, sizeof(unsigned)));
  CK(cudaMalloc(&counts, 4096 * sizeof(unsigned long long)));
  {
    unsigned long long two[4096];
    for (int i = 0; i < 4096; i++)
      two[i] = 2;
    CK(cudaMemcpy(counts, two, sizeof(two), cudaMemcpyHostToDevice));
  }
  const char *names[] = {"registers 8",
                         "registers, claimed a unit",
                         "tma 2-D 6x32K (16 rows)",
                         "tma 2-D 12x16K (8 rows)",
                         "division per item",
                         "registers, 200 KiB smem",
                         "ld.cg, 200 KiB smem",
                         "L1::no_allocate, 200 KiB",
                         "4 in flight, 200 KiB smem",
                         "ld.cg",
                         "L1::no_allocate"};
  const int nvariants = (int)(sizeof(names) / sizeof(names[0]));
  for (int with_gemm = 0; with_gemm < 2; with_gemm++)
    for (int ctas = 4; ctas <= 8; ctas += 4) {
      const int per = 24;
      g.sm_count = 132 - ctas;
      for (int v = 0; v < nvariants; v++) {
        float best = 1e30f, gms = 0;
        for (int rep = 0; rep < 5; rep++) {
          if (with_gemm) {
            CK(cudaEventRecord(g0, sg));
            for (int i = 0; i < 3; i++)
              if (tw_gemm(&g, (tw_stream_t)sg) != TW_SUCCESS) {
                printf("tw_gemm: %s\n", tw_last_error());
                return 1;
              }
            CK(cudaEventRecord(g1, sg));
          }
          if (v == 1)
            CK(cudaMemsetAsync(queue, 0, sizeof(unsigned), sr));
          CK(cudaEventRecord(e0, sr));
          if (v == 1)
            claim_kernel<<<ctas, 384, 0, sr>>>(s0, s1, out, n, per * ctas, col_units, queue,
                                               counts);
          if (v == 0)
            reg_kernel<false><<<ctas, 384, 0, sr>>>(s0, s1, out, n, per, col_units, kCols);
          if (v == 2)
            tma_kernel<6><<<ctas, 384, 6 * 32768, sr>>>(m0, m1, out, n, per, col_units, 16);
          if (v == 3)
            tma_kernel<12><<<ctas, 384, 12 * 16384, sr>>>(q0, q1, out, n, per, col_units, 8);
          if (v == 4)
            reg_kernel<true><<<ctas, 384, 0, sr>>>(s0, s1, out, n, per, col_units, kCols);
          if (v == 5) /* the fused kernel's shared-memory carveout, unused: what L1 is left */
            reg_kernel<false><<<ctas, 384, 200 * 1024, sr>>>(s0, s1, out, n, per, col_units, kCols);
          if (v == 6)
            reg_kernel<false, 1>
                <<<ctas, 384, 200 * 1024, sr>>>(s0, s1, out, n, per, col_units, kCols);
          if (v == 7)
            reg_kernel<false, 2>
                <<<ctas, 384, 200 * 1024, sr>>>(s0, s1, out, n, per, col_units, kCols);
          if (v == 8)
            reg_kernel<false, 0, 4>
                <<<ctas, 384, 200 * 1024, sr>>>(s0, s1, out, n, per, col_units, kCols);
          if (v == 9)
            reg_kernel<false, 1><<<ctas, 384, 0, sr>>>(s0, s1, out, n, per, col_units, kCols);
          if (v == 10)
            reg_kernel<false, 2><<<ctas, 384, 0, sr>>>(s0, s1, out, n, per, col_units, kCols);
          CK(cudaEventRecord(e1, sr));
          CK(cudaDeviceSynchronize());
          float ms;
          CK(cudaEventElapsedTime(&ms, e0, e1));
          if (ms < best)
            best = ms;
          if (with_gemm)
            CK(cudaEventElapsedTime(&gms, g0, g1));
        }
        CK(cudaGetLastError());
        const double bytes = unit_bytes * per * ctas;
        printf("%s ctas %d %-26s %.3f ms %.1f GB/s per CTA%s",
               with_gemm ? "beside 3 GEMMs" : "alone         ", ctas, names[v], best,
               bytes / best * 1e-6 / ctas, with_gemm ? "" : "\n");
        if (with_gemm)
          printf("  (3 GEMMs %.3f ms)\n", gms);
      }
    }
  return 0;
}
