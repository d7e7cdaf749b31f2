/*
 * Internal (ops layer): launching a fused op's persistent GEMM-core kernel. The kernel runs
 * gemm_cta_loop (src/device/gemm_sm90.cuh): tw::gemm::kThreads threads, one CTA per SM, Smem
 * bytes of dynamic shared memory, whose limit is raised once per device and kernel.
 */
#ifndef TW_OPS_GEMM_LAUNCH_CUH
#define TW_OPS_GEMM_LAUNCH_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_check.h"
#include "gemm_sm90.cuh"

namespace tw {
namespace gemm {

/* set_what / launch_what name the two steps in error messages. */
template <auto Kernel, int Smem, class Params>
tw_status_t launch_persistent(const Params &params, int grid, cudaStream_t stream,
                              const char *set_what, const char *launch_what) {
  static uint64_t configured; /* a bit per device, per kernel */
  tw_status_t st = tw_kernel_smem_once((const void *)Kernel, Smem, &configured, set_what);
  if (st != TW_SUCCESS)
    return st;
  Kernel<<<grid, kThreads, Smem, stream>>>(params);
  return tw_cuda_check(cudaGetLastError(), launch_what);
}

} // namespace gemm
} // namespace tw
#endif
