/* Internal entry to the sm90 GEMM core with its variant knobs (tests and tw-bench only). */
#ifndef TW_OPS_GEMM_SM90_H
#define TW_OPS_GEMM_SM90_H

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

struct tw_dev_comm;

typedef struct tw_gemm_sm90_opts {
  int variant;       /* tw_gemm_variant_t, or -1: the heuristic's choice */
  int dynamic_queue; /* 1: claim tiles from the global atomic queue instead of a static stride */
  int group_m;       /* row blocks per L2 group; 0: the heuristic's choice */
  /* tw_gemm_rs / tw_gemm_ar's unfused pipeline (NULL otherwise): each CTA first waits until
   * every peer of this comm released the rank's workspace (gemm_released.cuh); unsplit, static
   * schedule, 1-CTA variants only. released_ch: the call's channel (tw_channel_t). */
  const struct tw_dev_comm *released;
  int released_ch;
  /* tw_gemm_rs / tw_gemm_ar's unfused pipeline through the low-latency area (NULL otherwise,
   * where it swaps A and B): the swap-AB GEMM (m <= 64, unsplit) stores its partial as low-latency
   * words into the owners' areas (gemm_ll.cuh) instead of into c; with `released` NULL. */
  const struct tw_gemm_ll_epi *ll;
  /* 1: launched as a programmatic dependent of the kernel before it in the stream, which
   * writes args->a and lets its dependents start early (griddepcontrol.launch_dependents): the
   * CTAs bring their share of b into L2 while that kernel runs and wait for its end before
   * they load a (GemmParams::after_grid). Only where that kernel's CTAs cannot wait on work
   * that this GEMM's CTAs would keep off the SMs (tw_ag_gemm's decode path on GPUs of their
   * own). The plain GEMM only (no `released`, no `ll`). 0: launched as usual. */
  int after_grid;
  /* The swap rule's bound on m (tw_gemm_swap_bn_upto: TW_GEMM_SWAP -1 swaps at m <= this, at
   * most TW_GEMM_SWAP_FORCED_MAX_M); 0: tw_gemm's own (tw_gemm_swap_rule_max_m: 128 or 64 by
   * n, the split and the SMs). */
  int swap_max_m;
} tw_gemm_sm90_opts_t;

/* Where tw_gemm_sm90_opts_t.ll's epilogue stores (gemm_ll.cuh): every rank's area, this rank's
 * ll_seq, one parity's bytes, one slot's bytes, this rank, m / world. reduce (tw_gemm_rs): the
 * epilogue sums this rank's own rows itself into out (ldo elements a row), waiting for the
 * peers' words under dc's bounds, failures recorded under channel ch. */
typedef struct tw_gemm_ll_epi {
  uint8_t *area[TW_MAX_WORLD];
  const uint64_t *ll_seq;
  uint64_t half_bytes, slot_bytes;
  int32_t rank, m_local;
  int32_t reduce, ch;
  const struct tw_dev_comm *dc;
  void *out;
  int64_t ldo;
} tw_gemm_ll_epi_t;

/* tw_gemm with explicit variant choices (opts may be NULL: same as tw_gemm). The queue of
 * dynamic_queue is one per device and process: do not run two such calls concurrently. */
TW_API tw_status_t tw_gemm_sm90_launch(const tw_gemm_args_t *args, tw_stream_t stream,
                                       const tw_gemm_sm90_opts_t *opts);

#ifdef __cplusplus
}
#endif
#endif
