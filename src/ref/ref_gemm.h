/*
 * GEMM references for tests and tw-bench: C[M,N] = A[M,K] * B[N,K]^T, all row-major, A and B
 * bf16, C bf16 or fp32 (leading dimensions in elements).
 *  - tw_ref_cublas_gemm: cuBLAS (cublasGemmEx, fp32 compute), optionally limited to `sm_count`
 *    SMs (cublasSetSmCountTarget) -- the fair baseline for a GEMM that leaves SMs to comm.
 *  - tw_ref_gemm_fp32: a plain shared-memory-tiled fp32 loop, the tolerance reference.
 */
#ifndef TW_REF_GEMM_H
#define TW_REF_GEMM_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_ref_blas tw_ref_blas_t;

/* A cuBLAS handle (with its own workspace) on the current device. */
tw_status_t tw_ref_blas_create(tw_ref_blas_t **blas);
void tw_ref_blas_destroy(tw_ref_blas_t *blas);

/* sm_count 0: all SMs. c_dtype TW_BF16 or TW_FP32. */
tw_status_t tw_ref_cublas_gemm(tw_ref_blas_t *blas, const void *a, const void *b, void *c,
                               tw_dtype_t c_dtype, int64_t m, int64_t n, int64_t k, int64_t lda,
                               int64_t ldb, int64_t ldc, int sm_count, cudaStream_t stream);

/* C fp32 [m, ldc]. */
tw_status_t tw_ref_gemm_fp32(const void *a, const void *b, float *c, int64_t m, int64_t n,
                             int64_t k, int64_t lda, int64_t ldb, int64_t ldc, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
