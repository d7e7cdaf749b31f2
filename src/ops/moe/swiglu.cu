/*
 * tw_swiglu (contract in tilewire.h): the elementwise step of the unfused MoE FFN, the same
 * function tw_moe_ffn runs between its GEMMs (swiglu.cuh).
 */
#include <cuda_runtime.h>

#include <stdint.h>

#include "ops/moe/swiglu.cuh"

extern "C" {
#include "core/status.h"
#include "runtime/argcheck.h"
#include "runtime/cuda_check.h"
}

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    swiglu_kernel(const uint16_t *h, uint16_t *act, int64_t rows, int64_t inter) {
  const int64_t per = (rows + gridDim.x - 1) / gridDim.x;
  const int64_t r0 = per * blockIdx.x, r1 = r0 + per < rows ? r0 + per : rows;
  if (r0 < r1)
    tw::moe::swiglu_rows(h, act, r0, r1, inter);
}

} // namespace

extern "C" tw_status_t tw_swiglu(const void *h, void *act, int64_t rows, int64_t inter,
                                 tw_stream_t stream) {
  TW_ARG_CHECK(rows >= 0, "tw_swiglu: rows is %lld; expected >= 0", (long long)rows);
  TW_ARG_CHECK(inter >= 8 && inter % 8 == 0 && inter <= INT32_MAX,
               "tw_swiglu: inter is %lld; expected a positive multiple of 8", (long long)inter);
  if (rows == 0)
    return TW_SUCCESS;
  TW_ARG_CHECK(h && (uintptr_t)h % 16 == 0, "tw_swiglu: h (%p) is NULL or not 16-byte aligned", h);
  TW_ARG_CHECK(act && (uintptr_t)act % 16 == 0,
               "tw_swiglu: act (%p) is NULL or not 16-byte aligned", act);
  const size_t h_bytes = (size_t)rows * (size_t)inter * 4, act_bytes = h_bytes / 2;
  int device = 0;
  tw_status_t st = tw_cuda_check(cudaGetDevice(&device), "tw_swiglu: cudaGetDevice");
  if (st == TW_SUCCESS)
    st = tw_check_device_range(device, h, h_bytes, "tw_swiglu: h");
  if (st == TW_SUCCESS)
    st = tw_check_device_range(device, act, act_bytes, "tw_swiglu: act");
  if (st == TW_SUCCESS)
    st = tw_check_disjoint(act, act_bytes, "tw_swiglu: act", h, h_bytes, "h");
  if (st != TW_SUCCESS)
    return st;
  /* enough CTAs for every SM several times over; a CTA takes a run of whole rows */
  const int64_t grid = rows < 4096 ? rows : 4096;
  swiglu_kernel<<<(unsigned)grid, kThreads, 0, (cudaStream_t)stream>>>(
      (const uint16_t *)h, (uint16_t *)act, rows, inter);
  return tw_cuda_check(cudaGetLastError(), "tw_swiglu: kernel launch");
}
