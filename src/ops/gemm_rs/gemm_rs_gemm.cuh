/*
 * Internal: the GEMM of tw_gemm_rs / tw_gemm_ar's unfused pipeline (gemm_rs_unfused.cu), on the
 * engine's launch templates (gemm/gemm_run.cuh) with this op's own hooks: ReleasedWait
 * (gemm_released.cuh) where the GEMM stores the rank's partial into its workspace, and the
 * low-latency epilogues EpiLlPushT / EpiLlReduceT (gemm_ll.cuh) where the swap-AB GEMM stores
 * the partial as words into the owners' areas instead. The route is tw_gemm's for the shape
 * (plan variant, swap-AB, 64-row tiles), unsplit and on a static schedule.
 */
#pragma once

#include <cuda_runtime.h>
#include <string.h>

#include "gemm/gemm_heuristics.h"
#include "gemm/gemm_run.cuh"
#include "ops/gemm_rs/gemm_ll.cuh"
#include "ops/gemm_rs/gemm_released.cuh"
#include "runtime/devcomm.h"

extern "C" {
#include "core/env.h"
}

/* Where the low-latency epilogue stores (gemm_ll.cuh): every rank's area, this rank's
 * ll_seq, one parity's bytes, one slot's bytes, this rank, m / world. reduce (tw_gemm_rs): the
 * epilogue sums this rank's own rows itself into out (ldo elements a row), waiting for the
 * peers' words under dc's bounds, failures recorded under channel ch. */
typedef struct tw_gemm_ll_epi {
  uint8_t *area[TW_MAX_WORLD];
  const uint64_t *ll_seq;
  uint64_t half_bytes, slot_bytes;
  uint64_t digest; /* the call's (runtime/calldesc.h), in the words' flags */
  int32_t rank, m_local;
  int32_t reduce, ch;
  const struct tw_dev_comm *dc;
  void *out;
  int64_t ldo;
} tw_gemm_ll_epi_t;

namespace tw {
namespace gemm {

/* run_swap's fill for the low-latency epilogues: where the words go. */
template <class Out> struct LlFill {
  const tw_gemm_ll_epi_t *ll;
  template <class EP> tw_status_t operator()(EP &epi, const tw_gemm_args_t &a, int split) const {
    if (!ll || split != 1)
      return tw_fail(TW_ERR_INTERNAL, "tw_gemm_rs: the low-latency epilogue serves unsplit GEMMs");
    for (int r = 0; r < TW_MAX_WORLD; r++)
      epi.area[r] = ll->area[r];
    epi.ll_seq = ll->ll_seq;
    epi.digest = ll->digest;
    epi.half_bytes = ll->half_bytes;
    epi.slot_bytes = ll->slot_bytes;
    epi.rank = ll->rank;
    epi.m = (int32_t)a.m;
    epi.m_local = ll->m_local;
    epi.vecs = (int32_t)(a.n / (16 / (int64_t)sizeof(Out)));
    if constexpr (std::is_same<EP, LlReduceParams>::value) {
      if (!ll->dc || !ll->out)
        return tw_fail(TW_ERR_INTERNAL,
                       "tw_gemm_rs: the low-latency reduce needs a comm and an out");
      epi.dc = *ll->dc;
      epi.ch = ll->ch;
      epi.out = (__nv_bfloat16 *)ll->out;
      epi.ldo = ll->ldo;
    }
    return TW_SUCCESS;
  }
};

/* The pipeline's GEMM of a (c: the workspace; a.sm_count: the rank's SMs) on `stream`. With ll
 * (swap-AB shapes only) it stores words through the low-latency epilogue; else each CTA first
 * waits for the peers' release of the workspace on channel ch of dc (ReleasedWait). swap_max_m:
 * the swap rule's bound on m (tw_gemm_swap_bn_upto). */
template <class Out>
tw_status_t unfused_gemm(const tw_gemm_args_t &args, int swap_max_m, const tw_dev_comm_t *dc,
                         int ch, const tw_gemm_ll_epi_t *ll, cudaStream_t stream) {
  tw_gemm_args_t a = args;
  default_leading_dims(a);
  int device = 0, sms = 0;
  tw_status_t st = tw_cuda_check(cudaGetDevice(&device), "tw_gemm_rs: cudaGetDevice");
  if (st == TW_SUCCESS)
    st = tw_cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                       "tw_gemm_rs: multiprocessor count");
  if (st != TW_SUCCESS)
    return st;
  if (a.sm_count > 0 && a.sm_count < sms)
    sms = a.sm_count;
  tw_gemm_plan_t plan;
  tw_gemm_plan_make(a.m, a.n, a.k, sms, &plan);
  const int swap_env = (int)tw_env_int(TW_GEMM_SWAP_ID);
  const int swap_mt = tw_gemm_swap_bn_upto(
      swap_env, a.m, swap_max_m > 0 ? swap_max_m : tw_gemm_swap_rule_max_m(a.n, 1, sms));
  ReleasedWait::Params w;
  memset(&w, 0, sizeof(w));
  w.dc = *dc;
  w.ch = ch;
  if (swap_mt) {
    const bool half = tw_gemm_swap_half(swap_env, a.m, a.n, 1, sms) != 0;
    // 64-row tiles: 32 of A's rows wide at m <= 32
    const int mt = half ? tw_gemm_swap_half_mt(swap_mt, a.m) : swap_mt;
    if (ll && ll->reduce) /* tw_gemm_rs's own rows summed in the epilogue */
      return run_swap<Out, NoWait, EpiLlReduceT<Out>>(a, mt, half, sms, 1, device, stream,
                                                      NoWait::Params(), LlFill<Out>{ll});
    if (ll)
      return run_swap<Out, NoWait, EpiLlPushT<Out>>(a, mt, half, sms, 1, device, stream,
                                                    NoWait::Params(), LlFill<Out>{ll});
    return run_swap<Out, ReleasedWait>(a, mt, half, sms, 1, device, stream, w);
  }
  if (ll)
    return tw_fail(TW_ERR_INTERNAL,
                   "tw_gemm_rs: the low-latency epilogue serves swap-AB GEMMs (m %lld)",
                   (long long)a.m);
  const int variant = plan.variant;
  if (variant != TW_GEMM_V_S3_E32 && variant != TW_GEMM_V_N128_S6)
    return tw_fail(
        TW_ERR_INTERNAL,
        "tw_gemm_rs: the released wait serves unsplit 1-CTA static variants (variant %d)", variant);
  return run<Out, ReleasedWait>(a, plan, variant, false, 0, sms, 1, device, stream, w);
}

/* The three kernels of one tile configuration unfused_gemm<Out> may launch: the released wait
 * with the plain transposed store, and the two low-latency epilogues. */
template <int Stages, int EpiBytes, class Out, int BN, int kTileM> cudaError_t preload_hooks() {
  cudaError_t e = preload_one<Stages, EpiBytes, Out, false, 1, BN, 1, ReleasedWait,
                              EpiTmaStoreT<Out>, kTileM>();
  cudaError_t f =
      preload_one<Stages, EpiBytes, Out, false, 1, BN, 1, NoWait, EpiLlPushT<Out>, kTileM>();
  cudaError_t g =
      preload_one<Stages, EpiBytes, Out, false, 1, BN, 1, NoWait, EpiLlReduceT<Out>, kTileM>();
  return e != cudaSuccess ? e : (f != cudaSuccess ? f : g);
}

/* Loads every kernel unfused_gemm<Out> can launch. */
template <class Out> cudaError_t preload_unfused_gemm() {
  const cudaError_t all[] = {
      /* swap-AB's 128-row tiles, A rows 16 or 64 wide */
      preload_hooks<swap_stages<16>(), kSwapEpiBytes, Out, 16, kBlockM>(),
      preload_hooks<swap_stages<64>(), kSwapEpiBytes, Out, 64, kBlockM>(),
      /* swap-AB's 64-row tiles, A rows 16, 32 or 64 wide (one consumer warpgroup: MT / 2) */
      preload_hooks<swap_half_stages<16>(), kSwapHalfEpiBytes, Out, 8, 64>(),
      preload_hooks<swap_half_stages<32>(), kSwapHalfEpiBytes, Out, 16, 64>(),
      preload_hooks<swap_half_stages<64>(), kSwapHalfEpiBytes, Out, 32, 64>(),
      /* unswapped: launch_waited's two variants */
      preload_one<6, 16384, Out, false, 1, 128, 1, ReleasedWait>(),
      preload_one<3, 32768, Out, false, 1, kBlockN, 1, ReleasedWait>()};
  for (cudaError_t e : all)
    if (e != cudaSuccess)
      return e;
  return cudaSuccess;
}

} // namespace gemm
} // namespace tw
