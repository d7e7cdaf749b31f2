#include "ref/ref_gemm.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* Not tw_fail: it is internal to libtilewire, which exports tw_* API calls only. */
static tw_status_t ref_fail(tw_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "tw_ref: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  return status;
}

struct tw_ref_blas {
  cublasHandle_t handle;
  void *workspace;
  size_t workspace_bytes;
};

static tw_status_t blas_check(cublasStatus_t s, const char *what) {
  if (s == CUBLAS_STATUS_SUCCESS)
    return TW_SUCCESS;
  return ref_fail(TW_ERR_CUDA, "%s: %s (%s)", what, cublasGetStatusName(s),
                  cublasGetStatusString(s));
}

extern "C" tw_status_t tw_ref_blas_create(tw_ref_blas_t **out) {
  tw_ref_blas_t *blas = (tw_ref_blas_t *)calloc(1, sizeof(*blas));
  if (!blas)
    return ref_fail(TW_ERR_OUT_OF_MEMORY, "tw_ref_blas_create: calloc");
  tw_status_t st = blas_check(cublasCreate(&blas->handle), "cublasCreate");
  if (st != TW_SUCCESS) {
    free(blas);
    return st;
  }
  blas->workspace_bytes = 32u << 20;
  if (cudaMalloc(&blas->workspace, blas->workspace_bytes) != cudaSuccess) {
    cublasDestroy(blas->handle);
    free(blas);
    return ref_fail(TW_ERR_OUT_OF_MEMORY, "tw_ref_blas_create: cudaMalloc(workspace)");
  }
  *out = blas;
  return TW_SUCCESS;
}

extern "C" void tw_ref_blas_destroy(tw_ref_blas_t *blas) {
  if (!blas)
    return;
  cudaFree(blas->workspace);
  cublasDestroy(blas->handle);
  free(blas);
}

extern "C" tw_status_t tw_ref_cublas_gemm(tw_ref_blas_t *blas, const void *a, const void *b,
                                          void *c, tw_dtype_t c_dtype, int64_t m, int64_t n,
                                          int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                                          int sm_count, cudaStream_t stream) {
  tw_status_t st;
  if ((st = blas_check(cublasSetStream(blas->handle, stream), "cublasSetStream")) != TW_SUCCESS)
    return st;
  if ((st = blas_check(cublasSetWorkspace(blas->handle, blas->workspace, blas->workspace_bytes),
                       "cublasSetWorkspace")) != TW_SUCCESS)
    return st;
  if ((st = blas_check(cublasSetSmCountTarget(blas->handle, sm_count), "cublasSetSmCountTarget")) !=
      TW_SUCCESS)
    return st;
  const float alpha = 1.f, beta = 0.f;
  // Row-major C[M,N] is column-major C^T[N,M] = B * A^T: B (column-major [K,N]) transposed,
  // A (column-major [K,M]) as is. Both operands K-major: cuBLAS's "TN" case.
  return blas_check(cublasGemmEx(blas->handle, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)m, (int)k,
                                 &alpha, b, CUDA_R_16BF, (int)ldb, a, CUDA_R_16BF, (int)lda, &beta,
                                 c, c_dtype == TW_FP32 ? CUDA_R_32F : CUDA_R_16BF, (int)ldc,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                    "cublasGemmEx");
}

// One 16x16 output block per CTA, K in 16-wide slices through shared memory.
static __global__ void ref_gemm_fp32_kernel(const __nv_bfloat16 *a, const __nv_bfloat16 *b,
                                            float *c, int64_t m, int64_t n, int64_t k, int64_t lda,
                                            int64_t ldb, int64_t ldc) {
  __shared__ float as[16][17], bs[16][17];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t row = blockIdx.y * 16 + ty, col = blockIdx.x * 16 + tx;
  float acc = 0.f;
  for (int64_t k0 = 0; k0 < k; k0 += 16) {
    const int64_t ar = blockIdx.y * 16 + ty, br = blockIdx.x * 16 + ty;
    as[ty][tx] = (ar < m && k0 + tx < k) ? __bfloat162float(a[ar * lda + k0 + tx]) : 0.f;
    bs[ty][tx] = (br < n && k0 + tx < k) ? __bfloat162float(b[br * ldb + k0 + tx]) : 0.f;
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 16; kk++)
      acc += as[ty][kk] * bs[tx][kk];
    __syncthreads();
  }
  if (row < m && col < n)
    c[row * ldc + col] = acc;
}

extern "C" tw_status_t tw_ref_gemm_fp32(const void *a, const void *b, float *c, int64_t m,
                                        int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                                        cudaStream_t stream) {
  dim3 grid((unsigned)((n + 15) / 16), (unsigned)((m + 15) / 16)), block(16, 16);
  ref_gemm_fp32_kernel<<<grid, block, 0, stream>>>(
      (const __nv_bfloat16 *)a, (const __nv_bfloat16 *)b, c, m, n, k, lda, ldb, ldc);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ref_fail(TW_ERR_CUDA, "tw_ref_gemm_fp32: launch: %s", cudaGetErrorString(err));
  return TW_SUCCESS;
}
