/*
 * Internal: a GEMM-core wait hook for tw_gemm_rs / tw_gemm_ar's unfused pipeline
 * (gemm_rs_unfused.cu). The pipeline's GEMM stores the rank's whole partial into its workspace
 * before any handshake of the call, so first every peer must have released that workspace
 * after its previous call on either channel of the family (done[ch][peer] >= this rank's epoch
 * there; the fused kernel and the reduce kernel set done at their ends). Each CTA's producer
 * waits once, before the loads of its first tile (the static schedule: tile blockIdx.x); the
 * flags are local and in steady state already set, so no launch of its own is spent on it.
 */
#pragma once

#include "device/signal.cuh"
#include "gemm/gemm_sm90.cuh"

namespace tw {
namespace gemm {

struct ReleasedWait : NoWait {
  struct Params {
    tw_dev_comm_t dc;
    TileOrder order; /* the loop's, to know each CTA's first tile */
    int32_t ch;      /* the call's channel: where a failed wait is recorded */
    int32_t pad;
  };
  __device__ static void before_tile(const Params &p, int32_t mb, int32_t nb) {
    int32_t mb0, nb0;
    tile_coords(p.order, (int32_t)blockIdx.x, mb0, nb0);
    if (mb != mb0 || nb != nb0 || !tw_op_usable(p.dc, p.ch))
      return;
    const int chans[2] = {TW_CH_GEMM_RS, TW_CH_GEMM_AR};
    /* a failure is recorded; the comm is aborted and the reduce kernel gives up */
    tw_wait_released(p.dc, p.ch, chans, 2);
  }
  template <class P> __device__ static void mbar_stuck(const P &p, int32_t code) {
    tw_pipeline_stall(p.dc, p.ch, code);
  }
};

} // namespace gemm
} // namespace tw
