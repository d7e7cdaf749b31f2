/* Internal entry to tw_gemm with explicit kernel choices (tests, tw-bench and the ops that run a
 * plain GEMM). */
#ifndef TW_OPS_GEMM_SM90_H
#define TW_OPS_GEMM_SM90_H

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_gemm_sm90_opts {
  int variant;       /* tw_gemm_variant_t, or -1: the heuristic's choice */
  int dynamic_queue; /* 1: claim tiles from the global atomic queue instead of a static stride */
  int group_m;       /* row blocks per L2 group; 0: the heuristic's choice */
  /* 1: launched as a programmatic dependent of the kernel before it in the stream, which
   * writes args->a and lets its dependents start early (griddepcontrol.launch_dependents): the
   * CTAs bring their share of b into L2 while that kernel runs and wait for its end before
   * they load a (GemmParams::after_grid). Only where that kernel's CTAs cannot wait on work
   * that this GEMM's CTAs would keep off the SMs (tw_ag_gemm's decode path on GPUs of their
   * own). 0: launched as usual. */
  int after_grid;
  /* The swap rule's bound on m (tw_gemm_swap_bn_upto: TW_GEMM_SWAP -1 swaps at m <= this, at
   * most TW_GEMM_SWAP_FORCED_MAX_M); 0: tw_gemm's own (tw_gemm_swap_rule_max_m: 128 or 64 by
   * n, the split and the SMs). */
  int swap_max_m;
  /* 1: the caller has checked every pointer of args (an op's own argument checks cover the
   * operands it hands on), so tw_gemm's check of them (device, extent, overlap) is not repeated;
   * 0: checked here. */
  int pointers_checked;
} tw_gemm_sm90_opts_t;

/* tw_gemm with explicit variant choices (opts may be NULL: same as tw_gemm). The queue of
 * dynamic_queue is one per device and process: do not run two such calls concurrently. */
TW_API tw_status_t tw_gemm_sm90_launch(const tw_gemm_args_t *args, tw_stream_t stream,
                                       const tw_gemm_sm90_opts_t *opts);

#ifdef __cplusplus
}
#endif
#endif
