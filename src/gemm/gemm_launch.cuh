/*
 * Internal (ops layer): the host side of a GEMM-core kernel (src/gemm/gemm_sm90.cuh), for
 * tw_gemm and the fused ops. The operand tensor maps (A, B and a stored output, in the boxes
 * the core expects), and launching a fused op's persistent kernel: tw::gemm::kThreads threads,
 * one CTA per SM, Smem bytes of dynamic shared memory, whose limit is raised once per device
 * and kernel.
 */
#ifndef TW_OPS_GEMM_LAUNCH_CUH
#define TW_OPS_GEMM_LAUNCH_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gemm/gemm_sm90.cuh"
#include "gemm/tma_map.h"
#include "runtime/cuda_check.h"

extern "C" {
#include "core/env.h"
}

namespace tw {
namespace gemm {

/* GemmParams::mbar_timeout_ns of a fused op: above the flag bound (TW_WAIT_TIMEOUT_MS) that a
 * producer's readiness hook may spend before a tile's loads, plus a tile. The fused ops' hooks
 * report an expired pipeline wait with tw_pipeline_stall (src/device/signal.cuh). */
inline uint64_t fused_mbar_timeout_ns(uint64_t flag_timeout_ns) {
  return 2 * flag_timeout_ns + 10ull * 1000 * 1000 * 1000;
}

/* Programmatic dependent launch: the attribute that lets a kernel start once every CTA of the
 * kernel before it in the stream has issued griddepcontrol.launch_dependents (or ended); the
 * dependent waits for that kernel in griddepcontrol.wait before it reads its output. */
inline cudaLaunchAttribute pdl_attribute() {
  cudaLaunchAttribute a;
  memset(&a, 0, sizeof(a));
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

/* TW_FAULT_STALL_TILE (tests): the producer withholds the loads of that tile's first stage
 * (GemmParams::fault_stall) and every pipeline wait gives up after TW_FAULT_STALL_BOUND_MS, so a
 * test sees an internal stall reported (fused ops) or the kernel trapped (tw_gemm) within
 * seconds. */
template <class GP> void apply_fault_stall(GP &params) {
  const int64_t tile = tw_env_int(TW_FAULT_STALL_TILE_ID);
  if (tile < 0 || tile >= INT32_MAX)
    return;
  params.fault_stall = (int32_t)tile + 1;
  params.mbar_timeout_ns = (uint64_t)TW_FAULT_STALL_BOUND_MS * 1000 * 1000;
}

/* GemmParams::a_map and b_map: bf16 A [rows, k] (leading dimension lda) in {kBlockK, kBlockM}
 * boxes, bf16 B [n, k] (ldb) in {kBlockK, b_box_rows} boxes. Errors name `op` and the operand
 * (`a_name` for A). */
inline tw_status_t operand_maps(CUtensorMap *a_map, CUtensorMap *b_map, const void *a, int64_t rows,
                                int64_t lda, const void *b, int64_t n, int64_t ldb, int64_t k,
                                int b_box_rows, const char *op, const char *a_name) {
  char what[96];
  snprintf(what, sizeof(what), "%s: cuTensorMapEncodeTiled(%s)", op, a_name);
  tw_status_t st = tw_tma_map_2d(a_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, a, (uint64_t)k,
                                 (uint64_t)rows, (uint64_t)lda, kBlockK, kBlockM, what);
  if (st != TW_SUCCESS)
    return st;
  snprintf(what, sizeof(what), "%s: cuTensorMapEncodeTiled(b)", op);
  return tw_tma_map_2d(b_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, b, (uint64_t)k, (uint64_t)n,
                       (uint64_t)ldb, kBlockK, (uint32_t)b_box_rows, what);
}

/* EpiTmaStore<Out>'s c_map: Out [rows, cols] (ldc) in {128 / sizeof(Out), box_rows} boxes
 * (kBoxRows; EpiTmaStoreT's: the swap-AB tile's rows). */
template <class Out>
tw_status_t out_map(CUtensorMap *map, const void *c, int64_t cols, int64_t rows, int64_t ldc,
                    const char *what, int box_rows = kBoxRows) {
  return tw_tma_map_2d(
      map, sizeof(Out) == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
      sizeof(Out), c, (uint64_t)cols, (uint64_t)rows, (uint64_t)ldc, 128 / sizeof(Out),
      (uint32_t)box_rows, what);
}

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
