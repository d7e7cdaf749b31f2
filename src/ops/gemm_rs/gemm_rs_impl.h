/*
 * Internal: what the files of tw_gemm_rs / tw_gemm_ar share. gemm_rs.cu (the entry points,
 * argument checks and plan) calls the fused kernel's host side (gemm_rs_fused.cu) and the
 * unfused pipeline (gemm_rs_unfused.cu) through these declarations; each of those files holds
 * the only instantiations of its kernels, and contributes its piece of the op's preload.
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stddef.h>

#include "ops/gemm_rs/gemm_rs.h"
#include "runtime/comm.h"

namespace tw {
namespace rs {

constexpr int kMaxWorld = TW_GEMM_RS_MAX_WORLD;

/* The fused kernel (gemm_rs_fused.cu) and the unfused pipeline (gemm_rs_unfused.cu) for
 * P = float and __nv_bfloat16 partials, explicitly instantiated there; `stream` is the rank's
 * launch stream. */
template <class P>
tw_status_t run_fused(tw_comm_t comm, const tw_gemm_rs_args_t &a, const tw_gemm_rs_plan_t &plan,
                      int all_reduce, cudaStream_t stream);
template <class P>
tw_status_t run_unfused(tw_comm_t comm, const tw_gemm_rs_args_t &a, const tw_gemm_rs_plan_t &plan,
                        int all_reduce, cudaStream_t stream);

/* Across nodes (gemm_rs_rail.cu): plan.rail; plan.unfused there is tw_gemm, then the rail
 * kernel copying its partial. */
template <class P>
tw_status_t run_rail(tw_comm_t comm, const tw_gemm_rs_args_t &a, const tw_gemm_rs_plan_t &plan,
                     int all_reduce, cudaStream_t stream);

/* The args' a x b^T by tw_gemm's core on the comm's SM budget, into c (c_dtype, row stride
 * ldc): world 1's whole op, and the unfused pipeline's partial across nodes (gemm_rs.cu). */
tw_status_t plain_gemm(tw_comm_t comm, const tw_gemm_rs_args_t &a, void *c, tw_dtype_t c_dtype,
                       int64_t ldc, cudaStream_t stream);

/* Loads the kernels each file launches on the current device (the op's preload). */
cudaError_t preload_fused();
cudaError_t preload_unfused();
cudaError_t preload_rail();

/* Loads `count` kernels (their host stubs) on the current device; the first failure. */
inline cudaError_t load_kernels(const void *const *kernels, size_t count) {
  cudaFuncAttributes attr;
  cudaError_t e = cudaSuccess;
  for (size_t i = 0; i < count && e == cudaSuccess; i++)
    e = cudaFuncGetAttributes(&attr, kernels[i]);
  return e;
}

} // namespace rs
} // namespace tw
